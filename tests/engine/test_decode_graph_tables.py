"""per_head.DecodeGraphTables, the per-head FULL decode graphs' tables: a mixed batch (two Ada-KV rows, a
stock row, rows past the batch) loaded and laid out per layer, against kernels/per_head_tables.py's
reference, with the layer's query copied into its staged queries and its K/V written at the token slots.
Each layer's order lists the virtual sequences longest first, its first n*H entries permute
0 .. n*H - 1 for every graph size n >= the batch, position is its inverse, and the layer's pages and
lengths sit at those positions while the token slots stay by (row, head). CPU (CI): in the Triton
interpreter (subprocess). GPU: compiled; and cuda_backend.ordered_decode_attention (FlashAttention 3 reading
sequences in that order, queries and outputs in place) against stock FlashAttention in natural order and
explicit attention, split and unsplit, bf16 and fp8 caches."""

from __future__ import annotations

import pytest
import torch

from tests.kernels.interpreter import check_in_interpreter

MAX_ROWS, WIDTH = 6, 8


def check(device: str, seed: int) -> None:
    from tests.engine.test_per_head_tables import H, L, N, compacted_state
    from vllm_evict.engine.per_head import DecodeGraphTables
    from vllm_evict.engine.step import StepPlan
    from vllm_evict.kernels.per_head_tables import decode_tables_reference

    gen = torch.Generator().manual_seed(seed)
    tables = DecodeGraphTables(num_layers=L, max_rows=MAX_ROWS, num_heads=H, max_pages=WIDTH * H, page_size=N,
                               device=torch.device(device), num_q_heads=2 * H, head_dim=8, dtype=torch.float32)
    first, third = compacted_state(gen, 20, 2), compacted_state(gen, 13, 3)
    plan = StepPlan(num_reqs=3, states=[first, None, third], captures=[], compacting=[], compacted_rows=[0, 2],
                    per_head_rows=[0, 2], per_head_tokens=[0, 2], page_size=N)
    seq_lens = torch.tensor([2 * N + 5, int(torch.randint(1, WIDTH * N, (), generator=gen)), 3 * N + 2],
                            dtype=torch.int32)
    block_table = torch.randperm(3 * WIDTH * 2, generator=gen)[: 3 * WIDTH].view(3, WIDTH).to(torch.int32)
    tables.load(plan, seq_lens.to(device))
    for layer in range(L):
        order, position = tables.order[layer].cpu(), tables.position[layer].cpu()
        for n in range(3, MAX_ROWS + 1):
            assert sorted(order[: n * H].tolist()) == list(range(n * H)), (layer, n, order)
        assert torch.equal(position[order[:-1].long()], torch.arange(MAX_ROWS * H, dtype=torch.int32))
        # the fused query copy (into this layer's staged queries) and K/V write (at the token slots)
        qkv = torch.randn(3, 4 * H * 8, generator=gen).to(device)
        keys, values = qkv[:, 2 * H * 8:].unflatten(1, (2, H, 8)).unbind(1)
        cache = torch.zeros(3 * WIDTH * 2, H, N, 16, device=device)
        pages, lens, slots = tables.layer(layer, block_table.to(device), seq_lens.to(device), qkv[:, : 2 * H * 8],
                                          (keys, values, cache))
        assert torch.equal(tables.queries[layer, :3].reshape(3, -1), qkv[:, : 2 * H * 8])
        written = cache.view(-1, 16)[slots.view(3, H)]                 # [3, H, 2*D] at each token's slot
        assert torch.equal(written, torch.cat([keys, values], dim=-1))
        ref_pages, ref_lens, ref_slots = decode_tables_reference(
            block_table, seq_lens, tables.fresh[:3].cpu(), tables.counts[layer, :3].cpu(),
            tables.kept[layer, :3].cpu(), 1, N)
        lens, pages = lens.cpu(), pages.cpu()
        assert torch.equal(lens, ref_lens.flatten()[order[: 3 * H]]), (layer, lens, ref_lens, order)
        assert lens.tolist() == sorted(lens.tolist(), reverse=True)  # longest first
        assert torch.equal(slots.cpu(), ref_slots.flatten())
        for position, sequence in enumerate(order[: 3 * H].tolist()):
            row, head = divmod(sequence, H)
            expected = ref_pages[row][head]
            assert pages[position, : len(expected)].tolist() == expected, (layer, position, row, head)
    # The per-head rows' layouts stay; a shorter batch reorders (its first n*H entries permute 0 .. n*H - 1).
    plan.num_reqs, plan.states, plan.per_head_rows = 1, [first], [0]
    tables.load(plan, seq_lens.to(device))
    assert tables.ordered_rows == 1 and sorted(tables.order[0, :H].tolist()) == list(range(H))
    assert int(tables.fresh[2]) == 0 and int(tables.counts[:, 2].abs().sum()) == 0  # row 2 left: zeroed
    # A step that replays no per-head graph (no per-head rows, captures or compactions) is not ordered.
    before = tables.order.clone()
    plan.num_reqs, plan.states, plan.per_head_rows = 2, [None, None], []
    tables.load(plan, seq_lens.to(device))
    assert tables.ordered_rows == 0 and torch.equal(tables.order, before)
    assert int(tables.fresh.abs().sum()) == 0 and int(tables.counts.abs().sum()) == 0


