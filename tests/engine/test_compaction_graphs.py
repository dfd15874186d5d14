"""GPU: decode-point compactions replayed from CUDA graphs (vllm_evict/engine/compaction_graphs.py) leave the
caches and layouts of eager compaction, byte for byte: the first batch of a kind runs eagerly, the second is
captured, the third replays it on other blocks, other cache contents and other window queries. Kinds the
graphs leave eager (Ada-KV) stay eager."""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

N, D, H, G, L, R = 16, 64, 2, 4, 3, 2
PROMPT, DECODE_BUDGET, DECODE_EVERY = 100, 64, 32


def decode_batch(config, blocks: list[list[int]], seed: int):
    """R requests at their second decode point (held K_d + C_d tokens, compacted in place), window queries
    drawn from `seed`."""
    from vllm_evict.engine.request_config import RequestEviction
    from vllm_evict.engine.request_state import WorkerEviction

    generator = torch.Generator(device="cuda").manual_seed(seed)
    batch = []
    for r, request_blocks in enumerate(blocks):
        spec = RequestEviction(config, decode_budget=DECODE_BUDGET, decode_every=DECODE_EVERY)
        state = WorkerEviction.for_prompt(f"s{seed}r{r}", spec, PROMPT, N)
        state.done = 1
        point = state.point
        assert point.decode and point.in_place and point.held == DECODE_BUDGET + DECODE_EVERY
        state.prompt_block_ids = request_blocks[: -(-point.held // N)]
        state.fresh_blocks = request_blocks[: state.written_blocks]
        if state.window:
            state.q_window = torch.randn(L, state.window, H * G, D, device="cuda", dtype=torch.bfloat16,
                                         generator=generator)
        batch.append(state)
    return batch


def make_layers(kv: list[torch.Tensor]):
    from vllm_evict.engine.cuda_backend import CudaPagedCache

    return [(i, CudaPagedCache(cache, D, "auto", 1.0, 1.0)) for i, cache in enumerate(kv)]


@pytest.mark.parametrize("allocation", ["uniform", "adakv"])
@pytest.mark.parametrize("policy", ["dropkv", "snapkv", "keydiff", "knorm"])
def test_replayed_compactions_equal_eager_ones(monkeypatch, policy, allocation):
    """Through the fused Triton scoring kernels the engine installs."""
    from vllm_evict.engine.compaction import compact_requests
    from vllm_evict.engine.compaction_graphs import CompactionGraphs
    from vllm_evict.kernels.key_scores import key_scores
    from vllm_evict.kernels.window_scores import window_scores
    from vllm_evict.policies import EvictionConfig, base, window

    monkeypatch.setattr(window, "_RAW_KERNEL", window_scores)
    monkeypatch.setattr(base, "_KEY_KERNEL", key_scores)
    torch.manual_seed(3)
    config = EvictionConfig.from_dict({"policy": policy, "allocation": allocation}, budget_required=False)
    kv = [torch.randn(64, H, N, 2 * D, device="cuda").to(torch.bfloat16) for _ in range(L)]
    eager_kv, graph_kv = [c.clone() for c in kv], [c.clone() for c in kv]
    eager_layers, graph_layers = make_layers(eager_kv), make_layers(graph_kv)
    graphs = CompactionGraphs(True)
    blocks_per_request = -(-(DECODE_BUDGET + DECODE_EVERY) // N)
    ran = []
    for seed in range(3):  # each batch on blocks of its own
        start = seed * R * blocks_per_request
        blocks = [list(range(start + r * blocks_per_request, start + (r + 1) * blocks_per_request))[::-1]
                  for r in range(R)]
        eager, graphed = decode_batch(config, blocks, seed), decode_batch(config, blocks, seed)

        def requests(batch):
            ids = lambda b: torch.tensor(b, device="cuda")  # noqa: E731
            return [(s, ids(s.prompt_block_ids), ids(s.fresh_blocks)) for s in batch]

        compact_requests(requests(eager), eager_layers, D ** -0.5)
        replayed = graphs.run(graphed, graph_layers, D ** -0.5, *_defaults())
        if not replayed:
            compact_requests(requests(graphed), graph_layers, D ** -0.5)
        ran.append(replayed)
        torch.cuda.synchronize()
        for i in range(L):
            assert torch.equal(graph_kv[i], eager_kv[i]), (seed, i)
            for e, g in zip(eager, graphed):
                assert torch.equal(g.layers[i].page_counts, e.layers[i].page_counts)
                assert torch.equal(g.layers[i].kept, e.layers[i].kept)
    assert ran == ([False, True, True] if allocation == "uniform" else [False] * 3)
    assert not torch.equal(graph_kv[0], kv[0])  # the batches moved tokens


def _defaults():
    """heads, rotation, followers, group_bytes as a one-rank worker without a draft model passes them."""
    from vllm_evict.engine.compaction import GROUP_BYTES, KVHeadGroup

    return KVHeadGroup(), None, {}, GROUP_BYTES
