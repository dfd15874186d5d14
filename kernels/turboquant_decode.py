"""Decode attention over vLLM's 4-bit TurboQuant slots (`turboquant_4bit_nc`), a program per (request, KV head,
KV split), both products on the tensor cores.

vLLM 0.26's TurboQuant decode (`triton_turboquant_decode_attention`) runs a program per (request, query head,
split) of one warp over tiles of 4 tokens, decoding each code from two byte loads: under GQA every slot is
decoded once per query head of its group, and its instruction count, not its bytes, bounds it (on an H100 it
reads the cache at about 0.2 TB/s; docs/BENCHMARKS.md, "TurboQuant KV caches"). Here a program decodes each slot
of its KV head once, for all the group's query heads:
- a slot is read as 16-bit words (slots are 2-byte aligned): word w of the key codes holds coordinates 4w..4w+3
  in its four nibbles, so the codes come as four planes [tokens, D/4], plane k holding coordinates 4w + k;
- scores: each plane's centroids [tokens, D/4] against the matching plane of the rotated queries [group, D/4],
  fp16 operands split into a high and a low half (three products: about 1e-4 of vLLM's float32 output), then the
  key's norm, vLLM's norm correction (the centroid vector renormalised) and the softmax scale per token;
- values: the online softmax's weights times each token's value scale, split the same way, against each plane's
  value codes (0..15, exact in fp16); the zero points add the weights' sum times each token's zero.
The partials are vLLM's split-KV partials, which vLLM's own stage-2 kernel reduces
(engine/turboquant_backend.decode_attention), with vLLM's split bounds.

decode_partials(query, kv_cache, block_table, seq_lens, config, centroids, rotation_t, scale, partials)
    query [B, Hq, D] (the model dtype); kv_cache [num_blocks, N, Hk, S] uint8, any strides that are even (the
    engine's is head-major); block_table [B, max_blocks] int32; seq_lens [B] int32; config: vLLM's
    TurboQuantConfig, 4-bit keys and values (`supports`); centroids [16] float32; rotation_t [D, D] float32 (the
    Hadamard matrix transposed: queries rotate into the keys' basis, as vLLM's do); scale: the softmax scale;
    partials [B, Hq, splits, D + 1] float32, written where a split holds tokens (splits of cdiv(seq_len,
    splits) tokens): the split's attention output and, at D, its log-sum-exp of scaled scores.

decode_attention_reference below is the whole attention in torch ops over dequantize_slots_reference;
tests/kernels/test_turboquant_decode.py checks the engine's decode against it and against vLLM's own decode
(Triton interpreter and GPU); benchmarks/turboquant_decode.py times it against vLLM's.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from vllm_evict.kernels.turboquant_slots import dequantize_slots_reference

# the fastest launch on an H100 (kernels/NOTES.md), with one stage: Triton's software pipelining of the tile loop
# made it 3-4x slower
BLOCK_N = 16   # tokens a tile
NUM_WARPS = 1


def supports(config) -> bool:
    """Whether decode_partials reads this preset: 4-bit key codes and 4-bit values, D a multiple of 64."""
    return (not config.key_fp8 and config.key_mse_bits == 4 and config.value_quant_bits == 4
            and config.head_dim % 64 == 0)


@triton.jit
def _query_plane(rows, w, K: tl.constexpr, head_ok):
    """Coordinates 4w + K of the query rows, as fp16 high and low halves [GROUP_P, W]."""
    q = tl.load(rows[:, None] + 4 * w[None, :] + K, mask=head_ok[:, None], other=0.0)
    high = q.to(tl.float16)
    return high, (q - high.to(tl.float32)).to(tl.float16)


@triton.jit
def _plane_scores(words, K: tl.constexpr, centroids, mask, q_high, q_low, scores):
    """scores [GROUP_P, BLOCK] plus the product with plane K's centroids; and their squares' sum [BLOCK]."""
    c = tl.load(centroids + ((words >> (4 * K)) & 15), mask=mask, other=0.0)          # [BLOCK, W] float32
    c_high = c.to(tl.float16)
    c_low = (c - c_high.to(tl.float32)).to(tl.float16)
    scores = tl.dot(q_high, tl.trans(c_high), scores)
    scores = tl.dot(q_low, tl.trans(c_high), scores)
    scores = tl.dot(q_high, tl.trans(c_low), scores)
    return scores, tl.sum(c * c, axis=1)


@triton.jit
def _plane_values(words, K: tl.constexpr, w_high, w_low, acc, alpha):
    """acc [GROUP_P, W] rescaled by alpha plus the weights [GROUP_P, BLOCK] times plane K's value codes."""
    codes = ((words >> (4 * K)) & 15).to(tl.float16)                                     # [BLOCK, W]
    acc = tl.dot(w_high, codes, acc * alpha[:, None])
    return tl.dot(w_low, codes, acc)


