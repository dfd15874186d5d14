"""Where each kept token goes in a compaction, in one launch: the kernel twin of
`vllm_evict.engine.compaction.compaction_slots_torch` (the reference and the CPU path, which issues
about 20 kernels, each reading or writing an int64 tensor of every (row, head, token): at a 15-request decode
point of an 8B model about 1 GB moved, where this kernel reads the masks and writes the slots once).

Inputs (N rows: requests x layers, or layers of one request; H heads; E tokens per head):
    keep         [..., H, E]  bool         kept tokens (unit stride in E)
    page_counts  [..., H]     int          pages per head
    fresh_blocks [F] or [R, F] int         the fresh blocks of one request, or of each of R requests (the
                                           leading axis of keep then)
    num_blocks   int, 0-d int tensor (read on the device: no host sync) or None (F)
Output:
    slots        [..., E, H]  int64        per-head page-view slot of each kept token, -1 where evicted

Per row, head h's kept tokens take consecutive pages after the pages of heads < h, laid out over the first
num_blocks fresh blocks: flat page q sits in block fresh[q % num_blocks] at sub-slot q // num_blocks.
A program per row walks E in tiles, carrying each head's running count of kept tokens.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl


# runtime integers and the inputs' offsets vary from call to call (held widths, pool sizes, views): one compiled
# variant per head count, page size and block-count mode, the one the engine's warm-up compiles. Ranks and flat
# pages are int32 (a head's tokens and a request's pages are far below 2**31), so the divisions by the pool's
# block count are 32-bit; page_size is a constant: a shift.
@triton.jit(do_not_specialize=["E", "F", "num_pages", "rows_per_request", "stride_row", "stride_head"],
            do_not_specialize_on_alignment=["keep", "counts", "fresh", "num_blocks"])
def _compaction_slots_kernel(keep, counts, fresh, num_blocks, out, E, F, num_pages, rows_per_request,
                             stride_row, stride_head, H: tl.constexpr, PAGE: tl.constexpr, BLOCK_H: tl.constexpr,
                             BLOCK_E: tl.constexpr, NUM_ON_DEVICE: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    fresh_row = fresh + (row // rows_per_request) * F
    if NUM_ON_DEVICE:
        num_pages = tl.load(num_blocks)
    num_pages = num_pages.to(tl.int32)
    heads = tl.arange(0, BLOCK_H)
    live = heads < H
    pages = tl.load(counts + row * H + heads, mask=live, other=0).to(tl.int32)
    first_page = tl.cumsum(pages, axis=0) - pages                  # [BLOCK_H] pages of the heads before
    kept_before = tl.zeros((BLOCK_H,), tl.int32)                   # each head's kept tokens before the tile
    cols = tl.arange(0, BLOCK_E)
    for e0 in range(0, E, BLOCK_E):
        token = e0 + cols
        inside = (token < E)[:, None] & live[None, :]              # [BLOCK_E, BLOCK_H]
        kept = tl.load(keep + row * stride_row + heads[None, :] * stride_head + token[:, None], mask=inside,
                       other=0).to(tl.int32)
        rank = kept_before[None, :] + tl.cumsum(kept, axis=0) - 1  # rank among the head's kept tokens
        kept_before += tl.sum(kept, axis=0)
        is_kept = inside & (kept != 0)
        flat = first_page[None, :] + rank // PAGE
        block = tl.load(fresh_row + flat % num_pages, mask=is_kept, other=0).to(tl.int64)
        slot = (block * H + flat // num_pages) * PAGE + rank % PAGE
        tl.store(out + (row * E + token[:, None]) * H + heads[None, :], tl.where(is_kept, slot, -1), mask=inside)


def compaction_slots_fused(keep: torch.Tensor, page_counts: torch.Tensor, fresh_blocks: torch.Tensor,
                           page_size: int, num_blocks: int | torch.Tensor | None = None) -> torch.Tensor:
    """compaction_slots(keep, page_counts, fresh_blocks, page_size, num_blocks) in one launch (shapes in the
    module docstring); contiguous [..., E, H]."""
    *lead, num_heads, E = keep.shape
    rows = math.prod(lead)
    requests = fresh_blocks.shape[0] if fresh_blocks.dim() == 2 else 1
    assert rows % requests == 0 and page_counts.shape == keep.shape[:-1], (keep.shape, page_counts.shape)
    out = torch.empty(*lead, E, num_heads, dtype=torch.int64, device=keep.device)
    if rows == 0 or E == 0:
        return out
    keep = keep.reshape(rows, num_heads, E)
    if keep.stride(-1) != 1:
        keep = keep.contiguous()
    fresh = fresh_blocks.contiguous()
    on_device = isinstance(num_blocks, torch.Tensor)
    block_h = triton.next_power_of_2(num_heads)
    _compaction_slots_kernel[(rows,)](
        keep, page_counts.reshape(rows, num_heads).contiguous(), fresh, num_blocks if on_device else fresh, out,
        E, fresh.shape[-1], fresh.shape[-1] if num_blocks is None or on_device else num_blocks, rows // requests,
        keep.stride(0), keep.stride(1), H=num_heads, PAGE=page_size, BLOCK_H=block_h,
        BLOCK_E=max(16, 2048 // block_h), NUM_ON_DEVICE=on_device)  # whatever E: no variant per length
    return out
