"""kernels/per_head_tables.py: the Triton decode-table kernel against its one-entry-at-a-time reference.

Fresh random batches mix padding rows (length 0), stock rows (P = 0) and per-head rows with uneven
(Ada-KV-like) page counts, some of whose heads keep the whole prompt in a partial last page; query
lengths 1 and 3; the virtual sequences in natural and in random order; the fused query copy, with and
without the fused K/V write (checked against a copy and a slot-by-slot write). CPU (CI): the kernel in the
Triton interpreter (subprocess). GPU (``-m gpu``): the compiled kernel."""

from __future__ import annotations

import pytest
import torch

from tests.kernels.interpreter import check_in_interpreter

PAGE = 16


def random_batch(gen: torch.Generator, num_rows: int, num_heads: int, query_len: int, width: int):
    """Block table, seq_lens, fresh, counts, kept of a random mixed batch (int32, CPU)."""
    block_table = torch.randperm(num_rows * width * 2, generator=gen)[: num_rows * width].view(num_rows, width)
    seq_lens = torch.zeros(num_rows, dtype=torch.int64)
    fresh = torch.zeros(num_rows, dtype=torch.int64)
    counts = torch.zeros(num_rows, num_heads, dtype=torch.int64)
    kept = torch.zeros(num_rows, num_heads, dtype=torch.int64)
    for r in range(num_rows):
        kind = int(torch.randint(0, 3, (), generator=gen))
        if kind == 0:  # padding row
            continue
        decoded = int(torch.randint(query_len, 3 * PAGE, (), generator=gen))
        if kind == 1:  # stock layout
            seq_lens[r] = int(torch.randint(query_len, (width - 1) * PAGE, (), generator=gen))
            continue
        p = int(torch.randint(1, 4, (), generator=gen))
        evict_at = int(torch.randint(p * PAGE, p * num_heads * PAGE, (), generator=gen))
        split = 1 + torch.bincount(torch.randint(0, num_heads, (p * num_heads - num_heads,), generator=gen),
                                   minlength=num_heads)
        fresh[r], counts[r] = p, split
        kept[r] = torch.clamp(split * PAGE, max=evict_at)
        seq_lens[r] = p * PAGE + decoded  # worker-shifted length
    return [t.to(torch.int32) for t in (block_table, seq_lens, fresh, counts, kept)]


