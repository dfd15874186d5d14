"""Window attention statistics (DESIGN.md §1) and the single entry point for raw query-based scores.

For one KV head and its group of g query heads, with the window rows t = 0..w-1 at positions n-w+t:

    z[h, t, j]  = s * <q^{h,t}, k_j>   for j <= n-w+t, 0 at masked positions (never -inf: 0*inf = NaN)
    LSE[h, t]   = log sum_{j visible} exp(z[h, t, j])      (max-subtracted via logsumexp)
    p[h, t, j]  = exp(z - LSE) at visible positions, exactly 0 at masked positions
    a[h, t]     = sum_j p[h, t, j] v_j                    (pre-W_O window output)

Everything is fp32 on the input's device with TF32 off. The [g, w, n] tensors of one KV head are the
largest thing materialised; heads are processed one at a time.

`raw_window_scores` is the one function that computes the per-KV-head raw scores (GQA-aggregated, before
pooling) of snapkv, h2o, tova, dropkv and obcache-value/key/joint. A CUDA kernel can be plugged in with
`register_raw_kernel`; `reference_raw_window_scores` always runs the torch reference.

Ragged held sets (DESIGN.md §4.8 a, ragged.py): with `lengths`, KV head i holds its first n_i keys; the window
rows are the last w held tokens of every head, so row t sits at n_i - w + t and sees j <= n_i - w + t. Its raw
scores are those of head i alone over its n_i keys, and -inf in the padding.
"""

from __future__ import annotations

import contextlib
import math
from functools import cached_property
from typing import Callable, Iterator

import torch

from ._validate import check_gqa, check_kv, check_queries
from .ragged import check_lengths, map_heads

RawKernel = Callable[..., torch.Tensor]
_RAW_KERNEL: RawKernel | None = None


def register_raw_kernel(fn: RawKernel | None) -> None:
    """Install (or with None remove) a CUDA implementation used by raw_window_scores for CUDA inputs of
    the policies that declare `has_kernel` (the others run the torch reference).

    It is called as fn(policy_name, q_window, keys, values, scale=..., gqa=..., lengths=...) with validated
    inputs in their original dtype (lengths: None, or the held counts [H_kv] of ragged held sets) and must
    return float32 [H_kv, n] equal to the reference within DESIGN.md §7.3 (-inf in the padding).
    """
    global _RAW_KERNEL
    _RAW_KERNEL = fn


@contextlib.contextmanager
def exact_fp32(device: torch.device) -> Iterator[None]:
    """Disable TF32 for CUDA matmuls inside the block (DESIGN.md §7.2); a no-op on other devices."""
    if device.type != "cuda":
        yield
        return
    matmul = torch.backends.cuda.matmul
    old = matmul.fp32_precision
    matmul.fp32_precision = "ieee"
    try:
        yield
    finally:
        matmul.fp32_precision = old


class WindowStats:
    """Attention statistics of the window rows of one query-head group against one KV head (fp32).

    q: [g, w, D], k: [n, D], v: [n, Dv]. Derived quantities are computed on first use.
    """

    def __init__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> None:
        self.k, self.v = k, v
        n, w = k.shape[0], q.shape[1]
        pos = torch.arange(n, device=k.device)
        rows = torch.arange(w, device=k.device) + (n - w)
        self.visible = pos.view(1, n) <= rows.view(w, 1)  # [w, n]
        logits = torch.matmul(q, k.transpose(0, 1)) * scale  # [g, w, n]
        masked = logits.masked_fill(~self.visible, float("-inf"))
        self.lse = torch.logsumexp(masked, dim=-1)  # [g, w]
        self.p = torch.exp(masked - self.lse.unsqueeze(-1))  # exactly 0 where masked
        self.z = logits.masked_fill_(~self.visible, 0.0)  # Z = 0 at masked positions (DESIGN.md §4.4)

    @cached_property
    def a(self) -> torch.Tensor:
        """Window outputs a^{h,t}: [g, w, Dv]."""
        return torch.matmul(self.p, self.v)

    @cached_property
    def aa(self) -> torch.Tensor:
        """||a^{h,t}||^2: [g, w, 1]."""
        return (self.a * self.a).sum(-1, keepdim=True)

    @cached_property
    def vv(self) -> torch.Tensor:
        """||v_j||^2: [n]."""
        return (self.v * self.v).sum(-1)

    @cached_property
    def av(self) -> torch.Tensor:
        """<a^{h,t}, v_j>: [g, w, n]."""
        return torch.matmul(self.a, self.v.transpose(0, 1))

    @cached_property
    def d2(self) -> torch.Tensor:
        """||a^{h,t} - v_j||^2 via the kernel identity ||a||^2 + ||v||^2 - 2<a,v>, clamped to >= 0: [g, w, n]."""
        return torch.clamp(self.aa + self.vv - 2.0 * self.av, min=0.0)


