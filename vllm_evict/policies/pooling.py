"""SPEC §2.3 step 3: max-pooling of raw scores along the token axis, and §2.3 step 5: protection."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def max_pool(raw: torch.Tensor, kernel: int) -> torch.Tensor:
    """MaxPool1d(kernel, stride=1, padding=kernel//2) over the last axis of raw [H, n].

    Padding acts as -inf (torch semantics), so each output is the max over its in-range neighbours
    and the output has the same length n. kernel = 1 is the identity.
    """
    if kernel == 1:
        return raw
    if kernel < 1 or kernel % 2 == 0:
        raise ValueError(f"pool_kernel must be a positive odd integer, got {kernel!r}")
    return F.max_pool1d(raw.unsqueeze(1), kernel_size=kernel, stride=1, padding=kernel // 2).squeeze(1)


def protect(scores: torch.Tensor, *, sink: int, window: int) -> torch.Tensor:
    """S_j = +inf for j < sink and j >= n - window (in place on a fresh tensor); others unchanged."""
    n = scores.shape[-1]
    out = scores.clone()
    if sink > 0:
        out[..., : min(sink, n)] = float("inf")
    if window > 0:
        out[..., max(n - window, 0) :] = float("inf")
    return out


def protected_count(n: int, *, sink: int, window: int) -> int:
    """r of SPEC §1: |{0..sink-1} ∪ {n-w..n-1}| for a prompt of n tokens."""
    s = max(0, min(sink, n))
    w = max(0, min(window, n))
    return min(n, s + w)
