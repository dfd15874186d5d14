"""Key-only scores (KeyDiff, K-norm; DESIGN.md §4) in two Triton launches that read the keys at copy bandwidth.

key_scores(policy, keys, lengths=None) -> float32 [H, n] for keys [n, H, D] (bf16/fp16/fp32, unit stride on D,
any token and head strides: the engine passes a layer group folded into the head axis):
    knorm:   S_j = -||k_j||
    keydiff: S_j = -<mu, k_j> / max(||mu|| ||k_j||, 1e-8),  mu = mean of the head's n keys
With `lengths` (ragged held sets, DESIGN.md §4.8 a: an integer tensor [H] on the keys' device, 1 <= n_i <= n, not
checked) head i holds keys[:n_i, i]: mu is the mean of those, and its scores are -inf at j >= n_i.
Everything is fp32. Launch 1 (keydiff only) sums the keys of each head over token blocks into
[splits, H, D] partials (summed by torch: mu); launch 2 reads each key once more for its dot with mu and
its norm. The torch reference is the policy's `key_score` (vllm_evict/policies/keydiff.py, knorm.py); the
sums run in another order, so scores agree to fp32 rounding (DESIGN.md §7.3 near-ties).
n and H are runtime values: no prompt length or group size compiles a new variant.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from vllm_evict.kernels.window_scores import _held_count
from vllm_evict.policies.keydiff import EPS_COS

BLOCK_N = 64
SUM_TOKENS = 1024  # tokens per program of the column sum (a multiple of BLOCK_N)
POLICIES = ("keydiff", "knorm")


@triton.jit(do_not_specialize=["n", "H"])
def _column_sum_kernel(k_ptr, lengths_ptr, part_ptr, n, stride_n, stride_h, H, D: tl.constexpr, D_P: tl.constexpr,
                       BLOCK: tl.constexpr, SPAN: tl.constexpr, HAS_LENGTHS: tl.constexpr):
    head, split = tl.program_id(0), tl.program_id(1)
    held = _held_count(lengths_ptr, head, n, HAS_LENGTHS)
    d = tl.arange(0, D_P)
    acc = tl.zeros((BLOCK, D_P), dtype=tl.float32)
    for start in range(split * SPAN, split * SPAN + SPAN, BLOCK):
        t = start + tl.arange(0, BLOCK)
        mask = (t[:, None] < held) & (d[None, :] < D)
        k = tl.load(k_ptr + t[:, None].to(tl.int64) * stride_n + head * stride_h + d[None, :], mask=mask, other=0.0)
        acc += k.to(tl.float32)
    tl.store(part_ptr + (split * H + head) * D + d, tl.sum(acc, axis=0), mask=d < D)


@triton.jit(do_not_specialize=["n"])
def _key_score_kernel(k_ptr, lengths_ptr, mu_ptr, out_ptr, n, stride_n, stride_h, D: tl.constexpr, D_P: tl.constexpr,
                      BLOCK: tl.constexpr, KEYDIFF: tl.constexpr, EPS: tl.constexpr, HAS_LENGTHS: tl.constexpr):
    head, block = tl.program_id(0), tl.program_id(1)
    held = _held_count(lengths_ptr, head, n, HAS_LENGTHS)
    d = tl.arange(0, D_P)
    t = block * BLOCK + tl.arange(0, BLOCK)
    mask = (t[:, None] < held) & (d[None, :] < D)
    k = tl.load(k_ptr + t[:, None].to(tl.int64) * stride_n + head * stride_h + d[None, :], mask=mask,
                other=0.0).to(tl.float32)
    norm = tl.sqrt(tl.sum(k * k, axis=1))
    if KEYDIFF:
        mu = tl.load(mu_ptr + head * D + d, mask=d < D, other=0.0)
        mu_norm = tl.sqrt(tl.sum(mu * mu, axis=0))
        score = -tl.sum(k * mu[None, :], axis=1) / tl.maximum(mu_norm * norm, EPS)
    else:
        score = -norm
    if HAS_LENGTHS:  # the padding of a ragged held set is no token: -inf, as in the reference
        score = tl.where(t < held, score, float("-inf"))
    tl.store(out_ptr + head * n + t, score, mask=t < n)


def key_scores(policy: str, keys: torch.Tensor, lengths: torch.Tensor | None = None) -> torch.Tensor:
    """float32 [H, n] scores of `policy` ("keydiff" or "knorm") for keys [n, H, D]; `lengths`: held counts [H]
    of ragged held sets (module docstring)."""
    if policy not in POLICIES:
        raise ValueError(f"no key-score kernel for policy {policy!r}; kernels exist for {POLICIES}")
    if keys.dim() != 3 or keys.stride(-1) != 1:
        raise ValueError(f"keys must be [n, H, D] with unit stride on D, got shape {tuple(keys.shape)}")
    n, H, D = keys.shape
    if lengths is not None and (tuple(lengths.shape) != (H,) or lengths.dtype not in (torch.int32, torch.int64)
                                or lengths.device != keys.device):
        raise ValueError(f"lengths must be int32/int64 [H] = ({H},) on {keys.device}, "
                         f"got {lengths.dtype} {tuple(lengths.shape)} on {lengths.device}")
    D_P = triton.next_power_of_2(D)
    out = torch.empty(H, n, dtype=torch.float32, device=keys.device)
    mu = out  # unused by knorm
    held = out if lengths is None else lengths.contiguous()  # a placeholder pointer without lengths
    if policy == "keydiff":
        splits = triton.cdiv(n, SUM_TOKENS)
        partial = torch.empty(splits, H, D, dtype=torch.float32, device=keys.device)
        _column_sum_kernel[(H, splits)](keys, held, partial, n, keys.stride(0), keys.stride(1), H, D=D, D_P=D_P,
                                        BLOCK=BLOCK_N, SPAN=SUM_TOKENS, HAS_LENGTHS=lengths is not None)
        mu = partial.sum(dim=0) / (n if lengths is None else held.view(H, 1))
    _key_score_kernel[(H, triton.cdiv(n, BLOCK_N))](keys, held, mu, out, n, keys.stride(0), keys.stride(1), D=D,
                                                    D_P=D_P, BLOCK=BLOCK_N, KEYDIFF=policy == "keydiff", EPS=EPS_COS,
                                                    HAS_LENGTHS=lengths is not None)
    return out


def key_scores_reference(policy: str, keys: torch.Tensor) -> torch.Tensor:
    """The policy's own fp32 torch scores (keys [n, H, D] -> [H, n])."""
    from vllm_evict.policies.registry import get_policy

    return get_policy(policy).key_score(keys.to(torch.float32).transpose(0, 1))
