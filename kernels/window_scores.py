"""Fused Triton window-scoring kernels (DESIGN.md §5) for the query-based eviction policies.

Public entry points
-------------------
``window_scores(policy, q_window, keys, values, *, scale=None, gqa="mean") -> Tensor[H_kv, n] fp32``
    q_window: [w, H_q, D]  (window rows t = 0..w-1 are prompt positions n-w+t; post-RoPE)
    keys:     [n, H_kv, D] (post-RoPE, as stored in the cache)
    values:   [n, H_kv, D]
    dtype bf16 / fp16 / fp32 (q, k, v the same dtype), CUDA tensors; any strides with a
    unit stride on D.  Returns the GQA-aggregated raw score raw_j (DESIGN.md §2.3 step 2),
    BEFORE pooling / protection, as float32 [H_kv, n].

``window_scores_batched(policy, q_window, keys, values, ...) -> Tensor[B, H_kv, n] fp32``
    Same with a leading batch axis: q_window [B, w, H_q, D], keys/values [B, n, H_kv, D]
    (every request of the batch has the same n and w).

Both take ``lengths`` (default None): the held counts of ragged held sets (DESIGN.md §4.8 a), an integer
tensor [H_kv] ([B, H_kv] batched) on the keys' device with w <= n_i <= n (not checked: reading it would
wait for the device). KV head i then holds keys[:n_i, i] (values alike; padding after them), its window
row t sits at n_i - w + t, and its scores are -inf at j >= n_i, as in
``vllm_evict.policies.reference_raw_window_scores(..., lengths=...)``.

Policies: snapkv, h2o, tova, dropkv, obcache-value, obcache-key, obcache-joint (DESIGN.md §4).
GQA: query head h belongs to KV head h // g (g = H_q / H_kv); ``gqa`` is "mean" or "max".

Design (DESIGN.md §5). Per (batch, KV head) the g*w window rows of the group are stacked into
M = g*w rows (row m = hg*W_P + t; padded to powers of two, at least 16 rows for tl.dot):

* Kernel A (``_window_fwd_kernel``): FlashAttention-2 style online softmax of the M rows over
  key tiles with the causal mask (row t sees keys j <= n-w+t). Produces the window output
  a^{h,t} (fp32, pre-W_O) and LSE^{h,t} (natural log). Split-K over the key axis when
  B*H_kv is small compared to the SM count: each split r writes (m_r, l_r, acc_r); with one
  split the merge below is a copy, kept so that no kernel variant depends on n.
  Policies that need no a (snapkv, h2o, tova, obcache-value) skip the V load and the P·V dot.
* Kernel C (``_splitk_merge_kernel``): m* = max m_r, l* = sum e^{m_r-m*} l_r,
  acc* = sum e^{m_r-m*} acc_r, a = acc*/l*, LSE = m* + log l*.
* Kernel B (``_window_score_kernel``): grid (B*H_kv, cdiv(n, BLOCK_N)); each program owns one
  key tile of BLOCK_N = SUB_N * num_sub keys (num_sub sub-tiles in a software-pipelined loop, so
  that q, LSE and a are loaded once per program and the K/V loads of the next sub-tile overlap
  the math of the current one; num_sub shrinks at small n to keep the grid >= 4 programs/SM).
  n, w, num_sub and the split count are runtime arguments, never specialized, and the merge width
  is the constant MAX_SPLITS: neither a new prompt length nor a new B*H_kv compiles anything.
  loads k_j, v_j once, recomputes z = s*q·k (bf16 tensor-core dot, fp32 accumulate),
  p = exp(z - LSE) (fp32, never rounded to bf16), <a, v> with a second dot in IEEE fp32,
  applies the policy epilogue, reduces over t then over the g heads (mean or max) and writes
  raw[n] fp32. Masked (causally invisible) positions have p = 0 and z = 0.

Nothing of size w x n or w x n x d ever reaches HBM; K/V are never repeated for GQA.
Scratch: a [B*H_kv, M_P, D_P] fp32, LSE [B*H_kv, M_P] fp32 and, with split-K,
(m, l) [B*H_kv, S, M_P] and acc [B*H_kv, S, M_P, D_P] fp32 (a few MB).

Precision (DESIGN.md §5): dots of two bf16/fp16 operands accumulate in fp32. The dots with an fp32
operand (P·V in kernel A, a·vᵀ in kernel B) must be fp32-accurate. ``precision="auto"`` (default)
picks ``"bf16x3"`` for bf16 inputs and ``"ieee"`` otherwise:

* ``"ieee"``: IEEE fp32 dots on the CUDA cores (Triton's FMA dot: 22% of copy bandwidth in kernel B).
* ``"bf16x3"``: the fp32 operand is split exactly into three bf16 parts (x = x1 + x2 + x3, 24
  significand bits kept); the three products with the bf16 operand are exact and accumulate in fp32 on
  the tensor cores (3x faster at 128K, H100). The tensor cores' accumulation loses more than the IEEE
  dot where the expanded forms cancel, at the key j whose p -> 1 (a ~ v_j). So kernel A also tracks
  each row's largest-logit key, kernel C computes ||a - v_j||^2 and <v_j, a - v_j> elementwise for it,
  and kernel B uses those exact values there (dropkv, obcache-key, obcache-joint). With them its error
  against the fp64 reference is at or below the IEEE path's, peaked inputs included
  (benchmarks/precision_check.py, docs/BENCHMARKS.md). fp16 keeps IEEE: its narrow exponent cannot
  hold the split of small values exactly.

The module imports on a machine without Triton or CUDA; the kernels need both at call time.
"""

