"""DESIGN.md §7.1 selection: stable descending sort (ties keep the lower position); never torch.topk."""

from __future__ import annotations

import torch


def stable_sort(scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(values, indices) of scores [H, n] per row, in stable descending order (equal scores: lower index
    first)."""
    return torch.sort(scores, dim=-1, descending=True, stable=True)


def stable_order(scores: torch.Tensor) -> torch.Tensor:
    """Indices of scores [H, n] per row, in stable descending order (equal scores: lower index first)."""
    return stable_sort(scores).indices


def keep_mask(scores: torch.Tensor, kept: torch.Tensor, order: torch.Tensor | None = None) -> torch.Tensor:
    """Bool [H, n]: True for the kept[i] first entries of row i in stable descending order.

    `kept` is an integer tensor [H] (any device) with 0 <= kept[i] <= n; `order` is stable_order(scores)
    when the caller has it already.
    """
    h, n = scores.shape
    order = stable_order(scores) if order is None else order
    kept = kept.to(device=scores.device, dtype=torch.long).view(h, 1)
    rank_kept = torch.arange(n, device=scores.device).view(1, n) < kept
    mask = torch.zeros((h, n), dtype=torch.bool, device=scores.device)
    return mask.scatter_(1, order, rank_kept)


def kept_indices(mask: torch.Tensor) -> list[torch.Tensor]:
    """Per head, the kept positions in ascending order (the storage order of DESIGN.md §2.1)."""
    return [row.nonzero().flatten() for row in mask]
