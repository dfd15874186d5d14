"""Per-(request, KV head) decode tables of one layer, on device, for FULL CUDA graphs, and in the same launch the
layer's query copy (and optionally the scheduled tokens' K/V writes) that a per-head decode step needs.

A batch row r becomes H virtual sequences (r, h), ordered row-major: for one decode token per row the
queries [R, H, g, D] are already the virtual sequences' queries, with no reorder copy. Row r's virtual sequence for
head h reads, in order: its kept pages of this layer (flat slots [start_h, start_h + p_h) of the row's
first P blocks, flat slot s = slot `s // P` of block `s % P`; vllm_evict/engine/compaction.py) and
then slot h of the row's later blocks. A row with P = 0 (not compacted, or compacted with the stock
layout) is the stock layout: slot h of every block. Everything is read from persistent buffers and
written in place, so the kernel can be captured once and replayed every step.

Inputs (R rows, H KV heads, W block-table columns, q tokens per row, page = tokens per page):
    block_table [R, W] int32   vLLM's block ids
    seq_lens    [R]    int32   attention lengths (compacted rows already lowered by E - P*page); 0 = padding
    fresh       [R]    int32   P of rows with per-head pages, else 0
    counts      [R, H] int32   p_h (pages of head h, this layer); 0 where fresh is 0
    kept        [R, H] int32   kept prompt tokens of head h, this layer; 0 where fresh is 0
    dest        [R*H]  int32   the position of virtual sequence (r, h) in `pages` and `lens` (a permutation
                               of 0..R*H-1: FlashAttention takes its sequences in that order)
Outputs:
    pages [R*H, Wv]  int32     page ids (block * H + slot) at row dest[r*H + h]; columns past a sequence's
                               length untouched
    lens  [R*H]      int32     virtual lengths seq_len - P*page + kept_h (0 for padding rows), at dest[r*H + h]
    slots [R*q, H]   int64     cache slot (page * page_size + offset) of the row's q scheduled tokens,
                               the last q positions of the row; -1 for padding rows
Fused (a per-head decode step would otherwise launch a query copy, a K/V copy and vLLM's cache write after
this kernel, each a few microseconds a layer on the GPU):
    queries (source [R*q, Hq*D], unit stride in the last dim; destination [R*q, Hq*D] contiguous), any dtype:
                               the source copied into the destination
    kv, optional (keys [R*q, H, D], values [R*q, H, D]; cache [blocks, H, page, 2*D] of the same dtype, K in [..., :D],
                               V in [..., D:]; each with unit stride in the last dim): each scheduled token's key and
                               value of head h stored at its slot, unchanged (a cache of the model dtype;
                               quantized caches are written by vLLM's own quantizing kernel); padding rows skipped
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _page_ids(col, count_h, start_h, fresh, h):
    """(block-table column, slot in that block) of page `col` of virtual sequence h."""
    in_kept = col < count_h
    flat = start_h + col
    divisor = tl.maximum(fresh, 1)
    block_col = tl.where(in_kept, flat % divisor, fresh + col - count_h)
    slot = tl.where(in_kept, flat // divisor, h)
    return block_col, slot


@triton.jit(do_not_specialize=["num_rows", "query_len", "stride_q", "stride_k", "stride_kh", "stride_v",
                             "stride_vh", "stride_cb", "stride_ch", "stride_cn"])
def _decode_tables_kernel(block_table, seq_lens, fresh, counts, kept, dest, pages, lens, slots,
                          num_rows, query_len, stride_bt, stride_pages,
                          q_src, q_dst, stride_q, keys, values, cache, stride_k, stride_kh, stride_v, stride_vh,
                          stride_cb, stride_ch, stride_cn,
                          NUM_HEADS: tl.constexpr, PAGE: tl.constexpr, BLOCK_H: tl.constexpr,
                          BLOCK_C: tl.constexpr, BLOCK_Q: tl.constexpr, GROUP_DIM: tl.constexpr, BLOCK_GD: tl.constexpr,
                          WRITE_KV: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr):
    r = tl.program_id(0)
    h = tl.program_id(1)
    position = tl.load(dest + r * NUM_HEADS + h)
    seq_len = tl.load(seq_lens + r)
    p = tl.load(fresh + r)
    heads = tl.arange(0, BLOCK_H)
    row_counts = tl.load(counts + r * NUM_HEADS + heads, mask=heads < NUM_HEADS, other=0)
    start_h = tl.sum(tl.where(heads < h, row_counts, 0))
    count_h = tl.load(counts + r * NUM_HEADS + h)
    kept_h = tl.load(kept + r * NUM_HEADS + h)
    vlen = tl.where(seq_len > 0, seq_len - p * PAGE + kept_h, 0)
    tl.store(lens + position, vlen)
    row_table = block_table + r * stride_bt
    out = pages + position.to(tl.int64) * stride_pages
    num_pages = tl.cdiv(vlen, PAGE)
    for c0 in range(0, num_pages, BLOCK_C):
        col = c0 + tl.arange(0, BLOCK_C)
        valid = col < num_pages
        block_col, slot = _page_ids(col, count_h, start_h, p, h)
        block = tl.load(row_table + block_col, mask=valid, other=0)
        tl.store(out + col, block * NUM_HEADS + slot, mask=valid)
    # The row's scheduled tokens are its last query_len positions.
    i = tl.arange(0, BLOCK_Q)
    vpos = vlen - query_len + i
    block_col, slot = _page_ids(vpos // PAGE, count_h, start_h, p, h)
    valid = i < query_len
    block = tl.load(row_table + block_col, mask=valid & (vlen > 0), other=0)
    cache_slot = (block.to(tl.int64) * NUM_HEADS + slot) * PAGE + vpos % PAGE
    cache_slot = tl.where(vlen > 0, cache_slot, -1)
    token = (r * query_len + i).to(tl.int64)
    tl.store(slots + token * NUM_HEADS + h, cache_slot, mask=valid)
    # head h's g query rows of each scheduled token
    e = tl.arange(0, BLOCK_GD)
    inside = valid[:, None] & (e < GROUP_DIM)[None, :]
    column = h * GROUP_DIM + e[None, :]
    tl.store(q_dst + token[:, None] * (NUM_HEADS * GROUP_DIM) + column,
             tl.load(q_src + token[:, None] * stride_q + column, mask=inside), mask=inside)
    if WRITE_KV:
        d = tl.arange(0, BLOCK_D)
        inside = (valid & (vlen > 0))[:, None] & (d < HEAD_DIM)[None, :]
        row = block.to(tl.int64) * stride_cb + slot * stride_ch + vpos % PAGE * stride_cn
        at = cache + row[:, None] + d[None, :]
        tl.store(at, tl.load(keys + token[:, None] * stride_k + h * stride_kh + d[None, :], mask=inside),
                 mask=inside)
        tl.store(at + HEAD_DIM, tl.load(values + token[:, None] * stride_v + h * stride_vh + d[None, :],
                                        mask=inside), mask=inside)


def decode_tables(block_table: torch.Tensor, seq_lens: torch.Tensor, fresh: torch.Tensor, counts: torch.Tensor,
                  kept: torch.Tensor, query_len: int, page_size: int, pages: torch.Tensor, lens: torch.Tensor,
                  slots: torch.Tensor, dest: torch.Tensor, queries: tuple[torch.Tensor, torch.Tensor],
                  kv: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None) -> None:
    """Fill pages / lens / slots in place, copy `queries` and write `kv` when given (shapes in the module
    docstring). One launch, no host sync."""
    num_rows, num_heads = counts.shape
    tokens = num_rows * query_len
    assert pages.shape[0] == num_rows * num_heads and pages.stride(-1) == 1 and lens.is_contiguous()
    assert lens.shape == (num_rows * num_heads,) and slots.shape == (tokens, num_heads)
    assert block_table.stride(-1) == 1 and counts.is_contiguous() and kept.is_contiguous()
    assert dest.shape == (num_rows * num_heads,) and dest.dtype == torch.int32
    q_src, q_dst = queries
    assert q_src.shape == q_dst.shape and q_src.shape[0] == tokens and q_src.shape[1] % num_heads == 0
    assert q_src.stride(-1) == 1 and q_dst.is_contiguous() and q_src.dtype == q_dst.dtype
    group_dim = q_src.shape[1] // num_heads
    keys = values = cache = dest  # placeholders of the variant without the write (never read)
    stride_k = stride_kh = stride_v = stride_vh = head_dim = 0
    cache_strides = (0, 0, 0)
    if kv is not None:
        keys, values, cache = kv
        head_dim = keys.shape[-1]
        assert keys.shape == values.shape == (tokens, num_heads, head_dim) and cache.stride(-1) == 1
        assert keys.stride(-1) == 1 and values.stride(-1) == 1 and keys.dtype == values.dtype == cache.dtype
        assert cache.shape[1:] == (num_heads, page_size, 2 * head_dim)
        stride_k, stride_kh, stride_v, stride_vh = keys.stride(0), keys.stride(1), values.stride(0), values.stride(1)
        cache_strides = cache.stride()[:3]
    _decode_tables_kernel[(num_rows, num_heads)](
        block_table, seq_lens, fresh, counts, kept, dest, pages, lens, slots,
        num_rows, query_len, block_table.stride(0), pages.stride(0),
        q_src, q_dst, q_src.stride(0), keys, values, cache, stride_k, stride_kh, stride_v, stride_vh, *cache_strides,
        NUM_HEADS=num_heads, PAGE=page_size, BLOCK_H=triton.next_power_of_2(num_heads), BLOCK_C=128,
        BLOCK_Q=triton.next_power_of_2(query_len), GROUP_DIM=group_dim,
        BLOCK_GD=triton.next_power_of_2(group_dim), WRITE_KV=kv is not None, HEAD_DIM=head_dim,
        BLOCK_D=triton.next_power_of_2(max(head_dim, 1)))


def decode_tables_reference(block_table, seq_lens, fresh, counts, kept, query_len: int, page_size: int):
    """The same tables in natural order (dest[i] = i), one (row, head, page) at a time: (pages as lists
    [R][H], lens [R, H], slots [R*q, H])."""
    num_rows, num_heads = counts.shape
    page_lists = [[[] for _ in range(num_heads)] for _ in range(num_rows)]
    lens = torch.zeros(num_rows, num_heads, dtype=torch.int32)
    slots = torch.full((num_rows * query_len, num_heads), -1, dtype=torch.int64)
    for r in range(num_rows):
        blocks = [int(b) for b in block_table[r]]
        p = int(fresh[r])
        for h in range(num_heads):
            if int(seq_lens[r]) == 0:
                continue
            count, start = int(counts[r, h]), int(counts[r, :h].sum())
            vlen = int(seq_lens[r]) - p * page_size + int(kept[r, h])
            kept_pages = [blocks[s % p] * num_heads + s // p for s in range(start, start + count)]
            tail = [b * num_heads + h for b in blocks[p:]]
            page_list = (kept_pages + tail)[: -(-vlen // page_size)]
            page_lists[r][h] = page_list
            lens[r, h] = vlen
            for i in range(query_len):
                vpos = vlen - query_len + i
                slots[r * query_len + i, h] = page_list[vpos // page_size] * page_size + vpos % page_size
    return page_lists, lens, slots