from __future__ import annotations

import functools
import math
import os
from dataclasses import dataclass

import torch

try:  # CI has no GPU and may have no Triton: keep the import optional.
    import triton
    import triton.language as tl

    _HAS_TRITON = True
except Exception:  # pragma: no cover - depends on the environment
    triton = None
    tl = None
    _HAS_TRITON = False

__all__ = [
    "POLICIES",
    "window_scores",
    "window_scores_batched",
    "WindowScoreConfig",
    "has_triton",
]

EPS = 1e-6

# policy name -> (id used inside the kernels, needs a^{h,t}, needs v_j)
POLICIES: dict[str, tuple[int, bool, bool]] = {
    "snapkv": (0, False, False),
    "h2o": (1, False, False),
    "tova": (2, False, False),
    "dropkv": (3, True, True),
    "obcache-value": (4, False, True),
    "obcache-key": (5, True, True),
    "obcache-joint": (6, True, True),
}


def has_triton() -> bool:
    return _HAS_TRITON


@dataclass(frozen=True)
class WindowScoreConfig:
    """Launch parameters. ``None`` picks the default for the precision (tuned on an H100,
    see kernels/NOTES.md)."""

    precision: str = "auto"  # "auto" (bf16x3 for bf16 inputs, else ieee), "ieee" or "bf16x3" (DESIGN.md §5)
    block_n_a: int | None = None  # key tile of kernel A
    num_warps_a: int | None = None
    num_stages_a: int | None = None
    sub_n_b: int | None = None  # kernel B: keys per sub-tile
    num_warps_b: int | None = None
    num_stages_b: int | None = None
    max_sub_b: int | None = None  # kernel B: at most this many sub-tiles per program (power of two)
    num_sub_b: int | None = None  # kernel B: force this many sub-tiles per program (power of two)
    num_splits: int | None = None  # None: automatic split-K for kernel A


# (block_n_a, num_warps_a, num_stages_a, sub_n_b, num_warps_b, num_stages_b); from the launch
# sweep of benchmarks/scoring.py --sweep at n = 128K (kernels/NOTES.md). A launch that runs out of
# shared memory (large g*w, other GPUs) falls back to fewer stages, then smaller tiles.
_DEFAULTS = {
    ("ieee", True): (16, 4, 3, 64, 4, 2),  # policies with an fp32 FMA dot (a needed)
    ("bf16x3", True): (64, 4, 3, 64, 4, 3),
    ("ieee", False): (128, 4, 2, 128, 4, 2),  # no a needed: only the bf16 QK dot
    ("bf16x3", False): (128, 4, 2, 128, 4, 2),
}

_DEFAULT_CONFIG = WindowScoreConfig()


def _resolve(cfg: WindowScoreConfig, precision: str, need_a: bool) -> dict:
    d = _DEFAULTS[(precision, need_a)]
    vals = (cfg.block_n_a, cfg.num_warps_a, cfg.num_stages_a, cfg.sub_n_b, cfg.num_warps_b, cfg.num_stages_b)
    names = ("block_n_a", "num_warps_a", "num_stages_a", "sub_n_b", "num_warps_b", "num_stages_b")
    return {k: (v if v is not None else dv) for k, v, dv in zip(names, vals, d)}


def _next_pow2(x: int) -> int:
    return 1 if x <= 1 else 1 << (x - 1).bit_length()


