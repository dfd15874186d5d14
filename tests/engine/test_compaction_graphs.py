"""Decode-point compactions replayed from CUDA graphs (vllm_evict/engine/compaction_graphs.py) leave the caches
and layouts of eager compaction, byte for byte: the first batch of a kind runs eagerly, the second is captured,
the third replays it on other blocks, other cache contents and other window queries; under uniform
allocation and Ada-KV, from vLLM's layout and (Ada-KV) from the per-head layout of an earlier point.

On the GPU through real CUDA graphs and the fused Triton scoring kernels; on the CPU through a stand-in graph
that replays the captured call on the same static tensors (what a CUDA graph re-executes), which checks what
the graphs read and record. Eagerly too, a per-head batch at its next point equals its requests compacted
alone, with block rows of equal and of unequal length."""

from __future__ import annotations

import contextlib

import pytest
import torch

N, D, H, G, L, R = 16, 64, 2, 4, 3, 2
PROMPT, DECODE_BUDGET, DECODE_EVERY = 100, 64, 32
POLICIES = ["dropkv", "snapkv", "keydiff", "knorm"]
ALLOCATIONS = ["uniform", "adakv"]


def decode_batch(config, blocks: list[list[int]], seed: int, device: str):
    """R requests at their second decode point (held K_d + C_d tokens, compacted in place), window queries
    drawn from `seed`."""
    from vllm_evict.engine.request_config import RequestEviction
    from vllm_evict.engine.request_state import WorkerEviction

    generator = torch.Generator(device=device).manual_seed(seed)
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
            state.q_window = torch.randn(L, state.window, H * G, D, device=device, generator=generator).to(
                torch.bfloat16 if device == "cuda" else torch.float32)
        batch.append(state)
    return batch


def next_point(batch, blocks: list[list[int]], seed: int, device: str) -> None:
    """Move a compacted batch on to its next decode point (in place, over the same blocks)."""
    from vllm_evict.engine.request_state import kept_most

    generator = torch.Generator(device=device).manual_seed(seed + 100)
    per_head = [state for state in batch if not state.stock_layout]
    if per_head:
        kept_most(per_head)
    for state, request_blocks in zip(batch, blocks):
        state.advance()
        assert state.point.decode and state.point.in_place
        state.prompt_block_ids = request_blocks
        state.fresh_blocks = request_blocks[: state.written_blocks]
        if state.window:
            state.q_window = torch.randn(L, state.window, H * G, D, device=device, generator=generator).to(
                torch.bfloat16 if device == "cuda" else torch.float32)


