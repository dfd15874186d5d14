"""Random eviction within each head (DESIGN.md §4.8 e), a baseline: arXiv 2609.03430 reports that it matches
strong evictors when the prompt is kept. Deterministic: a score is a hash of where the token sits.

S_j = h(h(h(h(h(j) ^ c) ^ i) ^ l) ^ s) / 2^32 in float64, with j the token's original position, c the
compaction index, i the global KV head index (the same at any TP size), l the layer index and s the
request's `seed` mod 2^32. h is the 32-bit integer hash below, exact in int64 (both multipliers < 2^31).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .base import Policy

_MASK = 0xFFFFFFFF


def hash32(x: torch.Tensor) -> torch.Tensor:
    """h of DESIGN.md §4.8 e, elementwise on int64 values in [0, 2^32)."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _MASK
    x = x ^ (x >> 15)
    x = (x * 0x1B873593) & _MASK
    return x ^ (x >> 16)


@dataclass(frozen=True)
class TokenContext:
    """Where the scored tokens of a score_tokens call sit (read by `random` only).

    positions: int64 [H, n] original positions of each head's tokens (None: 0..n-1);
    heads / layers: int64 [H] global KV head index and layer index of each scored head (None: 0..H-1 / 0);
    compaction: c, the request's compaction index; seed: the request's seed."""

    positions: torch.Tensor | None = None
    heads: torch.Tensor | None = None
    layers: torch.Tensor | None = None
    compaction: int = 0
    seed: int = 0


def random_scores(num_heads: int, n: int, context: TokenContext | None, device) -> torch.Tensor:
    """float64 [H, n] scores in [0, 1)."""
    ctx = context or TokenContext()
    arange = torch.arange(n, dtype=torch.int64, device=device)
    positions = arange.expand(num_heads, n) if ctx.positions is None else ctx.positions.to(device, torch.int64)
    heads = torch.arange(num_heads, device=device) if ctx.heads is None else ctx.heads.to(device, torch.int64)
    layers = torch.zeros(num_heads, dtype=torch.int64, device=device) if ctx.layers is None \
        else ctx.layers.to(device, torch.int64)
    x = hash32(hash32(positions & _MASK) ^ (ctx.compaction & _MASK))
    x = hash32(hash32(x ^ heads.view(-1, 1)) ^ layers.view(-1, 1))
    x = hash32(x ^ (ctx.seed & _MASK))
    return x.to(torch.float64) / float(1 << 32)


class Random(Policy):
    name = "random"
    needs_context = True

    def base_scores(self, q_window, keys, values, *, context: TokenContext | None = None, **_: object) -> torch.Tensor:
        return random_scores(keys.shape[1], keys.shape[0], context, keys.device)
