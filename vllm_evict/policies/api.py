"""score_tokens / select_tokens: validated entry points over the policy registry."""

from __future__ import annotations

import math

import torch

from ._validate import check_gqa, check_int, check_kv, check_pool_kernel, check_queries
from .base import Policy
from .budget import allocate_pages, kept_counts
from .caote import check_base
from .ragged import check_lengths, mask_padding
from .registry import get_policy
from .selection import keep_mask
from .window import exact_fp32

SCORE_OPTIONS = ("window", "pool_kernel", "sink", "gqa", "caote_base", "scale", "context", "future_rotation")


def effective_policy(policy: str, caote_base: str = "snapkv") -> Policy:
    """The policy whose defaults (w, kappa, sink, window protection) apply: the base for caote/fastcaote."""
    pol = get_policy(policy)
    if policy in ("caote", "fastcaote"):
        return get_policy(check_base(caote_base))
    return pol


def score_tokens(policy: str, q_window: torch.Tensor | None, keys: torch.Tensor, values: torch.Tensor, *,
                 lengths: torch.Tensor | None = None, **options: object) -> torch.Tensor:
    """Retention scores [H_kv, n] float32, float64 for `random` (larger = keep; protected positions = +inf).

    q_window: [w, H_q, D] post-RoPE queries of the last w prompt positions (may be None or have any number of
    rows for key-only policies keydiff/knorm/streaming, which ignore it). keys: [n, H_kv, D]; values:
    [n, H_kv, Dv]. Any float dtype and device; computed in fp32 (TF32 off) on the input's device.

    lengths: ragged held sets (DESIGN.md §4.8 a; default None: every head holds all n tokens). An integer tensor
    [H_kv] on the keys' device with w <= lengths[i] <= n (values checked on the CPU only): KV head i holds the
    n_i = lengths[i] tokens keys[:n_i, i] (values alike; any finite values after them), and the window rows
    are the last w held tokens of every head. Row i of the result is, in columns [:n_i], the scores of a call
    on head i alone over its held tokens (keys[:n_i, i:i+1], values[:n_i, i:i+1], its query heads, the same
    options; `context` positions padded like the keys), and -inf in columns [n_i:].

    Options (defaults: the policy's DESIGN.md §4 values):
      window       query-based: use the last `window` rows of q_window (default: all rows, w = q rows);
                   key-only: protect the last `window` positions (default 0).
      pool_kernel  odd max-pool kernel (not applied by streaming).
      sink         protect positions 0..sink-1 (clamped to n).
      gqa          "mean" | "max" (query-based policies).
      caote_base   base policy of caote/fastcaote (default "snapkv").
      scale        softmax scale (default 1/sqrt(D)).
      context      random.TokenContext: the tokens' original positions, heads, layers, compaction
                   index and seed (`random` reads it; default: positions 0..n-1, heads 0..H-1, all zero).
      future_rotation  [D, D]: the mean RoPE rotation to the positions the scores look ahead to
                   (expected-attention reads it: expected_attention.mean_rotation; default None: none).
    """
    unknown = sorted(set(options) - set(SCORE_OPTIONS))
    if unknown:
        raise ValueError(f"unknown score_tokens option(s) {unknown}; known: {SCORE_OPTIONS}")
    pol = get_policy(policy)
    caote_base = options.get("caote_base")
    caote_base = "snapkv" if caote_base is None else check_base(caote_base)
    eff = effective_policy(policy, caote_base)
    n, _ = check_kv(keys, values)

    window = options.get("window")
    if window is not None:
        window = check_int("window", window, minimum=0)
        if window > n:
            raise ValueError(f"window={window} is larger than the prompt length n={n}")
    if eff.needs_queries:
        rows, _ = check_queries(q_window, keys)
        assert q_window is not None
        w = rows if window is None else window
        if w < 1:
            raise ValueError(f"policy {policy!r} needs at least one window query row, got window={w}")
        if w > rows:
            raise ValueError(f"window={w} but q_window has only {rows} rows")
        if w > n:
            raise ValueError(f"window w={w} (q_window rows) is larger than the prompt length n={n}")
        q = q_window[rows - w :]
    else:
        w = 0 if window is None else window
        q = q_window
    if lengths is not None:
        check_lengths(lengths, keys.shape[1], n, device=keys.device, minimum=max(w, 1))

    pool_kernel = options.get("pool_kernel")
    pool_kernel = eff.default_pool_kernel if pool_kernel is None else check_pool_kernel(pool_kernel)
    if policy == "streaming":
        pool_kernel = 1
    sink = options.get("sink")
    sink = eff.default_sink if sink is None else check_int("sink", sink, minimum=0)
    gqa = options.get("gqa")
    gqa = "mean" if gqa is None else check_gqa(gqa)
    scale = options.get("scale")
    if scale is None:
        scale = 1.0 / math.sqrt(keys.shape[-1])
    elif isinstance(scale, bool) or not isinstance(scale, (int, float)) or not (0 < float(scale) < math.inf):
        raise ValueError(f"scale must be a positive finite number, got {scale!r}")

    with exact_fp32(keys.device):
        out = pol.score(q, keys, values, window=w, pool_kernel=pool_kernel, sink=sink, gqa=gqa, scale=float(scale),
                        caote_base=caote_base, context=options.get("context"), lengths=lengths,
                        future_rotation=options.get("future_rotation"))
    # random's 32-bit hash scores need float64 to stay distinct (DESIGN.md §4.8 e)
    return (out if out.dtype == torch.float64 else out.to(torch.float32)).contiguous()


def select_tokens(
    scores: torch.Tensor,
    budget: int | float,
    *,
    allocation: str = "uniform",
    page_size: int = 16,
    alpha: float = 0.2,
    lengths: torch.Tensor | None = None,
) -> torch.Tensor:
    """Kept-token mask [H_kv, n] (True = kept) for final scores [H_kv, n] (DESIGN.md §3, §7.1).

    Head i keeps its K_i = min(n, p_i * page_size) best tokens (p_i from allocate_pages; all n when nothing
    is evicted) in a stable descending order of its scores: equal scores keep the lower position.
    lengths: ragged held sets (DESIGN.md §4.8 a; see allocate_pages): head i holds its first n_i scores, keeps
    K_i = min(n_i, p_i * page_size) of them, and never its padding.
    """
    pages = allocate_pages(scores, budget, allocation=allocation, page_size=page_size, alpha=alpha,
                           lengths=lengths)  # validates
    held = scores.shape[1] if lengths is None else lengths
    return keep_mask(mask_padding(scores, lengths), kept_counts(pages, held, page_size))
