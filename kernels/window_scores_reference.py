"""Torch references for the window scores of kernels/window_scores.py.

``window_scores_reference`` is the SPEC §7.2 reference: the exact raw scores that the Triton
kernels compute (GQA-aggregated raw_j before pooling/protection, SPEC §2.3 steps 1-2, §4),
computed from q/k/v upcast to fp32 (or float64 when asked), TF32 disabled, max-subtracted
softmax, clamped d^2 identity, Z = 0 at masked positions. It materialises [H_kv, g*w, n] fp32
tensors (the w x n attention matrix, a handful of times) but never w x n x d.

``naive_torch_scores`` is the benchmark baseline: the straightforward implementation a user
would write in PyTorch, in the INPUT dtype (bf16 for the benchmark) on the GPU. It repeats K/V
for GQA (HF ``repeat_kv`` style), materialises the [H_q, w, n] logits / attention matrix in the
input dtype (softmax computed in fp32 and cast back, as SnapKV's code does) and, for dropkv and
obcache-key/joint, the broadcast residual a^{h,t} - v_j of shape [H_q, w, n, d] in the input
dtype (reduced with torch.linalg.vector_norm, so only one w x n x d tensor is alive at a time).
It is NOT a precision reference (bf16 rounding of p and of the residual); it exists to time.

Shapes: q_window [w, H_q, D], keys/values [n, H_kv, D]; window row t is position n-w+t;
query head h belongs to KV head h // g. Output: float32 [H_kv, n].
"""

from __future__ import annotations

import contextlib
import math

import torch

EPS = 1e-6

WINDOW_POLICIES = ("snapkv", "h2o", "tova", "dropkv", "obcache-value", "obcache-key", "obcache-joint")

__all__ = ["WINDOW_POLICIES", "window_scores_reference", "naive_torch_scores", "EPS"]


@contextlib.contextmanager
def _no_tf32():
    prev_mm = torch.backends.cuda.matmul.allow_tf32
    prev_cudnn = torch.backends.cudnn.allow_tf32
    prev_prec = torch.get_float32_matmul_precision()
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = prev_mm
        torch.backends.cudnn.allow_tf32 = prev_cudnn
        torch.set_float32_matmul_precision(prev_prec)


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


def _aggregate(per_row: torch.Tensor, H_kv: int, g: int, w: int, gqa: str) -> torch.Tensor:
    """[H_kv, g*w, n] per-(head,row) contributions -> [H_kv, n]: sum over t, then GQA mean/max."""
    per_head = per_row.reshape(H_kv, g, w, -1).sum(dim=2)  # raw^h_j, [H_kv, g, n]
    if gqa == "max":
        return per_head.amax(dim=1)
    return per_head.mean(dim=1)


def window_scores_reference(
    policy: str,
    q_window: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    *,
    scale: float | None = None,
    gqa: str = "mean",
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """SPEC §7.2 reference raw scores.

    q_window [w, H_q, D], keys/values [n, H_kv, D] (any float dtype, any device)
    -> ``dtype`` (float32 by default; float64 allowed) [H_kv, n] on the inputs' device.
    """
    _check(policy, q_window, keys, values, gqa)
    w, H_q, D = q_window.shape
    n, H_kv, _ = keys.shape
    g = H_q // H_kv
    s = 1.0 / math.sqrt(D) if scale is None else float(scale)
    with _no_tf32():
        q = q_window.to(dtype).permute(1, 0, 2).reshape(H_kv, g * w, D)  # row = hg*w + t
        k = keys.to(dtype).permute(1, 0, 2)  # [H_kv, n, D]
        v = values.to(dtype).permute(1, 0, 2)
        z = torch.matmul(q, k.transpose(1, 2)) * s  # [H_kv, g*w, n]
        t = torch.arange(g * w, device=keys.device) % w
        pos = n - w + t  # window row t is position n-w+t
        vis = torch.arange(n, device=keys.device)[None, :] <= pos[:, None]  # [g*w, n]
        vis = vis.unsqueeze(0)
        z = torch.where(vis, z, torch.zeros((), dtype=dtype, device=z.device))  # Z = 0 when masked
        zm = torch.where(vis, z, torch.full((), float("-inf"), dtype=dtype, device=z.device))
        zmax = zm.amax(dim=-1, keepdim=True)
        e = torch.exp(zm - zmax)  # 0 at masked positions
        p = e / e.sum(dim=-1, keepdim=True)

        if policy in ("snapkv", "h2o"):
            c = p
        elif policy == "tova":
            c = torch.where((t == w - 1)[None, :, None], p, torch.zeros((), dtype=dtype, device=p.device))
        elif policy == "obcache-value":
            vv = (v * v).sum(-1)  # [H_kv, n]
            c = p * p * vv[:, None, :]
        else:
            a = torch.matmul(p, v)  # [H_kv, g*w, D]
            aa = (a * a).sum(-1)  # [H_kv, g*w]
            vv = (v * v).sum(-1)  # [H_kv, n]
            av = torch.matmul(a, v.transpose(1, 2))  # [H_kv, g*w, n]
            if policy in ("dropkv", "obcache-key"):
                d2 = (aa[:, :, None] + vv[:, None, :] - 2.0 * av).clamp_min(0.0)
                if policy == "dropkv":
                    om = p / (1.0 - p + EPS)
                    c = om * om * d2
                else:
                    c = p * p * z * z * d2
            else:  # obcache-joint: A^2 [(1+Z)^2 ||v||^2 - 2 Z (1+Z) <a,v> + Z^2 ||a||^2], >= 0
                zp1 = 1.0 + z
                j2 = zp1 * zp1 * vv[:, None, :] - 2.0 * z * zp1 * av + z * z * aa[:, :, None]
                c = p * p * j2.clamp_min(0.0)
        c = torch.where(vis, c, torch.zeros((), dtype=dtype, device=c.device))
        raw = _aggregate(c, H_kv, g, w, gqa)
        if policy == "snapkv":
            raw = raw / w
    return raw


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
