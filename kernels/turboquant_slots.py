"""Keys and values out of vLLM's TurboQuant slots, one launch for a compaction's gathered slots.

A TurboQuant cache (`--kv-cache-dtype turboquant_*`) holds a (token, head)'s key and value in one S-byte slot,
`[key | value | padding to an even size]`:
- key: `turboquant_k8v4` stores it as fp8 (D bytes; e4m3, or Triton's e4b15 below compute capability 8.9); the
  other presets store the Lloyd-Max code (3 or 4 bits) of each coordinate of the unit key after vLLM's fixed
  Hadamard rotation, then the key's norm (fp16). With norm correction the decoded code vector is renormalised
  to unit length; the key is norm x codes, rotated back.
- value: a 3- or 4-bit code per coordinate, then its fp16 scale and zero: value = code x scale + zero.
Codes are a little-endian bit stream (coordinate i at bit i*bits).

dequantize_slots(first, second, config, centroids, rotation, fp8_e4b15, dtype)
    first, second [..., S/2] uint8: the two halves of each slot as compaction gathers them (any layout whose
    storage is dense, e.g. staging's head-major permutation; both the same); config: vLLM's TurboQuantConfig
    of the preset (head_dim D, key_fp8, key_mse_bits, key_packed_size, value_quant_bits, value_packed_size,
    norm_correction); centroids [2^bits] float32; rotation [D, D] float32 (the Hadamard matrix / sqrt(D)).
    -> keys, values [..., D] in `dtype`, as vLLM's TurboQuant attention reads them.

The kernel decodes a tile of slots per program, keys before the rotation in float32, which one matmul then
rotates back. dequantize_slots_reference below is the same in torch ops: tests/kernels/test_turboquant_slots.py
checks the kernel against it (Triton interpreter and GPU), tests/engine/test_turboquant_cache.py the engine's
decoding against vLLM's own dequantization kernel.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from vllm_evict.kernels.window_scores import interpreting

BLOCK_M = 32


@triton.jit
def _byte(first, second, row, b, HALF: tl.constexpr, mask):
    """Byte b of each slot (int32) whose halves start at first + row and second + row."""
    b = b + tl.zeros_like(row)  # a tensor also for a constant b
    in_first = b < HALF
    low = tl.load(first + row + b, mask=mask & in_first, other=0)
    high = tl.load(second + row + (b - HALF), mask=mask & (b >= HALF), other=0)
    return tl.where(in_first, low, high).to(tl.int32)


@triton.jit
def _fp16(first, second, row, b, HALF: tl.constexpr, mask):
    """The little-endian fp16 at byte b of each slot, decoded from its bits (float32)."""
    bits = _byte(first, second, row, b, HALF, mask) | (_byte(first, second, row, b + 1, HALF, mask) << 8)
    exponent = (bits >> 10) & 0x1F
    mantissa = (bits & 0x3FF).to(tl.float32)
    magnitude = tl.where(exponent > 0, (1024.0 + mantissa) * tl.exp2(exponent.to(tl.float32) - 25.0),
                         mantissa * 5.9604644775390625e-08)  # subnormal: mantissa x 2^-24
    return tl.where(bits >= 0x8000, -magnitude, magnitude)


@triton.jit
def _codes(first, second, row, cols, start, BITS: tl.constexpr, HALF: tl.constexpr, mask):
    """The BITS-bit code of coordinate `cols` of the bit stream from byte `start` of each slot."""
    bit = cols * BITS
    byte = start + bit // 8
    pair = _byte(first, second, row, byte, HALF, mask) | (_byte(first, second, row, byte + 1, HALF, mask) << 8)
    return (pair >> (bit % 8)) & ((1 << BITS) - 1)


@triton.jit(do_not_specialize=["M"])
def _dequantize_slots_kernel(first, second, centroids, keys, values, M,
                             HALF: tl.constexpr, D: tl.constexpr, D_P: tl.constexpr, BLOCK: tl.constexpr,
                             KEY_FP8: tl.constexpr, FP8_E4B15: tl.constexpr, KEY_BITS: tl.constexpr,
                             NORM_AT: tl.constexpr, NORM_CORRECTION: tl.constexpr, VALUE_AT: tl.constexpr,
                             VALUE_BITS: tl.constexpr, SCALE_AT: tl.constexpr):
    rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    cols = tl.arange(0, D_P)
    row_ok = rows < M
    mask = row_ok[:, None] & (cols < D)[None, :]
    start = rows.to(tl.int64) * HALF
    row = start[:, None]
    if KEY_FP8:
        bits = _byte(first, second, row, cols[None, :], HALF, mask)
        exponent = ((bits >> 3) & 0xF).to(tl.float32)
        mantissa = (bits & 0x7).to(tl.float32)
        if FP8_E4B15:  # exponent bias 15, no infinities or NaN; subnormal: mantissa x 2^-17
            magnitude = tl.where(exponent > 0, (8.0 + mantissa) * tl.exp2(exponent - 18.0),
                                 mantissa * 7.62939453125e-06)
        else:  # e4m3: bias 7; subnormal: mantissa x 2^-9
            magnitude = tl.where(exponent > 0, (8.0 + mantissa) * tl.exp2(exponent - 10.0), mantissa * 0.001953125)
        key = tl.where(bits >= 128, -magnitude, magnitude)
    else:
        codes = _codes(first, second, row, cols[None, :], 0, KEY_BITS, HALF, mask)
        unit = tl.load(centroids + codes, mask=mask, other=0.0)
        if NORM_CORRECTION:
            unit = unit * tl.rsqrt(tl.sum(unit * unit, axis=1) + 1e-16)[:, None]
        key = _fp16(first, second, start, NORM_AT, HALF, row_ok)[:, None] * unit
    value_codes = _codes(first, second, row, cols[None, :], VALUE_AT, VALUE_BITS, HALF, mask).to(tl.float32)
    scale = _fp16(first, second, start, SCALE_AT, HALF, row_ok)
    zero = _fp16(first, second, start, SCALE_AT + 2, HALF, row_ok)
    value = value_codes * scale[:, None] + zero[:, None]
    out = rows.to(tl.int64)[:, None] * D + cols[None, :]
    tl.store(keys + out, key.to(keys.dtype.element_ty), mask=mask)
    tl.store(values + out, value.to(values.dtype.element_ty), mask=mask)


def _dense_rows(first: torch.Tensor, second: torch.Tensor) -> tuple[list[int], torch.Tensor, torch.Tensor]:
    """The order of first's dims that lays it out as stored, and both halves as [M, S/2] rows in that order
    (copied only where a half is not stored so)."""
    order = sorted(range(first.dim() - 1), key=lambda d: -first.stride(d)) + [first.dim() - 1]
    rows = [half.permute(order).contiguous().view(-1, half.shape[-1]) for half in (first, second)]
    return order, rows[0], rows[1]


def dequantize_slots(first: torch.Tensor, second: torch.Tensor, config, centroids: torch.Tensor,
                     rotation: torch.Tensor, fp8_e4b15: bool, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys, values [..., D] in `dtype` of the TurboQuant slots whose halves are first, second [..., S/2]."""
    if first.shape != second.shape or first.dtype != torch.uint8 or second.dtype != torch.uint8:
        raise ValueError(f"slot halves must be two uint8 tensors of one shape, got {first.dtype} "
                         f"{tuple(first.shape)} and {second.dtype} {tuple(second.shape)}")
    D, half = config.head_dim, first.shape[-1]
    if 2 * half < config.value_packed_size + config.key_packed_size:
        raise ValueError(f"slots of {2 * half} bytes cannot hold a {config.key_packed_size}-byte key and a "
                         f"{config.value_packed_size}-byte value")
    if not first.is_cuda and not interpreting():
        raise ValueError("dequantize_slots needs CUDA tensors (or TRITON_INTERPRET=1)")
    order, first_rows, second_rows = _dense_rows(first, second)
    M = first_rows.shape[0]
    keys = torch.empty(M, D, dtype=dtype if config.key_fp8 else torch.float32, device=first.device)
    values = torch.empty(M, D, dtype=dtype, device=first.device)
    if M:
        key_bits = 8 if config.key_fp8 else config.key_mse_bits
        value_data = config.value_packed_size - 4
        _dequantize_slots_kernel[(triton.cdiv(M, BLOCK_M),)](
            first_rows, second_rows, centroids, keys, values, M, HALF=half, D=D, D_P=triton.next_power_of_2(D),
            BLOCK=BLOCK_M, KEY_FP8=bool(config.key_fp8), FP8_E4B15=bool(fp8_e4b15), KEY_BITS=key_bits,
            NORM_AT=config.key_packed_size - 2, NORM_CORRECTION=bool(config.norm_correction),
            VALUE_AT=config.key_packed_size, VALUE_BITS=config.value_quant_bits,
            SCALE_AT=config.key_packed_size + value_data)
    if not config.key_fp8:  # rotated back, then the model dtype (the float32 copies go before values are used)
        keys = (keys @ rotation).to(dtype)
    shape = [first.shape[d] for d in order[:-1]] + [D]
    inverse = sorted(range(len(order)), key=order.__getitem__)
    return keys.view(shape).permute(inverse), values.view(shape).permute(inverse)


