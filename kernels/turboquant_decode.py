"""Decode attention over vLLM's TurboQuant slots, one program per (request, KV head, KV split).

vLLM 0.26's TurboQuant decode (`triton_turboquant_decode_attention`) runs a program per (request, query head,
split) with one warp and tiles of 4 tokens: under GQA every slot is fetched and decoded once per query head
of its group (4 times for Llama-3.1-8B), and both products run on the CUDA cores. Here a program decodes each
slot of its KV head once, in tiles of BLOCK_N tokens, and both products run on the tensor cores for the
whole group (padded to 16 query heads): scores = q·keys over the decoded keys, then the values' codes times
the softmax weights, the value scale folded into the weights and its zero point into one sum per query head
(value = code x scale + zero). A head's coordinates are split into even and odd ones, so that one byte of
4-bit codes gives one coordinate of each half without unpacking; the query and output are split to match.
The products take float32 operands in TF32 three times over (`tf32x3`: float32 accuracy). The kernel writes
vLLM's split-KV partials, which vLLM's own stage-2 kernel reduces (engine/turboquant_backend.decode_attention).

decode_partials(query, kv_cache, block_table, seq_lens, config, centroids, rotation_t, scale, fp8_e4b15, partials)
    query [B, Hq, D] (the model dtype); kv_cache [num_blocks, N, Hk, S] uint8 (any strides: the engine's is
    head-major); block_table [B, max_blocks] int32; seq_lens [B] int32; config: vLLM's TurboQuantConfig of the
    preset (D even); centroids [2^bits] float32; rotation_t [D, D] float32 (the Hadamard matrix transposed:
    queries rotate into the keys' basis, as vLLM's do); scale: the softmax scale; partials [B, Hq, splits,
    D + 1] float32, written where a split holds tokens (vLLM's bounds: splits of cdiv(seq_len, splits)
    tokens): the split's attention output and, at D, its log-sum-exp of scaled scores.

The slot format and its decoding are kernels/turboquant_slots.py's. decode_attention_reference below is the
whole attention (partials reduced) in torch ops over dequantize_slots_reference;
tests/kernels/test_turboquant_decode.py checks the engine's decode against it and against vLLM's own decode
(Triton interpreter and GPU).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from vllm_evict.kernels.turboquant_slots import _codes, _fp8, _fp16, dequantize_slots_reference, slot_layout

BLOCK_N = 32       # tokens a tile (at least 16: a tensor-core operand)
NUM_WARPS = 4
PRECISION = "tf32x3"


@triton.jit
def _code_pairs(kv, row, j, mask, AT: tl.constexpr, BITS: tl.constexpr):
    """Codes (int32) of coordinates 2j and 2j + 1 of the BITS-bit stream from byte AT of the slots at `row`
    (BITS = 8: the bytes themselves)."""
    if BITS == 4:  # one byte: coordinate 2j in the low nibble
        byte = tl.load(kv + row + AT + j, mask=mask, other=0).to(tl.int32)
        even = byte & 15
        odd = byte >> 4
    elif BITS == 8:
        even = tl.load(kv + row + AT + 2 * j, mask=mask, other=0).to(tl.int32)
        odd = tl.load(kv + row + AT + 2 * j + 1, mask=mask, other=0).to(tl.int32)
    else:
        even = _codes(kv, kv, row, 2 * j, AT, BITS, 0, mask)
        odd = _codes(kv, kv, row, 2 * j + 1, AT, BITS, 0, mask)
    return even, odd


@triton.jit
def _decode_partials_kernel(query, kv, block_table, seq_lens, centroids, partials,
                            stride_qb, stride_qh, stride_block, stride_pos, stride_head, stride_table,
                            stride_pb, stride_ph, stride_ps,
                            GROUP: tl.constexpr, GROUP_P: tl.constexpr, HALF: tl.constexpr, HALF_P: tl.constexpr,
                            PAGE: tl.constexpr, SPLITS: tl.constexpr, BLOCK: tl.constexpr, SCALE: tl.constexpr,
                            PRECISION: tl.constexpr, KEY_FP8: tl.constexpr, FP8_E4B15: tl.constexpr,
                            KEY_BITS: tl.constexpr, NORM_AT: tl.constexpr, NORM_CORRECTION: tl.constexpr,
                            VALUE_AT: tl.constexpr, VALUE_BITS: tl.constexpr, SCALE_AT: tl.constexpr):
    b = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens + b)
    split_len = tl.cdiv(seq_len, SPLITS)  # vLLM's split bounds: its stage 2 reads the non-empty splits
    lo = split_len * split
    hi = tl.minimum(lo + split_len, seq_len)
    if lo < hi:
        group = tl.arange(0, GROUP_P)
        heads = kv_head * GROUP + group
        head_ok = group < GROUP
        j = tl.arange(0, HALF_P)  # coordinate pair: coordinates 2j (even) and 2j + 1 (odd)
        q_mask = head_ok[:, None] & (j < HALF)[None, :]
        q_at = query + b * stride_qb + heads[:, None] * stride_qh + 2 * j[None, :]
        q_even = tl.load(q_at, mask=q_mask, other=0.0).to(tl.float32)                       # [GROUP_P, HALF_P]
        q_odd = tl.load(q_at + 1, mask=q_mask, other=0.0).to(tl.float32)
        m = tl.full([GROUP_P], float("-inf"), tl.float32)
        l = tl.zeros([GROUP_P], tl.float32)
        acc_even = tl.zeros([GROUP_P, HALF_P], tl.float32)
        acc_odd = tl.zeros([GROUP_P, HALF_P], tl.float32)
        head_at = kv_head.to(tl.int64) * stride_head
        for first in range(lo, hi, BLOCK):
            tokens = first + tl.arange(0, BLOCK)
            ok = tokens < hi
            blocks = tl.load(block_table + b * stride_table + tokens // PAGE, mask=ok, other=0).to(tl.int64)
            start = blocks * stride_block + (tokens % PAGE).to(tl.int64) * stride_pos + head_at  # [BLOCK] bytes
            mask = ok[:, None] & (j < HALF)[None, :]
            k_even, k_odd = _code_pairs(kv, start[:, None], j[None, :], mask, 0, KEY_BITS)  # [BLOCK, HALF_P]
            if KEY_FP8:
                k_even = _fp8(k_even, FP8_E4B15)
                k_odd = _fp8(k_odd, FP8_E4B15)
                factor = tl.full([BLOCK], SCALE, tl.float32)
            else:  # unit codes; each key's norm (and its renormalisation) scales its scores
                k_even = tl.load(centroids + k_even, mask=mask, other=0.0)
                k_odd = tl.load(centroids + k_odd, mask=mask, other=0.0)
                factor = _fp16(kv, kv, start, NORM_AT, 0, ok) * SCALE
                if NORM_CORRECTION:
                    factor = factor * tl.rsqrt(tl.sum(k_even * k_even + k_odd * k_odd, axis=1) + 1e-16)
            scores = tl.dot(q_even, tl.trans(k_even), input_precision=PRECISION)
            scores = tl.dot(q_odd, tl.trans(k_odd), scores, input_precision=PRECISION)           # [GROUP_P, BLOCK]
            scores = tl.where(ok[None, :], scores * factor[None, :], float("-inf"))
            m_new = tl.maximum(m, tl.max(scores, axis=1))
            alpha = tl.exp(m - m_new)
            p = tl.exp(scores - m_new[:, None])
            v_even, v_odd = _code_pairs(kv, start[:, None], j[None, :], mask, VALUE_AT, VALUE_BITS)
            weights = p * _fp16(kv, kv, start, SCALE_AT, 0, ok)[None, :]
            zero = tl.sum(p * _fp16(kv, kv, start, SCALE_AT + 2, 0, ok)[None, :], axis=1)
            acc_even = tl.dot(weights, v_even.to(tl.float32), acc_even * alpha[:, None], input_precision=PRECISION)
            acc_odd = tl.dot(weights, v_odd.to(tl.float32), acc_odd * alpha[:, None], input_precision=PRECISION)
            acc_even += zero[:, None]
            acc_odd += zero[:, None]
            l = l * alpha + tl.sum(p, axis=1)
            m = m_new
        out = partials + b * stride_pb + heads * stride_ph + split * stride_ps                  # [GROUP_P]
        out_at = out[:, None] + 2 * j[None, :]
        tl.store(out_at, acc_even / l[:, None], mask=q_mask)
        tl.store(out_at + 1, acc_odd / l[:, None], mask=q_mask)
        tl.store(out + 2 * HALF, m + tl.log(l), mask=head_ok)


def decode_partials(query: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor,
                    config, centroids: torch.Tensor, rotation_t: torch.Tensor, scale: float, fp8_e4b15: bool,
                    partials: torch.Tensor, block_n: int = BLOCK_N, num_warps: int = NUM_WARPS,
                    precision: str = PRECISION) -> torch.Tensor:
    """partials [B, Hq, splits, D + 1] of query [B, Hq, D] over the TurboQuant cache (module docstring);
    block_n tokens a tile, num_warps a program and the products' precision (benchmarks/turboquant_decode.py
    compares launches)."""
    B, Hq, D = query.shape
    _, page, Hk, _ = kv_cache.shape
    if Hq % Hk or D % 2 or partials.shape[:2] != (B, Hq) or partials.shape[3] != D + 1:
        raise ValueError(f"query {tuple(query.shape)} over {Hk} KV heads with partials {tuple(partials.shape)}")
    # MSE keys are stored in the rotated basis: rotate the queries there (fp8 keys are stored as they are)
    q = query.contiguous() if config.key_fp8 else (query.float() @ rotation_t).contiguous()
    group, splits = Hq // Hk, partials.shape[2]
    _decode_partials_kernel[(B, Hk, splits)](
        q, kv_cache, block_table, seq_lens, centroids, partials, q.stride(0), q.stride(1), kv_cache.stride(0),
        kv_cache.stride(1), kv_cache.stride(2), block_table.stride(0), partials.stride(0), partials.stride(1),
        partials.stride(2), GROUP=group, GROUP_P=max(16, triton.next_power_of_2(group)), HALF=D // 2,
        HALF_P=max(16, triton.next_power_of_2(D // 2)), PAGE=page, SPLITS=splits, BLOCK=block_n, SCALE=scale,
        PRECISION=precision, FP8_E4B15=bool(fp8_e4b15), **slot_layout(config), num_warps=num_warps)
    return partials


def decode_attention_reference(query: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
                               seq_lens: torch.Tensor, config, centroids: torch.Tensor, rotation: torch.Tensor,
                               scale: float, fp8_e4b15: bool = False) -> torch.Tensor:
    """Attention [B, Hq, D] (float32) of query over the cache in torch ops: decode_partials' partials reduced,
    without splits. Each request's slots decoded (keys in the model's basis), softmax attention per query head
    over its KV head (GQA: query head h reads KV head h // (Hq / Hk))."""
    B, Hq, D = query.shape
    page, Hk = kv_cache.shape[1], kv_cache.shape[2]
    out = torch.empty(B, Hq, D, dtype=torch.float32, device=query.device)
    for b in range(B):
        n = int(seq_lens[b])
        tokens = torch.arange(n, device=kv_cache.device)
        slots = kv_cache[block_table[b, tokens // page].long(), tokens % page]                # [n, Hk, S]
        keys, values = dequantize_slots_reference(slots, config, centroids, rotation, fp8_e4b15)
        keys, values = (x.repeat_interleave(Hq // Hk, dim=1) for x in (keys, values))       # [n, Hq, D]
        weights = torch.softmax(torch.einsum("hd,nhd->hn", query[b].float(), keys) * scale, dim=-1)
        out[b] = torch.einsum("hn,nhd->hd", weights, values)
    return out
