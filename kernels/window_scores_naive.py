"""The naive PyTorch window scorer: the benchmark baseline for kernels/window_scores.py.

``naive_torch_scores`` is the straightforward implementation a user would write in PyTorch, in the
INPUT dtype (bf16 for the benchmark) on the GPU. It repeats K/V for GQA (HF ``repeat_kv`` style),
materialises the [H_q, w, n] logits / attention matrix in the input dtype (softmax computed in fp32 and
cast back, as SnapKV's code does) and, for dropkv and obcache-key/joint, the broadcast residual
a^{h,t} - v_j of shape [H_q, w, n, d] in the input dtype (reduced with torch.linalg.vector_norm, so only
one w x n x d tensor is alive at a time). It is NOT a precision reference (bf16 rounding of p and of
the residual); it exists to time.

The precision reference of the kernels is the policies' own: ``vllm_evict.policies.
reference_raw_window_scores`` (DESIGN.md §7.2, fp32 with TF32 off, or fp64), which computes each policy's
raw score from its ``head_raw``, so the scores are written once in torch.

Shapes: q_window [w, H_q, D], keys/values [n, H_kv, D]; window row t is position n-w+t;
query head h belongs to KV head h // g. Output: float32 [H_kv, n].
"""

from __future__ import annotations

import math

import torch

from vllm_evict.kernels.window_scores import POLICIES

EPS = 1e-6
WINDOW_POLICIES = tuple(POLICIES)  # the policies the kernels implement

__all__ = ["WINDOW_POLICIES", "naive_torch_scores", "EPS"]


def _check(policy, q_window, keys, values, gqa):
    if policy not in WINDOW_POLICIES:
        raise ValueError(f"unknown window policy {policy!r}")
    if gqa not in ("mean", "max"):
        raise ValueError(f"gqa must be 'mean' or 'max', got {gqa!r}")
    if q_window.dim() != 3 or keys.dim() != 3 or keys.shape != values.shape:
        raise ValueError("expected q_window [w, H_q, D] and keys/values [n, H_kv, D]")
    w, H_q, D = q_window.shape
    n, H_kv, Dk = keys.shape
    if D != Dk or H_q % H_kv != 0 or not (1 <= w <= n):
        raise ValueError(f"incompatible shapes q {tuple(q_window.shape)} k {tuple(keys.shape)}")


def naive_torch_scores(
    policy: str,
    q_window: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    *,
    scale: float | None = None,
    gqa: str = "mean",
) -> torch.Tensor:
    """Naive PyTorch scorer in the input dtype (benchmark baseline; see module docstring).

    q_window [w, H_q, D], keys/values [n, H_kv, D] -> float32 [H_kv, n].
    """
    _check(policy, q_window, keys, values, gqa)
    w, H_q, D = q_window.shape
    n, H_kv, _ = keys.shape
    g = H_q // H_kv
    s = 1.0 / math.sqrt(D) if scale is None else float(scale)
    q = q_window.transpose(0, 1)  # [H_q, w, D]
    k = keys.transpose(0, 1).repeat_interleave(g, dim=0)  # repeat_kv: [H_q, n, D]
    v = values.transpose(0, 1).repeat_interleave(g, dim=0)
    logits = torch.matmul(q, k.transpose(1, 2)) * s  # [H_q, w, n], input dtype
    causal = torch.arange(n, device=keys.device)[None, :] > (n - w + torch.arange(w, device=keys.device))[:, None]
    logits = logits.masked_fill(causal, float("-inf"))
    p = torch.softmax(logits, dim=-1, dtype=torch.float32).to(q.dtype)  # [H_q, w, n]
    if policy in ("snapkv", "h2o"):
        per_head = p.sum(dim=1, dtype=torch.float32)
    elif policy == "tova":
        per_head = p[:, -1, :].float()
    elif policy == "obcache-value":
        per_head = (p * p).sum(dim=1, dtype=torch.float32) * (v.float() ** 2).sum(-1)
    else:
        a = torch.matmul(p, v)  # [H_q, w, D]
        resid = a[:, :, None, :] - v[:, None, :, :]  # [H_q, w, n, D]: the w x n x d tensor
        d2 = torch.linalg.vector_norm(resid, dim=-1, dtype=torch.float32).square()  # [H_q, w, n]
        del resid
        if policy == "dropkv":
            per_head = ((p / (1 - p + EPS)) ** 2 * d2).sum(dim=1, dtype=torch.float32)
        else:
            zz = logits.masked_fill(causal, 0.0).float()
            if policy == "obcache-key":
                per_head = (p.float() ** 2 * zz ** 2 * d2).sum(dim=1)
            else:  # joint: ||(1+z) v - z a||^2 = ||v + z (v - a)||^2 -> needs the residual again
                vv = (v.float() ** 2).sum(-1)[:, None, :]
                av = torch.matmul(a.float(), v.float().transpose(1, 2))
                aa = (a.float() ** 2).sum(-1)[:, :, None]
                j2 = (1 + zz) ** 2 * vv - 2 * zz * (1 + zz) * av + zz ** 2 * aa
                per_head = (p.float() ** 2 * j2.clamp_min(0)).sum(dim=1)
    per_head = per_head.reshape(H_kv, g, n)
    raw = per_head.amax(dim=1) if gqa == "max" else per_head.mean(dim=1)
    if policy == "snapkv":
        raw = raw / w
    return raw.float()
