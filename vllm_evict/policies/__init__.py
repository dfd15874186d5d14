"""Engine-free eviction policies (docs/DESIGN.md): scoring, budgets, Ada-KV allocation, selection (pure torch).

Public API
  score_tokens(policy, q_window, keys, values, *, lengths, **options) -> float32 [H_kv, n]   (larger = keep, +inf
                                                                                  protected, -inf padding)
  select_tokens(scores, budget, *, allocation, page_size, alpha, lengths) -> bool [H_kv, n] (True = kept)
  allocate_pages(scores, budget, *, allocation, page_size, alpha, lengths) -> int64 [H_kv] (CPU; pages per head)
  num_pages(n, budget, page_size, protected) -> int | None                    (P, None = nothing evicted)
  raw_window_scores(policy, q_window, keys, values, *, scale, gqa, lengths) -> float32 [H_kv, n]
  lengths (optional, default None): held counts [H_kv] of ragged held sets (DESIGN.md §4.8 a, ragged.py)
  EvictionConfig (from_dict / from_flat; policy "none" -> None)
  POLICIES: name -> policy object with a pure score(...)
"""

from .api import SCORE_OPTIONS, effective_policy, score_tokens, select_tokens
from .base import KeyPolicy, Policy, WindowPolicy, register_key_kernel
from .budget import ALLOCATIONS, allocate_pages, budget_tokens, check_budget, count_protected, kept_counts, num_pages
from .caote import ALLOWED_BASES as CAOTE_BASES
from .config import EvictionConfig
from .pooling import max_pool, protect, protected_count
from .registry import POLICIES, get_policy
from .selection import keep_mask, kept_indices, stable_order
from .window import WindowStats, raw_window_scores, reference_raw_window_scores, register_raw_kernel, window_stats

__all__ = [
    "ALLOCATIONS",
    "CAOTE_BASES",
    "POLICIES",
    "SCORE_OPTIONS",
    "EvictionConfig",
    "KeyPolicy",
    "Policy",
    "WindowPolicy",
    "WindowStats",
    "allocate_pages",
    "budget_tokens",
    "check_budget",
    "count_protected",
    "effective_policy",
    "get_policy",
    "keep_mask",
    "kept_counts",
    "kept_indices",
    "max_pool",
    "num_pages",
    "protect",
    "protected_count",
    "raw_window_scores",
    "reference_raw_window_scores",
    "register_key_kernel",
    "register_raw_kernel",
    "score_tokens",
    "select_tokens",
    "stable_order",
    "window_stats",
]
