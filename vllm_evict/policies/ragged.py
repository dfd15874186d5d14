"""Ragged held sets (DESIGN.md §4.8 a): after an Ada-KV compaction the KV heads of a layer hold different numbers of
tokens n_i, and are scored and selected together in padded tensors.

Layout: keys / values [n, H, D] hold head i's tokens in rows [:n_i] (any finite values after them), and
`lengths` is an integer tensor [H] of the n_i (1 <= n_i <= n). Scores are [H, n], -inf in the padding, so a
stable descending sort puts the padding after every held token (DESIGN.md §7.1: equal scores keep the lower position).
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

NEG_INF = float("-inf")


def check_lengths(lengths: object, count: int, n: int, *, device: torch.device | None = None, minimum: int = 1,
                  read: bool = False) -> torch.Tensor:
    """Validate held counts: an integer tensor of `count` entries (on `device` when given) with
    minimum <= lengths[i] <= n. The values are read on the CPU, or anywhere when `read`: reading a device
    tensor makes the host wait for the device, which scoring on CUDA never does (there the range is the
    caller's precondition)."""
    if not isinstance(lengths, torch.Tensor):
        raise ValueError(f"lengths must be a torch.Tensor, got {type(lengths).__name__}")
    if lengths.dtype.is_floating_point or lengths.dtype.is_complex or lengths.dtype == torch.bool:
        raise ValueError(f"lengths must be an integer tensor, got dtype {lengths.dtype}")
    if lengths.numel() != count:
        raise ValueError(f"lengths must have {count} entries (one per head), got shape {tuple(lengths.shape)}")
    if device is not None and lengths.device != device:
        raise ValueError(f"lengths on {lengths.device} but keys on {device}")
    if read or lengths.device.type == "cpu":
        low, high = int(lengths.min()), int(lengths.max())
        if low < minimum or high > n:
            raise ValueError(f"lengths must lie in [{minimum}, n={n}], got values in [{low}, {high}]")
    return lengths


def mask_padding(scores: torch.Tensor, lengths: torch.Tensor | None) -> torch.Tensor:
    """scores [..., n] with -inf in the padding j >= lengths of each row (lengths: one entry per row, any shape
    with that many entries); scores itself when lengths is None."""
    if lengths is None:
        return scores
    held = lengths.to(scores.device).reshape(*scores.shape[:-1], 1)
    return scores.masked_fill(torch.arange(scores.shape[-1], device=scores.device) >= held, NEG_INF)


def map_heads(fn: Callable[[slice, int], torch.Tensor], num_heads: int, n: int, lengths: torch.Tensor | None,
              chunk: int) -> torch.Tensor:
    """[H, n] scores from fn(heads, m) -> [heads, m], the scores of the heads `heads` over their first m tokens.

    Without lengths: chunks of `chunk` heads over all n tokens. With lengths: one head at a time over its own
    n_i tokens, -inf after them, so that each head's scores are those of a call on that head alone (a
    computation over several heads may round differently)."""
    if lengths is None:
        return torch.cat([fn(slice(s, s + chunk), n) for s in range(0, num_heads, chunk)])
    return torch.cat([F.pad(fn(slice(i, i + 1), m), (0, n - m), value=NEG_INF)
                      for i, m in enumerate(lengths.tolist())])