def replays_equal_eager(policy: str, allocation: str, make_cache, device: str, per_head: bool = False) -> list[bool]:
    """Three batches compacted eagerly and through CompactionGraphs on equal caches: both leave the same cache
    bytes and layouts after each. `per_head`: each batch is first compacted (eagerly, on both caches) at its
    first decode point, and the compared compaction is the next one (under Ada-KV from per-head layout).
    Returns whether each batch ran from a graph, and whether its kind (graph_key) was met before."""
    from vllm_evict.engine.compaction import GROUP_BYTES, KVHeadGroup, compact_requests
    from vllm_evict.engine.compaction_graphs import CompactionGraphs, graph_key
    from vllm_evict.policies import EvictionConfig

    torch.manual_seed(3)
    config = EvictionConfig.from_dict({"policy": policy, "allocation": allocation}, budget_required=False)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    kv = [torch.randn(64, H, N, 2 * D, device=device).to(dtype) for _ in range(L)]
    eager_kv, graph_kv = [c.clone() for c in kv], [c.clone() for c in kv]
    eager_layers = [(i, make_cache(c)) for i, c in enumerate(eager_kv)]
    graph_layers = [(i, make_cache(c)) for i, c in enumerate(graph_kv)]
    graphs = CompactionGraphs(True)
    blocks_per_request = -(-(DECODE_BUDGET + DECODE_EVERY) // N)
    ran, kinds = [], []
    for seed in range(3):  # each batch on blocks of its own
        start = seed * R * blocks_per_request
        blocks = [list(range(start + r * blocks_per_request, start + (r + 1) * blocks_per_request))[::-1]
                  for r in range(R)]
        eager, graphed = decode_batch(config, blocks, seed, device), decode_batch(config, blocks, seed, device)

        def requests(batch):
            ids = lambda b: torch.tensor(b, device=device)  # noqa: E731
            return [(s, ids(s.prompt_block_ids), ids(s.fresh_blocks)) for s in batch]

        if per_head:
            compact_requests(requests(eager), eager_layers, D ** -0.5)
            compact_requests(requests(graphed), graph_layers, D ** -0.5)
            next_point(eager, blocks, seed, device)
            next_point(graphed, blocks, seed, device)
            assert all(s.stock_layout == (allocation == "uniform") for s in eager + graphed)
        kinds.append(graph_key(graphed))
        compact_requests(requests(eager), eager_layers, D ** -0.5)
        replayed = graphs.run(graphed, graph_layers, D ** -0.5, KVHeadGroup(), None, {}, GROUP_BYTES)
        if not replayed:
            compact_requests(requests(graphed), graph_layers, D ** -0.5)
        ran.append(replayed)
        for i in range(L):
            assert torch.equal(graph_kv[i], eager_kv[i]), (seed, i)
            for e, g in zip(eager, graphed):
                assert torch.equal(g.layers[i].page_counts, e.layers[i].page_counts)
                assert torch.equal(g.layers[i].kept, e.layers[i].kept)
    assert not torch.equal(graph_kv[0], kv[0])  # the batches moved tokens
    return ran, [kind in kinds[:i] for i, kind in enumerate(kinds)]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("per_head", [False, True], ids=["first-point", "next-point"])
@pytest.mark.parametrize("allocation", ALLOCATIONS)
@pytest.mark.parametrize("policy", POLICIES)
def test_replayed_compactions_equal_eager_ones_on_the_gpu(monkeypatch, policy, allocation, per_head):
    from vllm_evict.engine.cuda_backend import CudaPagedCache
    from vllm_evict.kernels.key_scores import key_scores
    from vllm_evict.kernels.window_scores import window_scores
    from vllm_evict.policies import base, window

    monkeypatch.setattr(window, "_RAW_KERNEL", window_scores)  # the scoring kernels the engine installs
    monkeypatch.setattr(base, "_KEY_KERNEL", key_scores)
    ran, met = replays_equal_eager(policy, allocation, lambda kv: CudaPagedCache(kv, D, "auto", 1.0, 1.0), "cuda",
                                   per_head)
    assert ran == met and any(ran)  # a kind's first batch runs eagerly, the later ones from its graph


@pytest.fixture
def stand_in_graphs(monkeypatch):
    """torch.cuda's graphs on the CPU: a capture records the compaction call, a replay runs it again on the
    tensors it was given."""
    from vllm_evict.engine import compaction_graphs
    from vllm_evict.engine.compaction import LayerLayouts
    from vllm_evict.engine.cpu_backend import CpuPagedCache

    capturing = []

    class Graph:
        def replay(self):
            self.work()

    @contextlib.contextmanager
    def graph(captured, **kwargs):
        capturing.append(captured)
        yield
        capturing.pop()

    def captured_compaction(outputs, requests, *args, **kwargs):
        seen = []  # the host state the capture saw: the stand-ins' layouts before this compaction
        for state, _, _ in requests:
            seen.append(LayerLayouts())
            seen[-1].follow(state.layers)

        def work():
            for (state, _, _), layouts in zip(requests, seen):
                state.layers = LayerLayouts()
                state.layers.follow(layouts)
            compact_into(outputs, requests, *args, **kwargs)

        capturing[-1].work = work

    monkeypatch.setattr(torch.cuda, "CUDAGraph", Graph)
    monkeypatch.setattr(torch.cuda, "graph", graph)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: None)
    compact_into = compaction_graphs.compact_into
    monkeypatch.setattr(compaction_graphs, "compact_into", captured_compaction)
    return lambda kv: CpuPagedCache(kv, "vec16", 1.0, 1.0, "auto")


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU vLLM's cache ops; on CUDA the test above runs real graphs")
@pytest.mark.parametrize("per_head", [False, True], ids=["first-point", "next-point"])
@pytest.mark.parametrize("allocation", ALLOCATIONS)
@pytest.mark.parametrize("policy", POLICIES)
def test_replayed_compactions_equal_eager_ones(stand_in_graphs, policy, allocation, per_head):
    ran, met = replays_equal_eager(policy, allocation, stand_in_graphs, "cpu", per_head)
    assert ran == met and any(ran)  # a kind's first batch runs eagerly, the later ones from its graph


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU vLLM's cache ops")
@pytest.mark.parametrize("extra", [[0, 0], [0, 3]], ids=["equal-rows", "unequal-rows"])
@pytest.mark.parametrize("policy", ["dropkv", "snapkv"])
def test_next_point_batch_equals_each_request_alone(policy, extra):
    """Eagerly, a batch at its next point from per-head layout (Ada-KV) leaves each request's pages and layout
    as compacting it alone does: with block rows of equal length, and of unequal length (a request lists
    blocks past those its layout spans, as in-place points of different fill do; its row is zero-padded)."""
    from vllm_evict.engine.compaction import compact_requests
    from vllm_evict.engine.cpu_backend import CpuPagedCache
    from vllm_evict.policies import EvictionConfig

    config = EvictionConfig.from_dict({"policy": policy, "allocation": "adakv"}, budget_required=False)
    blocks_per_request = -(-(DECODE_BUDGET + DECODE_EVERY) // N)
    blocks = [list(range(r * 8 + blocks_per_request * r, r * 8 + blocks_per_request * (r + 1)))[::-1]
              for r in range(R)]
    kv = [torch.randn(64, H, N, 2 * D) for _ in range(L)]

    def run(batches):
        caches = [c.clone() for c in kv]
        layers = [(i, CpuPagedCache(c, "vec16", 1.0, 1.0, "auto")) for i, c in enumerate(caches)]
        states = decode_batch(config, blocks, 0, "cpu")
        compact_requests([(s, torch.tensor(s.prompt_block_ids), torch.tensor(s.fresh_blocks)) for s in states],
                         layers, D ** -0.5)
        next_point(states, blocks, 0, "cpu")
        for state, more in zip(states, extra):  # blocks past the layout's: read rows of another length
            state.prompt_block_ids = state.prompt_block_ids + list(range(60, 60 + more))
        for batch in batches:
            compact_requests([(states[r], torch.tensor(states[r].prompt_block_ids),
                               torch.tensor(states[r].fresh_blocks)) for r in batch], layers, D ** -0.5)
        return caches, states

    alone, alone_states = run([[r] for r in range(R)])
    together, states = run([list(range(R))])
    assert not all(s.stock_layout for s in states)
    for i in range(L):
        assert torch.equal(together[i], alone[i]), i
        for state, expected in zip(states, alone_states):
            assert torch.equal(state.layers[i].page_counts, expected.layers[i].page_counts)
            assert torch.equal(state.layers[i].kept, expected.layers[i].kept)
