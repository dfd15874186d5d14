"""CAOTE / FastCAOTE (DESIGN.md §4.5): meta-score over a non-negative base policy's pooled score.

h = base pooled score before protection (all n tokens of the head); h_n = h / sum(h) (1/n if the sum is 0);
X = sum_i h_n,i v_i (caote) or mean_i v_i (fastcaote); c_j = h_n,j / (1 - h_n,j + eps) * ||X - v_j||_2.
Then the base's protection (window, sink) applies. Window, pooling, sink and gqa are the base's.
Over ragged held sets (DESIGN.md §4.8 a), h_n and X run over each head's held tokens.
"""

import torch

from .base import HEAD_CHUNK, Policy
from .ragged import map_heads

EPS = 1e-6
ALLOWED_BASES = ("snapkv", "dropkv", "obcache-value", "obcache-key", "obcache-joint", "tova", "h2o")


def check_base(base: object) -> str:
    if base not in ALLOWED_BASES:
        raise ValueError(f"caote_base must be one of {ALLOWED_BASES}, got {base!r}")
    return base  # type: ignore[return-value]


def caote_meta(h: torch.Tensor, values: torch.Tensor, *, fast: bool,
               lengths: torch.Tensor | None = None) -> torch.Tensor:
    """c [H_kv, n] from base scores h [H_kv, n] (fp32) and values [n, H_kv, Dv]; with held counts `lengths`
    [H_kv], head i's c over its first n_i tokens (-inf after them)."""

    def meta(heads: slice, m: int) -> torch.Tensor:
        hc = h[heads, :m]
        v = values[:m, heads].to(torch.float32).transpose(0, 1)                 # [heads, m, Dv]
        total = hc.sum(dim=1, keepdim=True)
        hn = torch.where(total > 0, hc / total, 1.0 / m)
        x = v.mean(dim=1, keepdim=True) if fast else torch.matmul(hn.unsqueeze(1), v)
        return hn / (1.0 - hn + EPS) * torch.linalg.vector_norm(x - v, dim=-1)

    return map_heads(meta, h.shape[0], h.shape[1], lengths, HEAD_CHUNK)


class CAOTE(Policy):
    name = "caote"
    needs_queries = True
    fast = False

    def base_scores(self, q_window, keys, values, *, pool_kernel, gqa, scale, caote_base="snapkv", lengths=None, **_):
        from .registry import get_policy

        base = get_policy(check_base(caote_base))
        h = base.base_scores(q_window, keys, values, pool_kernel=pool_kernel, gqa=gqa, scale=scale, lengths=lengths)
        return caote_meta(h, values, fast=self.fast, lengths=lengths)


class FastCAOTE(CAOTE):
    name = "fastcaote"
    fast = True