def window_stats(q_window: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, kv_head: int, scale: float,
                 dtype: torch.dtype = torch.float32) -> WindowStats:
    """WindowStats of KV head `kv_head` (inputs in any float dtype; upcast to `dtype`, fp32 or fp64, here)."""
    h_kv = keys.shape[1]
    g = q_window.shape[1] // h_kv
    q = q_window[:, kv_head * g : (kv_head + 1) * g, :].to(dtype).permute(1, 0, 2)  # [g, w, D]
    k = keys[:, kv_head, :].to(dtype)
    v = values[:, kv_head, :].to(dtype)
    return WindowStats(q, k, v, scale)


def aggregate_gqa(per_head: torch.Tensor, gqa: str) -> torch.Tensor:
    """[g, n] -> [n]: mean (default) or max over the query heads of the group (DESIGN.md §2.3 step 2)."""
    return per_head.mean(dim=0) if gqa == "mean" else per_head.amax(dim=0)


def _resolve(policy: object):
    from .registry import get_policy  # local import: the registry imports the policy modules

    pol = get_policy(policy) if isinstance(policy, str) else policy
    if not getattr(pol, "window_raw", False):
        name = getattr(pol, "name", policy)
        raise ValueError(f"policy {name!r} has no raw window score (only snapkv, h2o, tova, dropkv, obcache-*)")
    return pol


def _check(q_window, keys, values, scale, gqa, lengths) -> float:
    n, h_kv = check_kv(keys, values)
    w, _ = check_queries(q_window, keys)
    if w < 1:
        raise ValueError(f"need at least one window query row, got w={w}")
    if w > n:
        raise ValueError(f"window w={w} is larger than the prompt length n={n}")
    if lengths is not None:
        check_lengths(lengths, h_kv, n, device=keys.device, minimum=w)
    check_gqa(gqa)
    if scale is None:
        return 1.0 / math.sqrt(keys.shape[-1])
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not (0 < float(scale) < math.inf):
        raise ValueError(f"scale must be a positive finite number, got {scale!r}")
    return float(scale)


def reference_raw_window_scores(
    policy: object, q_window: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, *, scale: float | None = None,
    gqa: str = "mean", dtype: torch.dtype = torch.float32, lengths: torch.Tensor | None = None,
) -> torch.Tensor:
    """Torch reference of raw_window_scores, whatever the device: fp32 (DESIGN.md §7.2; TF32 off), or fp64 when
    asked. It is also the reference of the Triton kernels (tests/kernels/test_window_scores.py): the raw
    scores are written once, in each policy's `head_raw`."""
    pol = _resolve(policy)
    s = _check(q_window, keys, values, scale, gqa, lengths)

    def head(heads: slice, m: int) -> torch.Tensor:  # one KV head over its first m keys
        st = window_stats(q_window, keys[:m], values[:m], heads.start, s, dtype)
        return aggregate_gqa(pol.head_raw(st), gqa).unsqueeze(0)

    with exact_fp32(keys.device):
        return map_heads(head, keys.shape[1], keys.shape[0], lengths, chunk=1).contiguous()


def raw_window_scores(
    policy: object, q_window: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, *, scale: float | None = None,
    gqa: str = "mean", lengths: torch.Tensor | None = None,
) -> torch.Tensor:
    """Raw per-KV-head score [H_kv, n] float32 (after GQA aggregation, before pooling and protection).

    q_window [w, H_q, D] holds exactly the w window rows (positions n-w..n-1); keys [n, H_kv, D];
    values [n, H_kv, Dv]; scale defaults to 1/sqrt(D). Query head h belongs to KV head h // (H_q/H_kv).
    lengths: None, or int64 [H_kv] on the keys' device, w <= n_i <= n: the held counts of ragged held sets
    (module docstring); the scores are then -inf at j >= n_i.
    """
    pol = _resolve(policy)
    s = _check(q_window, keys, values, scale, gqa, lengths)
    if _RAW_KERNEL is not None and keys.is_cuda and pol.has_kernel:
        return _RAW_KERNEL(pol.name, q_window, keys, values, scale=s, gqa=gqa, lengths=lengths)
    return reference_raw_window_scores(pol, q_window, keys, values, scale=s, gqa=gqa, lengths=lengths)
