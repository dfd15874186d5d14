"""The cache slots of what each head of a per-head (Ada-KV) request holds, in one launch: the kernel twin of
`vllm_evict.engine.per_head.held_slots_torch` (the reference and the CPU path: head_pages, a gather
and a mask over int64 [G, H, R, n] tensors, then a transposing copy, about 25 kernels a layer group).

Inputs (R requests, G layers, H heads, n tokens per head, Wb blocks a request's row):
    counts     [R, G, H] int64   pages per head at the last point (any strides, unit stride in H)
    held       [R, G, H] int64   tokens the head holds (same)
    fresh      [R]       int64   blocks the last point's layout spans (F)
    row_blocks [R, Wb]   int64   the request's block ids (unit stride in Wb)
Output:
    slots      [R, G, n, H] int64  slot of each held token (block * H + sub-slot) * page_size + offset, -1 past
                                   the head's held count

Head h's page j is its j-th kept page while j < counts[h] (flat page start_h + j, start_h = the pages of
the heads before it, in block fresh-col flat % F at sub-slot flat // F), else slot h of tail block
F + j - counts[h] (columns clamped to the row, as head_pages does). A program per (request, layer).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


# runtime integers and the inputs' offsets (layer-group views, a row of the batch's scalars) vary from call to
# call: one compiled variant per head count and page size, the one the engine's warm-up compiles. Pages and their
# columns are int32 (a request's blocks are far below 2**31), page_size a constant: a shift.
@triton.jit(do_not_specialize=["n", "G", "width", "counts_stride_r", "counts_stride_g", "held_stride_r",
                               "held_stride_g", "blocks_stride"],
            do_not_specialize_on_alignment=["counts", "held", "fresh", "row_blocks"])
def _held_slots_kernel(counts, held, fresh, row_blocks, out, n, G, width, counts_stride_r, counts_stride_g,
                       held_stride_r, held_stride_g, blocks_stride, H: tl.constexpr, PAGE: tl.constexpr,
                       BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)  # request * G + layer
    request, layer = row // G, row % G
    heads = tl.arange(0, BLOCK_H)
    live = heads < H
    pages = tl.load(counts + request * counts_stride_r + layer * counts_stride_g + heads, mask=live,
                    other=0).to(tl.int32)
    holds = tl.load(held + request * held_stride_r + layer * held_stride_g + heads, mask=live, other=0)
    start = tl.cumsum(pages, axis=0) - pages                       # [BLOCK_H] pages of the heads before
    spans = tl.load(fresh + request).to(tl.int32)
    blocks = row_blocks + request * blocks_stride
    cols = tl.arange(0, BLOCK_N)
    for t0 in range(0, n, BLOCK_N):
        token = t0 + cols
        page = (token // PAGE)[:, None]                            # [BLOCK_N, 1]
        inside = (token < n)[:, None] & live[None, :]
        in_kept = page < pages[None, :]
        flat = start[None, :] + page
        column = tl.where(in_kept, flat % spans, spans + page - pages[None, :])
        column = tl.minimum(tl.maximum(column, 0), width - 1)
        sub = tl.where(in_kept, flat // spans, heads[None, :])
        is_held = inside & (token[:, None] < holds[None, :])
        block = tl.load(blocks + column, mask=is_held, other=0).to(tl.int64)
        slot = (block * H + sub) * PAGE + (token % PAGE)[:, None]
        tl.store(out + (row * n + token[:, None]) * H + heads[None, :], tl.where(is_held, slot, -1), mask=inside)


def held_slots_fused(counts: torch.Tensor, held: torch.Tensor, fresh: torch.Tensor, row_blocks: torch.Tensor,
                     n: int, page_size: int) -> torch.Tensor:
    """held_slots(counts, held, fresh, row_blocks, n, page_size) in one launch (shapes in the module docstring)."""
    R, G, H = counts.shape
    assert held.shape == counts.shape and counts.stride(-1) == held.stride(-1) == fresh.stride(0) == 1
    assert row_blocks.stride(-1) == 1
    out = torch.empty(R, G, n, H, dtype=torch.int64, device=counts.device)
    if R * G == 0 or n == 0:
        return out
    block_h = triton.next_power_of_2(H)
    _held_slots_kernel[(R * G,)](
        counts, held, fresh, row_blocks, out, n, G, row_blocks.shape[1], counts.stride(0), counts.stride(1),
        held.stride(0), held.stride(1), row_blocks.stride(0), H=H, PAGE=page_size, BLOCK_H=block_h,
        BLOCK_N=max(16, 2048 // block_h))  # a tile of at most 2K slots, whatever n: no variant per length
    return out
