"""Ada-KV's page allocation (DESIGN.md §3.4) in one launch: a program per layer row, the kernel twin of
`vllm_evict.policies.budget.adakv_pages` (its torch reference, which issues some 70 small kernels per call).

Inputs (L layer rows, H heads, n scores per head):
    sorted_scores [L, H, n] float32   each head's scores in descending order (unit stride in the last dim)
    held          [L, H]    int64     optional: ragged held counts (a head's scores past its count are -inf)
Output:
    pages         [L, H]    int64     pages per head, exactly adakv_pages(sorted_scores, P, ...)

Per row: the B-th largest score tau (B = P*H*bs) by bisection over the scores' bit patterns ordered as the floats
are (32 counting passes over the row), each head's count above tau and its share of the ties (lower heads
first), the exact numerators of x_i, and the largest-remainder rounding as the loop it stands for: one page
at a time to the head with the largest priority (ties: the lower head), or back from the one with the smallest
(ties: the higher head), each head at most `units` times.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from vllm_evict.policies.budget import adakv_terms


@triton.jit
def _ordered_key(x):
    """float32 -> int32 whose signed order is the floats' order (the map is its own inverse on the bits)."""
    bits = x.to(tl.int32, bitcast=True)
    return bits ^ ((bits >> 31) & 0x7FFFFFFF)


# runtime integers and the inputs' offsets (layer-group views) vary from call to call (held widths, budgets): one
# compiled variant per head count and held-set mode, the one the engine's warm-up compiles
@triton.jit(do_not_specialize=["n", "stride_row", "stride_head", "top", "num_per_f", "num_fixed", "den", "total",
                               "page_size", "p_min_cap", "p_max_all", "units"],
            do_not_specialize_on_alignment=["scores", "held"])
def _adakv_pages_kernel(scores, held, out, n, stride_row, stride_head, top, num_per_f, num_fixed, den, total,
                        page_size, p_min_cap, p_max_all, units,
                        H: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, RAGGED: tl.constexpr):
    row = tl.program_id(0)
    heads = tl.arange(0, BLOCK_H)
    live = heads < H
    cols = tl.arange(0, BLOCK_N)
    base = scores + row.to(tl.int64) * stride_row + heads[:, None] * stride_head
    # tau's ordered key: the largest key t with at least `top` scores at or above it
    lo = tl.full((), -2147483648, tl.int64)
    hi = tl.full((), 2147483647, tl.int64)
    for _ in range(32):
        mid = lo + (hi - lo + 1) // 2
        mid32 = mid.to(tl.int32)
        count = tl.zeros((), tl.int64)
        for c0 in range(0, n, BLOCK_N):
            inside = live[:, None] & (c0 + cols < n)[None, :]
            keys = _ordered_key(tl.load(base + c0 + cols[None, :], mask=inside, other=0.0))
            count += tl.sum(tl.sum(tl.where(inside & (keys >= mid32), 1, 0), axis=1), axis=0)
        lo = tl.where(count >= top, mid, lo)
        hi = tl.where(count >= top, hi, mid - 1)
    tau = _ordered_key(lo.to(tl.int32)).to(tl.float32, bitcast=True)
    above = tl.zeros((BLOCK_H,), tl.int64)
    ties = tl.zeros((BLOCK_H,), tl.int64)
    protected = tl.zeros((BLOCK_H,), tl.int64)
    for c0 in range(0, n, BLOCK_N):
        inside = live[:, None] & (c0 + cols < n)[None, :]
        x = tl.load(base + c0 + cols[None, :], mask=inside, other=0.0)
        above += tl.sum(tl.where(inside & (x > tau), 1, 0), axis=1)
        ties += tl.sum(tl.where(inside & (x == tau), 1, 0), axis=1)
        protected += tl.sum(tl.where(inside & (x == float("inf")), 1, 0), axis=1)
    if RAGGED:
        held_h = tl.load(held + row * H + heads, mask=live, other=0)
        ties = tl.minimum(ties, held_h - above)  # -inf padding is no entry
        p_max = (held_h + page_size - 1) // page_size
    else:
        p_max = tl.full((BLOCK_H,), 0, tl.int64) + p_max_all
    # the ties inside the top go to the lower heads first
    need = top - tl.sum(above, axis=0)
    f = above + tl.minimum(tl.maximum(need - (tl.cumsum(ties, axis=0) - ties), 0), ties)
    num = num_per_f * f + num_fixed
    r = tl.maximum(tl.max(protected, axis=0), 1)
    p_min = tl.minimum((r + page_size - 1) // page_size, p_min_cap)
    p = tl.minimum(tl.maximum(num // den, p_min), p_max)
    p = tl.where(live, p, 0)
    deficit = total - tl.sum(p, axis=0)
    big = 9223372036854775807
    moved = tl.zeros((BLOCK_H,), tl.int64)
    for _ in range(0, deficit):  # a page to the largest priority x_i - p_i - m (ties: lower head)
        at = p + moved
        gain = tl.where(at >= p_max, -big, num - at * den)
        eligible = live & (moved < units)
        best = tl.max(tl.where(eligible, gain, -big - 1), axis=0)
        pick = tl.min(tl.where(eligible & (gain == best), heads, BLOCK_H), axis=0)
        moved += tl.where(heads == pick, 1, 0)
    for _ in range(0, -deficit):  # a page back from the smallest x_i - p_i + m (ties: higher head)
        at = p - moved
        loss = tl.where(at <= p_min, big, num - at * den)
        eligible = live & (moved < units)
        best = tl.min(tl.where(eligible, loss, big), axis=0)
        pick = tl.max(tl.where(eligible & (loss == best), heads, -1), axis=0)
        moved += tl.where(heads == pick, 1, 0)
    pages = tl.where(deficit > 0, p + moved, p - moved)
    if RAGGED:  # a row whose held pages fit its P*H evicts nothing
        pages = tl.where(tl.sum(tl.where(live, p_max, 0), axis=0) <= total, p_max, pages)
    tl.store(out + row * H + heads, pages, mask=live)


def adakv_pages_fused(sorted_scores: torch.Tensor, pages: int, *, page_size: int, alpha: float, max_protected: int,
                      lengths: torch.Tensor | None = None) -> torch.Tensor:
    """adakv_pages(sorted_scores, pages, ..., sorted_scores=sorted_scores, lengths=lengths) for one P of all rows
    (shapes in the module docstring; lengths [L, H] or [L*H]): one launch, no host sync."""
    num_layers, h, n = sorted_scores.shape
    assert sorted_scores.dtype == torch.float32 and sorted_scores.stride(-1) == 1
    a, p_min_cap, units = adakv_terms(h, n, page_size, alpha, max_protected, ragged=lengths is not None)
    q = a.denominator
    held = sorted_scores if lengths is None else lengths.to(torch.int64).reshape(num_layers, h).contiguous()
    out = torch.empty(num_layers, h, dtype=torch.int64, device=sorted_scores.device)
    block_h = triton.next_power_of_2(h)  # a tile of 4K scores whatever n (32 a thread in registers): one variant
    _adakv_pages_kernel[(num_layers,)](
        sorted_scores, held, out, n, sorted_scores.stride(0), sorted_scores.stride(1),
        min(pages * h * page_size, h * n), (q - a.numerator) * h, a.numerator * h * page_size * pages,
        q * h * page_size, pages * h, page_size, p_min_cap, -(-n // page_size), units,
        H=h, BLOCK_H=block_h, BLOCK_N=max(16, 4096 // block_h),
        RAGGED=lengths is not None)
    return out