if _HAS_TRITON:

    @triton.jit
    def _dot_f32_operand(x_f32, y, PRECISION: tl.constexpr):
        """x_f32 [M, K] fp32 times y [K, N] (bf16/fp16/fp32) -> [M, N] fp32.

        PRECISION 0: IEEE fp32 dot (both operands upcast to fp32, no TF32).
        PRECISION 1: exact 3-way split of x into y's 16-bit type, three tensor-core dots.
        """
        if PRECISION == 0:
            return tl.dot(x_f32, y.to(tl.float32), input_precision="ieee")
        else:
            x1 = x_f32.to(y.dtype)
            r1 = x_f32 - x1.to(tl.float32)
            x2 = r1.to(y.dtype)
            x3 = (r1 - x2.to(tl.float32)).to(y.dtype)
            acc = tl.dot(x1, y)
            acc = tl.dot(x2, y, acc)
            acc = tl.dot(x3, y, acc)
            return acc

    @triton.jit
    def _dot_qk(q, k, IS_F32: tl.constexpr):
        """q [M, D] times k [N, D] transposed -> [M, N] fp32 (IEEE when the inputs are fp32)."""
        if IS_F32:
            return tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            return tl.dot(q, tl.trans(k))

    @triton.jit
    def _held_count(LENGTHS, bh, n, HAS_LENGTHS: tl.constexpr):
        """Keys held by (batch, KV head) bh: LENGTHS[bh] for ragged held sets, else all n (also used by
        key_scores.py)."""
        if HAS_LENGTHS:
            return tl.load(LENGTHS + bh).to(tl.int32)
        else:
            return n

    # Nothing that depends on the prompt length or on the number of KV heads (the engine folds layers
    # into them) is a compile-time constant or a specialized integer: one compiled variant per (policy,
    # gqa, precision, dtype, group size and head dim) serves every n and head count.
    @triton.jit(do_not_specialize=["n", "w", "H_kv", "tiles_per_split"])
    def _window_fwd_kernel(
        Q, K, V, LENGTHS,
        M_PART, L_PART, ACC_PART, IDX_PART,  # split-K partials (always written; kernel C merges them)
        n, w, g, H_kv, qk_scale2,  # qk_scale2 = scale * log2(e)
        tiles_per_split,
        sqb, sqt, sqh,
        skb, skn, skh,
        svb, svn, svh,
        D: tl.constexpr, D_P: tl.constexpr,
        G_P: tl.constexpr, W_P: tl.constexpr,
        BLOCK_N: tl.constexpr,
        NEED_A: tl.constexpr, PRECISION: tl.constexpr, IS_F32: tl.constexpr, TRACK_PEAK: tl.constexpr,
        HAS_LENGTHS: tl.constexpr,
    ):
        M_P: tl.constexpr = G_P * W_P
        bh = tl.program_id(0)
        split = tl.program_id(1)
        num_splits = tl.num_programs(1)
        b = bh // H_kv
        kvh = bh % H_kv
        n_held = _held_count(LENGTHS, bh, n, HAS_LENGTHS)

        rows = tl.arange(0, M_P)
        hg = rows // W_P
        t = rows % W_P
        row_valid = (hg < g) & (t < w)
        pos = tl.where(row_valid, n_held - w + t, n_held - 1)  # causal limit of each row
        offs_d = tl.arange(0, D_P)
        d_mask = offs_d < D

        q_ptrs = (Q + b.to(tl.int64) * sqb + t[:, None] * sqt + (kvh * g + hg)[:, None] * sqh
                  + offs_d[None, :])
        q = tl.load(q_ptrs, mask=row_valid[:, None] & d_mask[None, :], other=0.0)

        m_i = tl.full([M_P], -1.0e30, tl.float32)
        l_i = tl.zeros([M_P], tl.float32)
        acc = tl.zeros([M_P, D_P], tl.float32)
        peak = tl.zeros([M_P], tl.int32)  # key of each row's largest logit so far (TRACK_PEAK)

        k_base = K + b.to(tl.int64) * skb + kvh * skh
        v_base = V + b.to(tl.int64) * svb + kvh * svh
        tile_lo = split * tiles_per_split
        tile_hi = tl.minimum(tile_lo + tiles_per_split, tl.cdiv(n_held, BLOCK_N))
        for tile in range(tile_lo, tile_hi):
            offs_n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
            n_mask = offs_n < n_held
            k = tl.load(k_base + offs_n[:, None].to(tl.int64) * skn + offs_d[None, :],
                        mask=n_mask[:, None] & d_mask[None, :], other=0.0)
            s = _dot_qk(q, k, IS_F32) * qk_scale2  # log2 domain
            vis = offs_n[None, :] <= pos[:, None]
            s = tl.where(vis, s, float("-inf"))
            tile_max = tl.max(s, axis=1)
            if TRACK_PEAK:
                peak = tl.where(tile_max > m_i, tile * BLOCK_N + tl.argmax(s, axis=1), peak)
            m_new = tl.maximum(m_i, tile_max)
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            if NEED_A:
                v = tl.load(v_base + offs_n[:, None].to(tl.int64) * svn + offs_d[None, :],
                            mask=n_mask[:, None] & d_mask[None, :], other=0.0)
                acc = acc * alpha[:, None] + _dot_f32_operand(p, v, PRECISION)
            m_i = m_new

        part = (bh * num_splits + split).to(tl.int64)
        tl.store(M_PART + part * M_P + rows, m_i)
        tl.store(L_PART + part * M_P + rows, l_i)
        if NEED_A:
            tl.store(ACC_PART + part * (M_P * D_P) + rows[:, None] * D_P + offs_d[None, :], acc)
        if TRACK_PEAK:
            tl.store(IDX_PART + part * M_P + rows, peak)

    @triton.jit(do_not_specialize=["num_splits", "H_kv"])
    def _splitk_merge_kernel(
        M_PART, L_PART, ACC_PART, IDX_PART, A_OUT, LSE_OUT,
        V, PEAK_OUT, PEAK_D2_OUT, PEAK_VD_OUT,
        num_splits, H_kv,
        svb, svn, svh,
        D: tl.constexpr, M_P: tl.constexpr, D_P: tl.constexpr, S_P: tl.constexpr, BLOCK_M: tl.constexpr,
        NEED_A: tl.constexpr, TRACK_PEAK: tl.constexpr,
    ):
        bh = tl.program_id(0)
        rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_s = tl.arange(0, S_P)
        s_mask = offs_s < num_splits
        base = bh.to(tl.int64) * num_splits
        ml_ptrs = (base + offs_s[:, None]) * M_P + rows[None, :]
        m_r = tl.load(M_PART + ml_ptrs, mask=s_mask[:, None], other=float("-inf"))
        l_r = tl.load(L_PART + ml_ptrs, mask=s_mask[:, None], other=0.0)
        m_star = tl.max(m_r, axis=0)  # >= -1e30, finite; every row sees key 0 in split 0, so l* > 0
        l_star = tl.sum(tl.exp2(m_r - m_star[None, :]) * l_r, axis=0)
        lse = (m_star + tl.log2(l_star)) * 0.6931471805599453
        tl.store(LSE_OUT + bh.to(tl.int64) * M_P + rows, lse)
        if NEED_A:
            offs_d = tl.arange(0, D_P)
            acc = tl.zeros([BLOCK_M, D_P], tl.float32)
            for r in range(0, num_splits):
                part = base + r
                m_one = tl.load(M_PART + part * M_P + rows)
                acc_r = tl.load(ACC_PART + part * (M_P * D_P) + rows[:, None] * D_P + offs_d[None, :])
                acc += tl.exp2(m_one - m_star)[:, None] * acc_r
            a = acc / l_star[:, None]
            tl.store(A_OUT + bh.to(tl.int64) * (M_P * D_P) + rows[:, None] * D_P + offs_d[None, :], a)
            if TRACK_PEAK:
                # ||a - v_peak||^2 and <v_peak, a - v_peak> elementwise: where p_peak -> 1, a ~ v_peak and
                # the expanded forms in <a, v> cancel; kernel B uses these exact values for that key
                idx_r = tl.load(IDX_PART + ml_ptrs, mask=s_mask[:, None], other=-1)
                peak = tl.max(tl.where(m_r == m_star[None, :], idx_r, -1), axis=0)
                d_mask = offs_d < D
                v_pk = tl.load(V + (bh // H_kv).to(tl.int64) * svb + peak[:, None].to(tl.int64) * svn
                               + (bh % H_kv) * svh + offs_d[None, :], mask=d_mask[None, :], other=0.0)
                diff = a - v_pk.to(tl.float32)
                tl.store(PEAK_OUT + bh.to(tl.int64) * M_P + rows, peak)
                tl.store(PEAK_D2_OUT + bh.to(tl.int64) * M_P + rows, tl.sum(diff * diff, axis=1))
                tl.store(PEAK_VD_OUT + bh.to(tl.int64) * M_P + rows, tl.sum(v_pk.to(tl.float32) * diff, axis=1))

    @triton.jit(do_not_specialize=["n", "w", "H_kv", "num_sub"])
    def _window_score_kernel(
        Q, K, V, LENGTHS, A, LSE, PEAK, PEAK_D2, PEAK_VD, OUT,
        n, w, g, H_kv, scale, inv_w, inv_g, eps, num_sub,
        sqb, sqt, sqh,
        skb, skn, skh,
        svb, svn, svh,
        D: tl.constexpr, D_P: tl.constexpr,
        G_P: tl.constexpr, W_P: tl.constexpr,
        SUB_N: tl.constexpr,
        POLICY: tl.constexpr, NEED_A: tl.constexpr, NEED_V: tl.constexpr,
        GQA_MAX: tl.constexpr, PRECISION: tl.constexpr, IS_F32: tl.constexpr,
        TRACK_PEAK: tl.constexpr, NUM_STAGES: tl.constexpr, HAS_LENGTHS: tl.constexpr,
    ):
        """One program per key tile of BLOCK_N = SUB_N * num_sub keys, processed in num_sub
        sub-tiles (software-pipelined loads); q, LSE, a (and its split) are loaded once."""
        M_P: tl.constexpr = G_P * W_P
        bh = tl.program_id(0)
        tile = tl.program_id(1)
        b = bh // H_kv
        kvh = bh % H_kv

        rows = tl.arange(0, M_P)
        hg = rows // W_P
        t = rows % W_P
        row_valid = (hg < g) & (t < w)
        n_held = _held_count(LENGTHS, bh, n, HAS_LENGTHS)
        pos = tl.where(row_valid, n_held - w + t, -1)  # invalid rows see nothing
        offs_d = tl.arange(0, D_P)
        d_mask = offs_d < D

        q = tl.load(Q + b.to(tl.int64) * sqb + t[:, None] * sqt + (kvh * g + hg)[:, None] * sqh
                    + offs_d[None, :], mask=row_valid[:, None] & d_mask[None, :], other=0.0)
        lse2 = tl.load(LSE + bh.to(tl.int64) * M_P + rows) * 1.4426950408889634
        if NEED_A:
            a = tl.load(A + bh.to(tl.int64) * (M_P * D_P) + rows[:, None] * D_P + offs_d[None, :])
            aa = tl.sum(a * a, axis=1)  # ||a||^2 [M_P]
            if PRECISION == 1:  # exact 3-way split of a into q's 16-bit type
                a1 = a.to(q.dtype)
                r1 = a - a1.to(tl.float32)
                a2 = r1.to(q.dtype)
                a3 = (r1 - a2.to(tl.float32)).to(q.dtype)
        if TRACK_PEAK:
            peak = tl.load(PEAK + bh.to(tl.int64) * M_P + rows)
            peak_d2 = tl.load(PEAK_D2 + bh.to(tl.int64) * M_P + rows)
            peak_vd = tl.load(PEAK_VD + bh.to(tl.int64) * M_P + rows)
        k_base = K + b.to(tl.int64) * skb + kvh * skh
        v_base = V + b.to(tl.int64) * svb + kvh * svh
        o_base = OUT + bh.to(tl.int64) * n

        for sub in tl.range(0, num_sub, num_stages=NUM_STAGES):
            offs_n = (tile * num_sub + sub) * SUB_N + tl.arange(0, SUB_N)
            n_mask = offs_n < n
            held = offs_n < n_held
            k = tl.load(k_base + offs_n[:, None].to(tl.int64) * skn + offs_d[None, :],
                        mask=held[:, None] & d_mask[None, :], other=0.0)
            if NEED_V:
                v = tl.load(v_base + offs_n[:, None].to(tl.int64) * svn + offs_d[None, :],
                            mask=held[:, None] & d_mask[None, :], other=0.0)
                vf = v.to(tl.float32)
                vv = tl.sum(vf * vf, axis=1)  # ||v_j||^2 [SUB_N]
            if NEED_A:
                if PRECISION == 0:
                    av = tl.dot(a, tl.trans(vf), input_precision="ieee")  # <a, v_j> [M_P, SUB_N]
                else:
                    vt = tl.trans(v)
                    av = tl.dot(a1, vt)
                    av = tl.dot(a2, vt, av)
                    av = tl.dot(a3, vt, av)

            vis = offs_n[None, :] <= pos[:, None]  # causal + row validity (pos <= n-1)
            z = _dot_qk(q, k, IS_F32) * scale  # natural-log logits, fp32
            z = tl.where(vis, z, 0.0)  # DESIGN.md §4.4: Z = 0 at masked positions
            p = tl.exp2(z * 1.4426950408889634 - lse2[:, None])
            p = tl.where(vis, p, 0.0)

            if POLICY == 3 or POLICY == 5:  # d^2 = ||a - v_j||^2 by the clamped identity, exact at the peak key
                d2 = tl.maximum(aa[:, None] + vv[None, :] - 2.0 * av, 0.0)
                if TRACK_PEAK:
                    d2 = tl.where(offs_n[None, :] == peak[:, None], peak_d2[:, None], d2)

            if POLICY == 0 or POLICY == 1:  # snapkv / h2o: sum_t p
                c = p
            elif POLICY == 2:  # tova: last window row only
                c = tl.where((t == w - 1)[:, None], p, 0.0)
            elif POLICY == 3:  # dropkv
                om = p / (1.0 - p + eps)
                c = om * om * d2
            elif POLICY == 4:  # obcache-value
                c = p * p * vv[None, :]
            elif POLICY == 5:  # obcache-key
                c = p * p * z * z * d2
            else:  # obcache-joint, expanded form of DESIGN.md §4.4
                zp1 = 1.0 + z
                j2 = zp1 * zp1 * vv[None, :] - 2.0 * z * zp1 * av + z * z * aa[:, None]
                if TRACK_PEAK:  # ||(1+z)v - z a||^2 = ||v||^2 - 2z<v, a - v> + z^2 ||a - v||^2
                    j2_peak = vv[None, :] - 2.0 * z * peak_vd[:, None] + z * z * peak_d2[:, None]
                    j2 = tl.where(offs_n[None, :] == peak[:, None], j2_peak, j2)
                c = p * p * tl.maximum(j2, 0.0)
            c = tl.where(vis, c, 0.0)

            if GQA_MAX:
                best = tl.zeros([SUB_N], tl.float32)  # every raw^h >= 0; padded heads are 0
                for h in tl.static_range(G_P):
                    s_h = tl.sum(tl.where((hg == h)[:, None], c, 0.0), axis=0)
                    best = tl.maximum(best, s_h)
                raw = best
            else:
                raw = tl.sum(c, axis=0) * inv_g
            if POLICY == 0:
                raw = raw * inv_w
            if HAS_LENGTHS:  # the padding of a ragged held set is no token: -inf, as in the reference
                raw = tl.where(held, raw, float("-inf"))
            tl.store(o_base + offs_n, raw, mask=n_mask)


def interpreting() -> bool:
    """Whether kernels run in Triton's interpreter (TRITON_INTERPRET=1), which takes CPU tensors."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


@functools.lru_cache(maxsize=None)
def _sm_count_cached(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":  # Triton interpreter (TRITON_INTERPRET=1) on CPU tensors
        return 132
    return _sm_count_cached(device.index if device.index is not None else torch.cuda.current_device())


# launch parameters that had to be reduced (out of shared memory), per kernel variant
_FALLBACK: dict = {}


def _launch_with_fallback(key, launch, params: dict, tile_key: str, stage_key: str):
    """Call launch(params); on OutOfResources retry with 1 stage, then halved tiles (>= 16)."""
    params = dict(_FALLBACK.get(key, params))
    while True:
        try:
            return launch(params)
        except triton.runtime.errors.OutOfResources:
            if params[stage_key] > 1:
                params[stage_key] = 1
            elif params[tile_key] > 16:
                params[tile_key] //= 2
            else:
                raise
            _FALLBACK[key] = dict(params)


def _check_inputs(policy, q, k, v, gqa, lengths):
    if policy not in POLICIES:
        raise ValueError(f"unknown window policy {policy!r}; expected one of {sorted(POLICIES)}")
    if gqa not in ("mean", "max"):
        raise ValueError(f"gqa must be 'mean' or 'max', got {gqa!r}")
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError("expected q [B, w, H_q, D], k/v [B, n, H_kv, D]")
    if k.shape != v.shape:
        raise ValueError(f"keys {tuple(k.shape)} and values {tuple(v.shape)} differ")
    if q.shape[0] != k.shape[0] or q.shape[3] != k.shape[3]:
        raise ValueError(f"q {tuple(q.shape)} does not match keys {tuple(k.shape)}")
    if q.shape[2] % k.shape[2] != 0:
        raise ValueError(f"H_q={q.shape[2]} is not a multiple of H_kv={k.shape[2]}")
    if not (q.dtype == k.dtype == v.dtype) or q.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"q/k/v must share one dtype in (bf16, fp16, fp32), got {q.dtype}, {k.dtype}, {v.dtype}")
    if q.shape[1] < 1 or q.shape[1] > k.shape[1]:
        raise ValueError(f"window w={q.shape[1]} must be in [1, n={k.shape[1]}]")
    if lengths is not None:
        if tuple(lengths.shape) != (k.shape[0], k.shape[2]) or lengths.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"lengths must be int32/int64 [B, H_kv] = {(k.shape[0], k.shape[2])}, "
                             f"got {lengths.dtype} {tuple(lengths.shape)}")
        if lengths.device != k.device:
            raise ValueError(f"lengths on {lengths.device} but keys on {k.device}")


# Kernel A keeps its [M_P, D_P] fp32 accumulator and kernel B q and a in registers: past M_P * D_P = 128 * 128
# they spill to local memory, which the driver reserves for every thread the GPU can hold (at 8 query heads
# of 256 per KV head and w = 32, kernel A's 22 KB a thread would take 6 GB of an H100).
MAX_ROWS_X_HEAD_DIM = 128 * 128


def query_head_chunks(g: int, w: int, D: int) -> list[int]:
    """The sizes of the chunks the g query heads of a KV head are scored in: as few as possible, as even as
    possible, each of whose window rows times the head dim fit MAX_ROWS_X_HEAD_DIM ([g] when the group
    fits; one head a chunk when not even one head fits, then the kernels spill)."""
    D_P = max(16, _next_pow2(D))
    size = 1
    while size < g:  # the largest power of two of heads a chunk can take
        G_P = 2 * size
        W_P = max(_next_pow2(w), 16 // G_P) if G_P < 16 else _next_pow2(w)
        if G_P * W_P * D_P > MAX_ROWS_X_HEAD_DIM:
            break
        size = G_P
    if size >= g:
        return [g]
    count = -(-g // size)
    return [g // count + (i < g % count) for i in range(count)]


def _plan(policy, q_window, keys, values, scale, gqa, config, lengths):
    """Validate and compute the launch plan (shared by the stages)."""
    if not _HAS_TRITON:
        raise RuntimeError("window_scores needs Triton; use vllm_evict.policies.reference_raw_window_scores on CPU")
    _check_inputs(policy, q_window, keys, values, gqa, lengths)
    if not keys.is_cuda and not interpreting():
        raise ValueError("window_scores needs CUDA tensors (or TRITON_INTERPRET=1 for debugging)")
    cfg = config or _DEFAULT_CONFIG
    if cfg.precision not in ("auto", "ieee", "bf16x3"):
        raise ValueError(f"precision must be 'auto', 'ieee' or 'bf16x3', got {cfg.precision!r}")
    for x in (q_window, keys, values):
        if x.stride(-1) != 1:
            raise ValueError("the head dimension must have unit stride")
    B, w, H_q, D = q_window.shape
    n, H_kv = keys.shape[1], keys.shape[2]
    g = H_q // H_kv
    pol_id, need_a, need_v = POLICIES[policy]
    G_P = _next_pow2(g)
    W_P = max(_next_pow2(w), 16 // G_P) if G_P < 16 else _next_pow2(w)
    M_P, D_P = G_P * W_P, max(16, _next_pow2(D))
    precision = cfg.precision
    if precision == "auto":
        # fp16's narrow exponent cannot hold a three-way split of small values exactly; and kernel B keeps
        # q and the three parts of a in shared memory, which exceeds an H100's 227 KB past M_P * D_P = 128 * 128
        precision = "bf16x3" if keys.dtype == torch.bfloat16 and M_P * D_P <= MAX_ROWS_X_HEAD_DIM else "ieee"
    prec = 0 if (precision == "ieee" or keys.dtype == torch.float32) else 1
    P = dict(
        cfg=cfg, precision=precision, prec=prec, is_f32=keys.dtype == torch.float32,
        B=B, w=w, H_q=H_q, D=D, n=n, H_kv=H_kv, g=g, BH=B * H_kv,
        scale=1.0 / math.sqrt(D) if scale is None else float(scale),
        pol_id=pol_id, need_a=need_a, need_v=need_v, gqa_max=(gqa == "max"),
        G_P=G_P, W_P=W_P, M_P=M_P, D_P=D_P,
        lp=_resolve(cfg, precision, need_a), sms=_sm_count(keys.device),
        # one held count per (batch, KV head), read by program bh; a placeholder pointer without lengths
        has_lengths=lengths is not None,
        lengths=torch.empty(1, dtype=torch.int64, device=keys.device) if lengths is None else lengths.contiguous(),
    )
    # bf16x3 accumulates on the tensor cores, which loses more than the IEEE dot where the a.v forms cancel
    P["track_peak"] = prec == 1 and need_a
    P["variant"] = (pol_id, gqa == "max", prec, str(keys.dtype), P["M_P"], P["D_P"], keys.device.type,
                    P["has_lengths"])
    return P


# Most key splits of kernel A. The merge kernel's width is this constant, never a function of n or of
# B*H_kv (the engine folds a group of layers into B*H_kv, and the group size varies with the prompt
# length): one merge variant per head shape. 64 splits keep >= 2 programs per SM down to B*H_kv = 5.
MAX_SPLITS = 64


def _splits_for(P, block_n_a):
    cfg, BH = P["cfg"], P["BH"]
    n_tiles = triton.cdiv(P["n"], block_n_a)
    if cfg.num_splits is not None:
        splits = max(1, min(int(cfg.num_splits), n_tiles, MAX_SPLITS))
    else:
        target = 2 * P["sms"]
        splits = 1 if BH >= target else min(n_tiles, triton.cdiv(target, BH), MAX_SPLITS)
        # keep >= 4 tiles per split so that the merge stays small next to the pass
        splits = max(1, min(splits, n_tiles // 4))
    tiles_per_split = triton.cdiv(n_tiles, splits)
    return triton.cdiv(n_tiles, tiles_per_split), tiles_per_split


def _num_sub_for(P, sub_n):
    """Kernel B: sub-tiles per program (power of two), keeping >= ~4 programs per SM."""
    cfg = P["cfg"]
    if cfg.num_sub_b is not None:
        num_sub = max(1, int(cfg.num_sub_b))
    else:
        max_sub = cfg.max_sub_b if cfg.max_sub_b is not None else max(1, 512 // sub_n)
        num_sub = max(1, min(max_sub, (triton.cdiv(P["n"], sub_n) * P["BH"]) // (4 * P["sms"])))
    return 1 << (num_sub.bit_length() - 1)


def _forward(plan, q_window, keys, values):
    """Kernels A + C: returns (a [BH, M_P, D_P] fp32 or a dummy, LSE [BH, M_P] fp32, and peak [BH, M_P]
    int32, peak_d2 and peak_vd [BH, M_P] fp32 or dummies). A always writes split partials (one split at
    large B*H_kv) and C merges them: no n-dependent kernel variant. With track_peak, C also writes each
    row's largest-logit key j and, exactly, ||a - v_j||^2 and <v_j, a - v_j>."""
    P, dev = plan, keys.device
    BH, M_P, D_P, need_a, track = P["BH"], P["M_P"], P["D_P"], P["need_a"], P["track_peak"]
    a_buf = torch.empty((BH, M_P, D_P) if need_a else (1,), device=dev, dtype=torch.float32)
    lse = torch.empty((BH, M_P), device=dev, dtype=torch.float32)
    peak = torch.empty((BH, M_P) if track else (1,), device=dev, dtype=torch.int32)
    peak_d2 = torch.empty((BH, M_P) if track else (1,), device=dev, dtype=torch.float32)
    peak_vd = torch.empty((BH, M_P) if track else (1,), device=dev, dtype=torch.float32)
    v_a = values if need_a else keys  # kernel A does not touch V when a is unused
    lp0 = P["lp"]

    def launch(params):
        splits, tiles_per_split = _splits_for(P, params["block_n_a"])
        m_part = torch.empty((BH, splits, M_P), device=dev, dtype=torch.float32)
        l_part = torch.empty((BH, splits, M_P), device=dev, dtype=torch.float32)
        acc_part = torch.empty((BH, splits, M_P, D_P) if need_a else (1,), device=dev, dtype=torch.float32)
        idx_part = torch.empty((BH, splits, M_P) if track else (1,), device=dev, dtype=torch.int32)
        _window_fwd_kernel[(BH, splits)](
            q_window, keys, v_a, P["lengths"],
            m_part, l_part, acc_part, idx_part,
            P["n"], P["w"], P["g"], P["H_kv"], P["scale"] * 1.4426950408889634,
            tiles_per_split,
            q_window.stride(0), q_window.stride(1), q_window.stride(2),
            keys.stride(0), keys.stride(1), keys.stride(2),
            v_a.stride(0), v_a.stride(1), v_a.stride(2),
            D=P["D"], D_P=D_P, G_P=P["G_P"], W_P=P["W_P"], BLOCK_N=params["block_n_a"],
            NEED_A=need_a, PRECISION=P["prec"], IS_F32=P["is_f32"], TRACK_PEAK=track,
            HAS_LENGTHS=P["has_lengths"],
            num_warps=params["num_warps_a"], num_stages=params["num_stages_a"],
        )
        block_m = min(M_P, 32)
        _splitk_merge_kernel[(BH, M_P // block_m)](
            m_part, l_part, acc_part, idx_part, a_buf, lse,
            v_a, peak, peak_d2, peak_vd,
            splits, P["H_kv"],
            v_a.stride(0), v_a.stride(1), v_a.stride(2),
            D=P["D"], M_P=M_P, D_P=D_P, S_P=MAX_SPLITS, BLOCK_M=block_m,
            NEED_A=need_a, TRACK_PEAK=track, num_warps=4,
        )
        return splits

    params = {k: lp0[k] for k in ("block_n_a", "num_warps_a", "num_stages_a")}
    P["splits"] = _launch_with_fallback(("A",) + P["variant"] + tuple(params.values()), launch, params,
                                        "block_n_a", "num_stages_a")
    return a_buf, lse, peak, peak_d2, peak_vd


def _score(plan, q_window, keys, values, a_buf, lse, peak, peak_d2, peak_vd, out):
    """Kernel B: the per-key-tile scoring pass, writes out [B, H_kv, n] fp32."""
    P = plan
    v_b = values if P["need_v"] else keys
    lp0 = P["lp"]

    def launch(params):
        num_sub = _num_sub_for(P, params["sub_n_b"])
        block_n = params["sub_n_b"] * num_sub
        _window_score_kernel[(P["BH"], triton.cdiv(P["n"], block_n))](
            q_window, keys, v_b, P["lengths"], a_buf, lse, peak, peak_d2, peak_vd, out,
            P["n"], P["w"], P["g"], P["H_kv"], P["scale"], 1.0 / P["w"], 1.0 / P["g"], EPS, num_sub,
            q_window.stride(0), q_window.stride(1), q_window.stride(2),
            keys.stride(0), keys.stride(1), keys.stride(2),
            v_b.stride(0), v_b.stride(1), v_b.stride(2),
            D=P["D"], D_P=P["D_P"], G_P=P["G_P"], W_P=P["W_P"],
            SUB_N=params["sub_n_b"],
            POLICY=P["pol_id"], NEED_A=P["need_a"], NEED_V=P["need_v"], GQA_MAX=P["gqa_max"],
            PRECISION=P["prec"], IS_F32=P["is_f32"], TRACK_PEAK=P["track_peak"],
            NUM_STAGES=params["num_stages_b"], HAS_LENGTHS=P["has_lengths"],
            num_warps=params["num_warps_b"],
        )
        return num_sub

    params = {k: lp0[k] for k in ("sub_n_b", "num_warps_b", "num_stages_b")}
    P["num_sub"] = _launch_with_fallback(("B",) + P["variant"] + tuple(params.values()), launch, params,
                                         "sub_n_b", "num_stages_b")
    return out


def window_scores_batched(
    policy: str,
    q_window: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    *,
    scale: float | None = None,
    gqa: str = "mean",
    config: WindowScoreConfig | None = None,
    out: torch.Tensor | None = None,
    lengths: torch.Tensor | None = None,
) -> torch.Tensor:
    """Batched raw window scores.

    q_window [B, w, H_q, D], keys/values [B, n, H_kv, D] (bf16/fp16/fp32, CUDA, unit stride on D)
    -> float32 [B, H_kv, n]: GQA-aggregated raw scores before pooling/protection.
    ``out`` (optional) is a preallocated float32 [B, H_kv, n] contiguous tensor to write into.
    ``lengths`` (optional): held counts [B, H_kv] of ragged held sets (module docstring).
    """
    plan = _plan(policy, q_window, keys, values, scale, gqa, config, lengths)
    B, H_kv, n = plan["B"], plan["H_kv"], plan["n"]
    if out is None:
        out = torch.empty((B, H_kv, n), device=keys.device, dtype=torch.float32)
    elif tuple(out.shape) != (B, H_kv, n) or out.dtype != torch.float32 or not out.is_contiguous():
        raise ValueError("out must be a contiguous float32 [B, H_kv, n] tensor")
    chunks = query_head_chunks(plan["g"], plan["w"], plan["D"]) if plan["H_q"] == plan["g"] * H_kv else [1]
    if len(chunks) == 1:
        return _score(plan, q_window, keys, values, *_forward(plan, q_window, keys, values), out)
    # each chunk of a KV head's query heads is a GQA group of its own; a head's raw score is the mean (or max)
    # over the group's heads, so the chunks' scores combine by their mean weighted by size (or max)
    g = plan["g"]
    grouped = q_window.reshape(B, plan["w"], H_kv, g, plan["D"])
    part = torch.empty_like(out)
    start = 0
    for size in chunks:
        q_chunk = grouped[:, :, :, start:start + size].reshape(B, plan["w"], H_kv * size, plan["D"])
        scores = out if start == 0 else part
        window_scores_batched(policy, q_chunk, keys, values, scale=plan["scale"], gqa=gqa, config=config,
                              out=scores, lengths=lengths)
        if gqa == "max":
            if start:
                torch.maximum(out, part, out=out)
        elif start:
            out.add_(part, alpha=size / g)
        else:
            out.mul_(size / g)
        start += size
    return out


def window_scores(
    policy: str,
    q_window: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    *,
    scale: float | None = None,
    gqa: str = "mean",
    config: WindowScoreConfig | None = None,
    lengths: torch.Tensor | None = None,
) -> torch.Tensor:
    """Raw window scores of one request (DESIGN.md §2.3 steps 1-2, §4, §5).

    q_window [w, H_q, D], keys/values [n, H_kv, D] (bf16/fp16/fp32, CUDA)
    -> float32 [H_kv, n] = GQA-aggregated raw_j before pooling and protection.
    ``lengths`` (optional): held counts [H_kv] of ragged held sets (module docstring).
    """
    if q_window.dim() != 3 or keys.dim() != 3 or values.dim() != 3:
        raise ValueError("expected q_window [w, H_q, D] and keys/values [n, H_kv, D]")
    return window_scores_batched(
        policy, q_window.unsqueeze(0), keys.unsqueeze(0), values.unsqueeze(0),
        scale=scale, gqa=gqa, config=config, lengths=None if lengths is None else lengths.unsqueeze(0),
    )[0]