@triton.jit
def _store_plane(out, w, K: tl.constexpr, acc, zero, l, head_ok):
    tl.store(out[:, None] + 4 * w[None, :] + K, (acc + zero[:, None]) / l[:, None], mask=head_ok[:, None])


@triton.jit
def _decode_partials_kernel(query, kv, block_table, seq_lens, centroids, partials,
                            stride_qb, stride_qh, stride_block, stride_pos, stride_head, stride_table,
                            stride_pb, stride_ph, stride_ps,
                            GROUP: tl.constexpr, GROUP_P: tl.constexpr, W: tl.constexpr, NORM_AT: tl.constexpr,
                            VALUE_AT: tl.constexpr, SCALE_AT: tl.constexpr, PAGE: tl.constexpr,
                            SPLITS: tl.constexpr, BLOCK: tl.constexpr, SCALE: tl.constexpr,
                            NORM_CORRECTION: tl.constexpr):
    """kv: the cache as int16 words (strides in words); NORM_AT, VALUE_AT, SCALE_AT: word offsets in a slot."""
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
        w = tl.arange(0, W)
        rows = query + b * stride_qb + heads * stride_qh
        q0h, q0l = _query_plane(rows, w, 0, head_ok)
        q1h, q1l = _query_plane(rows, w, 1, head_ok)
        q2h, q2l = _query_plane(rows, w, 2, head_ok)
        q3h, q3l = _query_plane(rows, w, 3, head_ok)
        m = tl.full([GROUP_P], float("-inf"), tl.float32)
        l = tl.zeros([GROUP_P], tl.float32)
        zero = tl.zeros([GROUP_P], tl.float32)
        acc0 = tl.zeros([GROUP_P, W], tl.float32)
        acc1 = tl.zeros([GROUP_P, W], tl.float32)
        acc2 = tl.zeros([GROUP_P, W], tl.float32)
        acc3 = tl.zeros([GROUP_P, W], tl.float32)
        head_at = kv_head.to(tl.int64) * stride_head
        for first in range(lo, hi, BLOCK):
            tokens = first + tl.arange(0, BLOCK)
            ok = tokens < hi
            blocks = tl.load(block_table + b * stride_table + tokens // PAGE, mask=ok, other=0).to(tl.int64)
            slot = blocks * stride_block + (tokens % PAGE).to(tl.int64) * stride_pos + head_at        # [BLOCK]
            mask = ok[:, None]
            words = tl.load(kv + slot[:, None] + w[None, :], mask=mask, other=0).to(tl.int32) & 0xFFFF
            scores = tl.zeros([GROUP_P, BLOCK], tl.float32)
            scores, n0 = _plane_scores(words, 0, centroids, mask, q0h, q0l, scores)
            scores, n1 = _plane_scores(words, 1, centroids, mask, q1h, q1l, scores)
            scores, n2 = _plane_scores(words, 2, centroids, mask, q2h, q2l, scores)
            scores, n3 = _plane_scores(words, 3, centroids, mask, q3h, q3l, scores)
            factor = tl.load(kv + slot + NORM_AT, mask=ok, other=0).to(tl.float16, bitcast=True).to(tl.float32)
            factor = factor * SCALE
            if NORM_CORRECTION:
                factor = factor / tl.sqrt(n0 + n1 + n2 + n3 + 1e-16)
            scores = tl.where(ok[None, :], scores * factor[None, :], float("-inf"))
            m_new = tl.maximum(m, tl.max(scores, axis=1))
            alpha = tl.exp(m - m_new)
            p = tl.exp(scores - m_new[:, None])
            value_scale = tl.load(kv + slot + SCALE_AT, mask=ok, other=0).to(tl.float16, bitcast=True)
            value_zero = tl.load(kv + slot + SCALE_AT + 1, mask=ok, other=0).to(tl.float16, bitcast=True)
            weights = p * value_scale.to(tl.float32)[None, :]
            w_high = weights.to(tl.float16)
            w_low = (weights - w_high.to(tl.float32)).to(tl.float16)
            words = tl.load(kv + slot[:, None] + VALUE_AT + w[None, :], mask=mask, other=0).to(tl.int32) & 0xFFFF
            acc0 = _plane_values(words, 0, w_high, w_low, acc0, alpha)
            acc1 = _plane_values(words, 1, w_high, w_low, acc1, alpha)
            acc2 = _plane_values(words, 2, w_high, w_low, acc2, alpha)
            acc3 = _plane_values(words, 3, w_high, w_low, acc3, alpha)
            zero = zero * alpha + tl.sum(p * value_zero.to(tl.float32)[None, :], axis=1)
            l = l * alpha + tl.sum(p, axis=1)
            m = m_new
        out = partials + b * stride_pb + heads * stride_ph + split * stride_ps                  # [GROUP_P]
        _store_plane(out, w, 0, acc0, zero, l, head_ok)
        _store_plane(out, w, 1, acc1, zero, l, head_ok)
        _store_plane(out, w, 2, acc2, zero, l, head_ok)
        _store_plane(out, w, 3, acc3, zero, l, head_ok)
        tl.store(out + 4 * W, m + tl.log(l), mask=head_ok)


def decode_partials(query: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor,
                    config, centroids: torch.Tensor, rotation_t: torch.Tensor, scale: float,
                    partials: torch.Tensor, block_n: int = BLOCK_N, num_warps: int = NUM_WARPS) -> torch.Tensor:
    """partials [B, Hq, splits, D + 1] of query [B, Hq, D] over the TurboQuant cache (module docstring); block_n
    tokens a tile and num_warps a program (benchmarks/turboquant_decode.py compares launches)."""
    B, Hq, D = query.shape
    _, page, Hk, S = kv_cache.shape
    if not supports(config) or D != config.head_dim:
        raise ValueError(f"decode_partials reads 4-bit keys and values of a head size that is a multiple of 64, "
                         f"got {config} for queries of head size {D}")
    if Hq % Hk or partials.shape[:2] != (B, Hq) or partials.shape[3] != D + 1:
        raise ValueError(f"query {tuple(query.shape)} over {Hk} KV heads with partials {tuple(partials.shape)}")
    words = kv_cache.view(torch.int16)   # slots are an even number of bytes: 16-bit words
    q = (query.float() @ rotation_t).contiguous()  # keys are stored in the rotated basis: rotate the queries there
    group, splits = Hq // Hk, partials.shape[2]
    key_words = config.key_packed_size // 2
    _decode_partials_kernel[(B, Hk, splits)](
        q, words, block_table, seq_lens, centroids, partials, q.stride(0), q.stride(1), words.stride(0),
        words.stride(1), words.stride(2), block_table.stride(0), partials.stride(0), partials.stride(1),
        partials.stride(2), GROUP=group, GROUP_P=max(16, triton.next_power_of_2(group)), W=D // 4,
        NORM_AT=key_words - 1, VALUE_AT=key_words, SCALE_AT=key_words + (config.value_packed_size - 4) // 2,
        PAGE=page, SPLITS=splits, BLOCK=block_n, SCALE=scale, NORM_CORRECTION=bool(config.norm_correction),
        num_warps=num_warps, num_stages=1)
    return partials


def decode_attention_reference(query: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
                               seq_lens: torch.Tensor, config, centroids: torch.Tensor, rotation: torch.Tensor,
                               scale: float) -> torch.Tensor:
    """Attention [B, Hq, D] (float32) of query over the cache in torch ops, without splits: each request's slots
    decoded (keys in the model's basis), softmax attention per query head over its KV head (GQA: query head h
    reads KV head h // (Hq / Hk))."""
    B, Hq, D = query.shape
    page, Hk = kv_cache.shape[1], kv_cache.shape[2]
    out = torch.empty(B, Hq, D, dtype=torch.float32, device=query.device)
    for b in range(B):
        n = int(seq_lens[b])
        tokens = torch.arange(n, device=kv_cache.device)
        slots = kv_cache[block_table[b, tokens // page].long(), tokens % page]                # [n, Hk, S]
        keys, values = dequantize_slots_reference(slots, config, centroids, rotation)
        keys, values = (x.repeat_interleave(Hq // Hk, dim=1) for x in (keys, values))       # [n, Hq, D]
        weights = torch.softmax(torch.einsum("hd,nhd->hn", query[b].float(), keys) * scale, dim=-1)
        out[b] = torch.einsum("hn,nhd->hd", weights, values)
    return out