def dequantize_slots_reference(slots: torch.Tensor, config, centroids: torch.Tensor, rotation: torch.Tensor,
                               fp8_e4b15: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Slots [..., S] (uint8) -> keys, values [..., D] (float32), in torch ops."""
    D = config.head_dim
    if config.key_fp8:
        raw = slots[..., :D].contiguous()
        keys = _fp8_e4b15(raw) if fp8_e4b15 else raw.view(torch.float8_e4m3fn).float()
    else:
        mse_bytes = config.key_packed_size - 2
        unit = centroids[_codes_reference(slots, 0, config.key_mse_bits, D)]
        if config.norm_correction:
            unit = unit * torch.rsqrt((unit * unit).sum(dim=-1, keepdim=True) + 1e-16)
        keys = (_fp16_reference(slots, mse_bytes) * unit) @ rotation
    start = config.key_packed_size
    data_bytes = config.value_packed_size - 4
    codes = _codes_reference(slots, start, config.value_quant_bits, D).float()
    values = codes * _fp16_reference(slots, start + data_bytes) + _fp16_reference(slots, start + data_bytes + 2)
    return keys, values


def _codes_reference(slots: torch.Tensor, start: int, bits: int, count: int) -> torch.Tensor:
    bit = torch.arange(count, device=slots.device) * bits
    byte = start + bit // 8
    pair = slots[..., byte].to(torch.int32) | (slots[..., byte + 1].to(torch.int32) << 8)
    return (pair >> (bit % 8)) & ((1 << bits) - 1)


def _fp16_reference(slots: torch.Tensor, start: int) -> torch.Tensor:
    return slots[..., start: start + 2].contiguous().view(torch.float16).float()


def _fp8_e4b15(raw: torch.Tensor) -> torch.Tensor:
    """Triton's fp8e4b15 (exponent bias 15, no infinities or NaN), the keys of k8v4 below SM 8.9."""
    bits = raw.to(torch.int32)
    exponent, mantissa = (bits >> 3) & 0xF, (bits & 0x7).float()
    magnitude = torch.where(exponent > 0, (8 + mantissa) * torch.exp2(exponent.float() - 18),
                            mantissa * 2.0 ** -17)
    return torch.where(bits >= 128, -magnitude, magnitude)