def test_in_triton_interpreter():
    pytest.importorskip("triton")
    check_in_interpreter("tests.engine.test_decode_graph_tables", seeds=2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_gpu():
    for seed in range(5):
        check("cuda", seed)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("cache_dtype", ["auto", "fp8"])
def test_ordered_decode_attention_on_gpu(cache_dtype):
    from vllm.platforms import current_platform
    from vllm.v1.attention.backends.fa_utils import flash_attn_varlen_func, get_flash_attn_version

    from vllm_evict.engine.cuda_backend import CudaPagedCache, descales, ordered_decode_attention

    if get_flash_attn_version() != 3:
        pytest.skip("FlashAttention 3 (Hopper)")
    rows, heads, group, dim, page = 37, 8, 4, 128, 16
    sequences = rows * heads
    dev, dt, fp8 = "cuda", torch.bfloat16, cache_dtype == "fp8"
    gen = torch.Generator().manual_seed(0)
    lens = (torch.rand(sequences, generator=gen) ** 3 * 3000).to(torch.int32) + 1   # uneven, 1 .. 3000
    counts = (lens + page - 1) // page
    kv = torch.randn(int(counts.sum()) // heads + 2, heads, page, 2 * dim, dtype=dt, generator=gen).to(dev)
    q = torch.randn(sequences, group, dim, dtype=dt, generator=gen).to(dev)
    kv_scale, q_scale = torch.tensor(0.05, device=dev), torch.tensor(0.02, device=dev)
    if fp8:  # stored as vLLM stores an fp8 cache (bytes), queries quantized as vLLM's attention layer does
        kv = (kv / kv_scale).to(current_platform.fp8_dtype()).view(torch.uint8)
        q = (q / q_scale).to(current_platform.fp8_dtype())
    else:
        kv_scale = q_scale = torch.ones((), device=dev)
    cache = CudaPagedCache(kv, dim, cache_dtype, kv_scale, kv_scale, q_scale, model_dtype=dt)
    page_ids = torch.randperm(kv.shape[0] * heads, generator=gen)
    table = torch.zeros(sequences, int(counts.max()), dtype=torch.int32)
    start = 0
    for i, c in enumerate(counts.tolist()):
        table[i, :c] = page_ids[start: start + c]
        start += c
    natural = torch.empty(q.shape, dtype=dt, device=dev)
    flash_attn_varlen_func(q=q, k=cache.attn_key_pages, v=cache.attn_value_pages, out=natural,
                           cu_seqlens_q=torch.arange(sequences + 1, dtype=torch.int32, device=dev), max_seqlen_q=1,
                           seqused_k=lens.to(dev), max_seqlen_k=int(lens.max()), softmax_scale=dim ** -0.5,
                           causal=True, block_table=table.to(dev), fa_version=3, num_splits=1,
                           **descales(cache, q, sequences))
    keys, values = cache.attn_key_pages.float() * kv_scale, cache.attn_value_pages.float() * kv_scale
    for i in torch.randint(0, sequences, (12,), generator=gen).tolist():  # explicit attention on some sequences
        ids = table[i, : int(counts[i])].long().to(dev)
        k, v = keys[ids].reshape(-1, dim)[: int(lens[i])], values[ids].reshape(-1, dim)[: int(lens[i])]
        expected = ((q[i].float() * q_scale @ k.T) * dim ** -0.5).softmax(-1) @ v
        tolerance = 6e-2 if fp8 else 2e-2  # FA3's fp8 path rounds the probabilities to fp8 too
        torch.testing.assert_close(natural[i].float(), expected, rtol=tolerance, atol=tolerance)
    order = torch.sort(lens, descending=True, stable=True).indices
    for num_splits in (1, 32):
        out = torch.full(q.shape, float("nan"), dtype=dt, device=dev)
        query_rows = torch.cat([order, order[:1]]).to(torch.int32).to(dev)
        ordered_decode_attention(q, cache, query_rows, torch.ones(sequences, dtype=torch.int32, device=dev),
                                 lens[order].to(dev), table[order].to(dev), int(lens.max()), out, dim ** -0.5, 0.0,
                                 num_splits=num_splits)
        torch.testing.assert_close(out, natural, rtol=1e-2, atol=1e-2)


def test_the_evicted_groups_builders_share_one_query_stage(monkeypatch):
    """A TurboQuant model's evicted KV cache group has two metadata builders (TurboQuant's, FlashAttention's
    for the boundary layers): their tables stage every evicted layer's queries in one buffer, which the worker
    reads after a staged graph; a later engine's builders get a buffer of their own. (Tables only: their
    kernels are not run here.)"""
    from types import SimpleNamespace

    from vllm_evict.engine import attention
    from vllm_evict.engine.per_head import DecodeGraphTables
    from vllm_evict.engine.step import BUILD

    monkeypatch.setattr(DecodeGraphTables, "layer", lambda *args, **kwargs: None)
    names = [f"model.layers.{i}.self_attn.attn" for i in range(4)]
    monkeypatch.setattr(BUILD, "evicted_layers", frozenset(names))
    monkeypatch.setattr(BUILD, "staged_queries", None)
    config = SimpleNamespace(
        num_speculative_tokens=0, scheduler_config=SimpleNamespace(max_num_seqs=8),
        compilation_config=SimpleNamespace(max_cudagraph_capture_size=4),
        model_config=SimpleNamespace(max_model_len=64, get_num_attention_heads=lambda parallel: 4, dtype=torch.float32),
        cache_config=SimpleNamespace(cache_dtype="auto"), parallel_config=None)
    spec = SimpleNamespace(block_size=16, num_kv_heads=2, head_size=8)

    def tables(layers, per_head_path):
        return attention.decode_graph_tables(spec, [names[i] for i in layers], config, torch.device("cpu"), True,
                                             torch.float32, per_head_path)

    boundary, quantized = tables([0, 3], per_head_path=False), tables([1, 2], per_head_path=False)
    assert boundary.queries is quantized.queries and tuple(boundary.queries.shape) == (4, 4, 4, 8)
    assert boundary.max_pages == 1
    monkeypatch.setattr(BUILD, "staged_queries", None)  # set_kv_cache_groups: the next engine's
    per_head = tables([0, 1, 2, 3], per_head_path=True)
    assert per_head.queries is not quantized.queries and per_head.max_pages == 64 // 16 + 1
    assert tables([0], per_head_path=False) is not None and attention.decode_graph_tables(
        spec, ["model.layers.9.mlp"], config, torch.device("cpu"), True, torch.float32, False) is None
