"""DESIGN.md §2.3 step 3: max-pooling of raw scores along the token axis, and §2.3 step 5: protection.

Ragged held sets (DESIGN.md §4.8 a, see ragged.py): raw scores are -inf in the padding, which max-pooling treats
as out of range; `protect` takes the held counts and ends each row at its own n_i, -inf after it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .ragged import mask_padding


def max_pool(raw: torch.Tensor, kernel: int) -> torch.Tensor:
    """MaxPool1d(kernel, stride=1, padding=kernel//2) over the last axis of raw [H, n].

    Padding acts as -inf (torch semantics), so each output is the max over its in-range neighbours
    and the output has the same length n. kernel = 1 is the identity. -inf entries of raw (the padding
    of ragged held sets) are out of range alike: a held token's neighbours are adjacent held tokens.
    """
    if kernel == 1:
        return raw
    if kernel < 1 or kernel % 2 == 0:
        raise ValueError(f"pool_kernel must be a positive odd integer, got {kernel!r}")
    return F.max_pool1d(raw.unsqueeze(1), kernel_size=kernel, stride=1, padding=kernel // 2).squeeze(1)


def protect(scores: torch.Tensor, *, sink: int, window: int, lengths: torch.Tensor | None = None) -> torch.Tensor:
    """S_j = +inf for j < sink and j >= n - window (on a fresh tensor); others unchanged.

    With lengths [H] row i holds lengths[i] = n_i tokens: its window is [n_i - window, n_i), and its padding
    j >= n_i is -inf."""
    n = scores.shape[-1]
    end = n if lengths is None else lengths.to(scores.device).unsqueeze(-1)
    pos = torch.arange(n, device=scores.device)
    # with window 0, `pos >= end` is the padding: masked to -inf right after
    protected = (pos < sink) | (pos >= end - window)
    return mask_padding(scores.masked_fill(protected, float("inf")), lengths)


def protected_count(n: int, *, sink: int, window: int) -> int:
    """r of DESIGN.md §1: |{0..sink-1} ∪ {n-w..n-1}| for a prompt of n tokens."""
    s = max(0, min(sink, n))
    w = max(0, min(window, n))
    return min(n, s + w)
