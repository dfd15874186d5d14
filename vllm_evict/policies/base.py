"""Policy base classes (kvpress `presses/` style: one small class per method, a pure `score`).

`score` receives resolved options (see `vllm_evict.policies.score_tokens` for defaults/validation):
  q_window [w, H_q, D] - exactly the w window rows for query-based policies (ignored by key-only ones)
  keys [n, H_kv, D], values [n, H_kv, Dv] - any float dtype/device; computed in fp32 on that device
  window - protected recent positions (= w for query-based policies; 0 unless requested for key-only)
  pool_kernel, sink, gqa, scale, caote_base
  lengths - None, or the held counts [H_kv] of ragged held sets (DESIGN.md §4.8 a, ragged.py): head i holds its
            first n_i tokens and is scored as if alone over them
and returns float32 [H_kv, n] retention scores, +inf at protected positions (-inf in the padding).
`base_scores` receives `lengths` too; `score` sets the padding of its result to -inf (pooling leaves it
finite, and `random` / `streaming` ignore the lengths).
"""

from __future__ import annotations

from typing import Callable

import torch

from .pooling import max_pool, protect
from .ragged import map_heads
from .window import raw_window_scores

_FLT_MAX = torch.finfo(torch.float32).max


class Policy:
    name: str = ""
    needs_queries: bool = False  # reads window queries
    window_raw: bool = False  # raw score comes from raw_window_scores
    has_kernel: bool = False  # a Triton kernel implements its raw score (CUDA; else the torch reference)
    default_window: int = 0  # w (DESIGN.md §4 table); 0 = no window
    default_pool_kernel: int = 1
    default_sink: int = 0
    supports_adakv: bool = True
    needs_context: bool = False  # reads score_tokens' `context` (where the tokens sit)

    def base_scores(self, q_window, keys, values, *, pool_kernel: int, gqa: str, scale: float, **_: object) -> torch.Tensor:
        """Pooled score before protection, [H_kv, n] float32."""
        raise NotImplementedError

    def score(self, q_window, keys, values, *, window: int, pool_kernel: int, sink: int, gqa: str, scale: float,
              lengths: torch.Tensor | None = None, **kw: object) -> torch.Tensor:
        pooled = self.base_scores(q_window, keys, values, pool_kernel=pool_kernel, gqa=gqa, scale=scale,
                                  lengths=lengths, **kw)
        # +inf must mean "protected" only (the allocator counts +inf entries as r): saturate overflow.
        pooled = torch.clamp(pooled, max=_FLT_MAX)
        return protect(pooled, sink=sink, window=window, lengths=lengths)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r})"


class WindowPolicy(Policy):
    """Query-based policy: per-query-head raw score from the window statistics, then GQA, pooling, protection."""

    needs_queries = True
    window_raw = True

    def head_raw(self, st) -> torch.Tensor:
        """Per-query-head raw score [g, n] from a WindowStats of one KV head."""
        raise NotImplementedError

    def base_scores(self, q_window, keys, values, *, pool_kernel: int, gqa: str, scale: float,
                    lengths: torch.Tensor | None = None, **_: object) -> torch.Tensor:
        raw = raw_window_scores(self, q_window, keys, values, scale=scale, gqa=gqa, lengths=lengths)
        return max_pool(raw, pool_kernel)


# Heads scored together: bounds the fp32 temporaries when the engine folds many layers into the head axis.
HEAD_CHUNK = 16


KeyKernel = Callable[[str, torch.Tensor], torch.Tensor]
_KEY_KERNEL: KeyKernel | None = None


def register_key_kernel(fn: KeyKernel | None) -> None:
    """Install (or with None remove) a CUDA implementation of the key-only policies that declare
    `has_kernel`: fn(policy_name, keys [n, H_kv, D] in their dtype, lengths=None or held counts [H_kv])
    -> float32 [H_kv, n], equal to `key_score` of each head over its held keys up to fp32 rounding
    (DESIGN.md §7.3), -inf in the padding."""
    global _KEY_KERNEL
    _KEY_KERNEL = fn


class KeyPolicy(Policy):
    """Key-only policy: score [n] per KV head from that head's fp32 keys (no GQA step)."""

    def key_score(self, k: torch.Tensor) -> torch.Tensor:
        """k [heads, n, D] fp32 -> [heads, n]."""
        raise NotImplementedError

    def base_scores(self, q_window, keys, values, *, pool_kernel: int, gqa: str, scale: float,
                    lengths: torch.Tensor | None = None, **_: object) -> torch.Tensor:
        if _KEY_KERNEL is not None and keys.is_cuda and self.has_kernel:
            out = _KEY_KERNEL(self.name, keys, lengths=lengths)
        else:
            out = map_heads(lambda heads, m: self.key_score(keys[:m, heads].to(torch.float32).transpose(0, 1)),
                            keys.shape[1], keys.shape[0], lengths, HEAD_CHUNK)
        return max_pool(out, pool_kernel)
