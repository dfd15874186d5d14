"""GPU: the per-head paged layout on vLLM's FlashAttention against explicit torch attention.

The CUDA twin of test_cpu_per_head: compaction into fresh per-head pages of the HND cache, a
multi-token chunk written through the per-head slots, and FlashAttention over head-major virtual
sequences (one KV head each, the group's query heads as its heads), two rows of which one is plain."""

import pytest
import torch

pytestmark = pytest.mark.gpu

N, D, H, G = 16, 128, 4, 4


@pytest.mark.parametrize("allocation", ["uniform", "adakv"])
def test_compacted_and_plain_rows_match_explicit(allocation):
    from vllm.v1.attention.backends.fa_utils import flash_attn_varlen_func, get_flash_attn_version

    from vllm_evict.engine import per_head
    from vllm_evict.engine.compaction import LayerCompaction, compaction_slots
    from vllm_evict.engine.cuda_backend import CudaPagedCache
    from vllm_evict.engine.request_config import RequestEviction
    from vllm_evict.engine.request_state import WorkerEviction
    from vllm_evict.engine.step import StepPlan
    from vllm_evict.policies import EvictionConfig

    torch.manual_seed(3)
    dev, dt = "cuda", torch.bfloat16
    kv = torch.zeros(128, H, N, 2 * D, device=dev, dtype=dt)
    one = torch.ones((), device=dev)
    cache = CudaPagedCache(kv, D, "auto", one, one)

    def write_standard(keys, values, blocks):
        pos = torch.arange(keys.shape[0], device=dev)
        kv[blocks[pos // N].long(), :, pos % N] = torch.cat([keys, values], dim=-1)

    # row 0: compacted request (E=200, P=4), then a 5-token chunk; row 1: plain request, 37 tokens, 3-token chunk
    E, P, m0, L1, m1 = 200, 4, 5, 37, 3
    prompt_blocks = torch.arange(10, 23, device=dev, dtype=torch.int32)
    fresh, tail = [40, 41, 42, 43], [44]
    keys, values = torch.randn(E, H, D, device=dev, dtype=dt), torch.randn(E, H, D, device=dev, dtype=dt)
    write_standard(keys, values, prompt_blocks)
    gk, gv = cache.gather_prefix(prompt_blocks, E)
    assert torch.equal(gk, keys) and torch.equal(gv, values)
    counts = torch.tensor([6, 2, 5, 3]) if allocation == "adakv" else torch.full((H,), P)
    keep = torch.zeros(H, E, dtype=torch.bool, device=dev)
    for h in range(H):
        keep[h, torch.randperm(E, device=dev)[: int(counts[h]) * N]] = True
    slots = compaction_slots(keep, counts.to(dev), torch.tensor(fresh, device=dev), N)
    layout = LayerCompaction(page_counts=counts.to(dev), kept=keep.sum(1))
    cache.write_pages(gk.reshape(E * H, D), gv.reshape(E * H, D), slots.reshape(-1))
    plain_blocks = torch.tensor([60, 61, 62], device=dev, dtype=torch.int32)
    plain_k, plain_v = torch.randn(L1, H, D, device=dev, dtype=dt), torch.randn(L1, H, D, device=dev, dtype=dt)
    write_standard(plain_k[: L1 - m1], plain_v[: L1 - m1], plain_blocks)

    config = EvictionConfig.from_dict({"policy": "keydiff", "budget": 64})
    state = WorkerEviction.for_prompt("r", RequestEviction(config), E, N)
    assert state.pages == P
    state.advance()  # compacted
    state.layers[0] = layout
    block_table = torch.tensor([fresh + tail, plain_blocks.tolist() + [0, 0]], device=dev, dtype=torch.int32)
    seq_lens = torch.tensor([E + m0 - state.shift, L1], device=dev, dtype=torch.int32)  # worker-shifted
    qsl = torch.tensor([0, m0, m0 + m1], device=dev, dtype=torch.int32)
    n = m0 + m1
    plan = StepPlan(num_reqs=2, states=[state, None], captures=[], compacting=[], compacted_rows=[0],
                    per_head_rows=[0], per_head_tokens=list(range(m0)), page_size=N, max_blocks=5, row_blocks=[5, 3])
    tables = per_head.virtual_tables(plan, 0, block_table, seq_lens, qsl, n, H)
    new_k = torch.cat([torch.randn(m0, H, D, device=dev, dtype=dt), plain_k[L1 - m1:]])
    new_v = torch.cat([torch.randn(m0, H, D, device=dev, dtype=dt), plain_v[L1 - m1:]])
    cache.write_tokens(new_k, new_v, tables.slots)

    q = torch.randn(n, H * G, D, device=dev, dtype=dt)
    qv = q.view(n, H, G, D).transpose(0, 1).reshape(H * n, G, D)
    out = torch.empty_like(qv)
    flash_attn_varlen_func(q=qv, k=cache.key_pages, v=cache.value_pages, out=out,
                           cu_seqlens_q=plan.tables.query_start_loc, max_seqlen_q=m0,
                           seqused_k=tables.seq_lens.reshape(-1).to(torch.int32), max_seqlen_k=E + m0,
                           softmax_scale=D ** -0.5, causal=True, alibi_slopes=None, window_size=None,
                           block_table=tables.pages.reshape(2 * H, -1), softcap=0.0, scheduler_metadata=None,
                           fa_version=get_flash_attn_version())
    out = out.view(H, n, G, D).float()

    def explicit(qt, ks, vs):
        logits = (qt.float() @ ks.float().T) * D ** -0.5
        return logits.softmax(-1) @ vs.float()

    for h in range(H):
        for t in range(m0):
            ks = torch.cat([keys[keep[h], h], new_k[: t + 1, h]])
            vs = torch.cat([values[keep[h], h], new_v[: t + 1, h]])
            torch.testing.assert_close(out[h, t], explicit(q[t, h * G:(h + 1) * G], ks, vs), rtol=2e-2, atol=2e-2)
        for t in range(m1):
            upto = L1 - m1 + t + 1
            expected = explicit(q[m0 + t, h * G:(h + 1) * G], plain_k[:upto, h], plain_v[:upto, h])
            torch.testing.assert_close(out[h, m0 + t], expected, rtol=2e-2, atol=2e-2)