def fused_inputs(gen: torch.Generator, block_table: torch.Tensor, num_heads: int, ref_slots: torch.Tensor,
                 device: str) -> tuple[dict, tuple]:
    """The fused arguments: strided views of a fused QKV projection (as vLLM hands them to attention) and a
    random cache of every page a block table can name; with what they must hold afterwards: the contiguous
    queries, and the cache with each scheduled token's K/V at its reference slot (-1: nothing)."""
    group, dim, tokens = 3, 8, ref_slots.shape[0]

    def views(qkv: torch.Tensor) -> tuple:  # queries [T, g*H*D], keys and values [T, H, D]
        keys, values = qkv[:, group * num_heads * dim:].unflatten(1, (2, num_heads, dim)).unbind(1)
        return qkv[:, : group * num_heads * dim], keys, values

    dtype = torch.bfloat16 if device == "cuda" else torch.float32   # the GPU: the engine's dtype
    qkv = torch.randn(tokens, (group + 2) * num_heads * dim, generator=gen).to(dtype)
    queries, keys, values = views(qkv)
    # every block the table names; blocks strided apart, as a hybrid model's padded pages are
    padded = torch.randn(int(block_table.max()) + 1, num_heads + 1, PAGE, 2 * dim, generator=gen).to(dtype)
    expected = padded[:, :num_heads].clone()
    for t in range(tokens):
        for h in range(num_heads):
            slot = int(ref_slots[t, h])
            if slot >= 0:
                block, head = divmod(slot // PAGE, num_heads)
                expected[block, head, slot % PAGE] = torch.cat([keys[t, h], values[t, h]])
    on_device, cache = views(qkv.to(device)), padded.to(device)[:, :num_heads]
    args = {"queries": (on_device[0], torch.full(queries.shape, float("nan"), dtype=dtype, device=device)),
            "kv": (*on_device[1:], cache)}
    return args, (queries, expected)


def check(device: str, seed: int) -> None:
    from vllm_evict.kernels.per_head_tables import decode_tables, decode_tables_reference

    gen = torch.Generator().manual_seed(seed)
    for num_rows, num_heads, query_len in [(7, 3, 1), (5, 8, 3), (1, 2, 1)]:
        width = 12
        inputs = random_batch(gen, num_rows, num_heads, query_len, width)
        ref_pages, ref_lens, ref_slots = decode_tables_reference(*inputs, query_len, PAGE)
        # natural order, and a random order of the virtual sequences (pages and lens move, slots do not)
        for dest in (torch.arange(num_rows * num_heads, dtype=torch.int32),
                     torch.randperm(num_rows * num_heads, generator=gen).to(torch.int32)):
            position = dest.long()
            pages = torch.full((num_rows * num_heads, width + 4), -7, dtype=torch.int32, device=device)
            lens = torch.full((num_rows * num_heads,), -7, dtype=torch.int32, device=device)
            slots = torch.full((num_rows * query_len, num_heads), -7, dtype=torch.int64, device=device)
            write = bool(torch.randint(0, 2, (), generator=gen))
            fused, (queries, cache) = fused_inputs(gen, inputs[0], num_heads, ref_slots, device)
            before = fused["kv"][2].cpu().clone()
            decode_tables(*(t.to(device) for t in inputs), query_len, PAGE, pages, lens, slots, dest.to(device),
                          fused["queries"], fused["kv"] if write else None)
            assert torch.equal(lens.cpu()[position], ref_lens.flatten()), (lens, ref_lens, dest)
            assert torch.equal(slots.cpu(), ref_slots), (slots, ref_slots)
            assert torch.equal(fused["queries"][1].cpu(), queries)
            assert torch.equal(fused["kv"][2].cpu(), cache if write else before)
            for h in range(num_heads):
                for r in range(num_rows):
                    got = pages[position[r * num_heads + h], : len(ref_pages[r][h])].cpu().tolist()
                    assert got == ref_pages[r][h], (r, h, got, ref_pages[r][h], dest)


def test_reference_rule_by_hand():
    """The reference on one hand-written row: P = 2, H = 2, head 0 keeps 3 pages, head 1 keeps 1."""
    from vllm_evict.kernels.per_head_tables import decode_tables_reference

    block_table = torch.tensor([[10, 11, 12, 13]], dtype=torch.int32)
    seq_lens = torch.tensor([2 * PAGE + 5], dtype=torch.int32)  # P*page + 5 decoded tokens
    fresh = torch.tensor([2], dtype=torch.int32)
    counts = torch.tensor([[3, 1]], dtype=torch.int32)
    kept = torch.tensor([[3 * PAGE, PAGE]], dtype=torch.int32)
    pages, lens, slots = decode_tables_reference(block_table, seq_lens, fresh, counts, kept, 1, PAGE)
    # flat slots 0..2 (head 0) = (block 10, slot 0), (11, 0), (10, 1); flat slot 3 (head 1) = (11, 1)
    assert pages[0][0] == [10 * 2 + 0, 11 * 2 + 0, 10 * 2 + 1, 12 * 2 + 0]
    assert pages[0][1] == [11 * 2 + 1, 12 * 2 + 1]
    assert lens.tolist() == [[3 * PAGE + 5, PAGE + 5]]
    assert slots.tolist() == [[(12 * 2 + 0) * PAGE + 4, (12 * 2 + 1) * PAGE + 4]]


def test_kernel_in_triton_interpreter():
    pytest.importorskip("triton")
    check_in_interpreter("tests.kernels.test_per_head_tables")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_kernel_on_gpu():
    for seed in range(20):
        check("cuda", seed)
