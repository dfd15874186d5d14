"""Prompt K/V of several layers out of vLLM's paged HND caches, and kept tokens back in, one launch each.

The engine compacts all layers of a request at once (vllm_evict/engine/compaction.py). vLLM allocates
one cache tensor per layer, so a launch reaches layer g's cache as `base + offsets[g]`: `base` is the
first layer's cache and offsets[g] the element distance of layer g's cache from it (int64, may be
negative). Each cache is [num_blocks, H, page, 2*D] (HND, K and V packed in the last dim): token t of
head h in block b sits at ((b*H + h)*page + t % page)*2D, keys first.

gather_prompt(caches, blocks, n, keys, values)
    blocks [R, >= cdiv(n, page)] int32/int64 block ids of R requests' prompts (the same in every layer);
    keys/values [n, R*G, H, D] (any strides, unit stride on D): keys[t, r*G + g, h] = layer g's key of
    token t of request r (R requests compacted together: one launch for all).
scatter_kept(caches, keys, values, slots)
    slots [G, n, H] int64: per-head slot (page*page_size + offset of the per-head page view, page =
    block*H + h) of token t in layer g, -1 = not kept; writes keys/values [n, G, H, D] there.
gather_slots(caches, slots, keys, values)
    the reverse: keys/values [n, G, H, D] <- the tokens at slots [G, n, H] (zero where -1). A request in
    per-head (Ada-KV) layout holds an uneven count per head, each head's tokens on pages of its own.

n, H, the layer count and the block rows' stride are not specialised, so no prompt length, group
size or number of requests compiles a new variant. The buffer
strides are (multiples of 16 for the usual head sizes, whatever G is), so that the accesses vectorise.
Both kernels have a torch reference below (`*_reference`); tests/kernels/test_paged_kv.py checks them
against it (Triton interpreter on CPU, and on GPU).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from vllm_evict.kernels.constants import device_ints

BLOCK_T = 64


def layer_offsets(caches: list[torch.Tensor]) -> tuple[torch.Tensor, list[int]]:
    """(base cache, element offset of every cache from it)."""
    base = caches[0]
    size = base.element_size()
    offsets = []
    for cache in caches:
        if cache.dtype != base.dtype or cache.shape[1:] != base.shape[1:] or not cache.is_contiguous():
            raise ValueError("caches must be contiguous and share dtype and [H, page, 2*D]")
        distance = cache.data_ptr() - base.data_ptr()
        if distance % size:
            raise ValueError("cache tensors are not element-aligned with each other")
        offsets.append(distance // size)
    return base, offsets


def _alignment(offsets: list[int]) -> int:
    """16 when every cache starts 16 elements apart from the first (always, for the caching allocator's
    512-byte alignment): the loads and stores are then vectorised, which they cannot be for a pointer
    read from memory without this hint."""
    return 16 if all(o % 16 == 0 for o in offsets) else 1


@triton.jit
def _tile(n, H, BLOCK: tl.constexpr, D: tl.constexpr, D_P: tl.constexpr):
    """This program's (layer g, head h, token rows t, their validity, head-dim columns d)."""
    gh = tl.program_id(1)
    t = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    d = tl.arange(0, D_P)
    return gh // H, gh % H, t, t < n, d, (d < D)[None, :]


@triton.jit(do_not_specialize=["n", "H", "G", "s_b"])
def _gather_prompt_kernel(base, offsets, blocks, keys, values, n, H, G, s_b,
                          s_kt, s_kg, s_kh, s_vt, s_vg, s_vh,
                          D: tl.constexpr, D_P: tl.constexpr, PAGE: tl.constexpr, BLOCK: tl.constexpr,
                          ALIGN: tl.constexpr):
    g, h, t, t_ok, d, d_ok = _tile(n, H, BLOCK, D, D_P)  # g: request g // G, layer g % G
    mask = t_ok[:, None] & d_ok
    block = tl.load(blocks + (g // G).to(tl.int64) * s_b + t // PAGE, mask=t_ok, other=0).to(tl.int64)
    row = (block * H + h) * PAGE + t % PAGE
    src = base + tl.multiple_of(tl.load(offsets + g % G), ALIGN) + row[:, None] * (2 * D) + d[None, :]
    k = tl.load(src, mask=mask)
    v = tl.load(src + D, mask=mask)
    t64 = t.to(tl.int64)[:, None]
    tl.store(keys + t64 * s_kt + g * s_kg + h * s_kh + d[None, :], k, mask=mask)
    tl.store(values + t64 * s_vt + g * s_vg + h * s_vh + d[None, :], v, mask=mask)


@triton.jit(do_not_specialize=["n", "H"])
def _scatter_kept_kernel(base, offsets, slots, keys, values, n, H,
                         s_kt, s_kg, s_kh, s_vt, s_vg, s_vh,
                         D: tl.constexpr, D_P: tl.constexpr, BLOCK: tl.constexpr, ALIGN: tl.constexpr):
    g, h, t, t_ok, d, d_ok = _tile(n, H, BLOCK, D, D_P)
    slot = tl.load(slots + (g * n + t).to(tl.int64) * H + h, mask=t_ok, other=-1)
    mask = (slot >= 0)[:, None] & d_ok
    t64 = t.to(tl.int64)[:, None]
    k = tl.load(keys + t64 * s_kt + g * s_kg + h * s_kh + d[None, :], mask=mask)  # masked rows: no traffic
    v = tl.load(values + t64 * s_vt + g * s_vg + h * s_vh + d[None, :], mask=mask)
    dst = base + tl.multiple_of(tl.load(offsets + g), ALIGN) + slot[:, None] * (2 * D) + d[None, :]
    tl.store(dst, k, mask=mask)
    tl.store(dst + D, v, mask=mask)


@triton.jit(do_not_specialize=["n", "H"])
def _gather_slots_kernel(base, offsets, slots, keys, values, n, H,
                         s_kt, s_kg, s_kh, s_vt, s_vg, s_vh,
                         D: tl.constexpr, D_P: tl.constexpr, BLOCK: tl.constexpr, ALIGN: tl.constexpr):
    g, h, t, t_ok, d, d_ok = _tile(n, H, BLOCK, D, D_P)
    slot = tl.load(slots + (g * n + t).to(tl.int64) * H + h, mask=t_ok, other=-1)
    held = (slot >= 0)[:, None] & d_ok
    src = base + tl.multiple_of(tl.load(offsets + g), ALIGN) + slot[:, None] * (2 * D) + d[None, :]
    k = tl.load(src, mask=held, other=0.0)  # an empty slot reads nothing and is written as zeros
    v = tl.load(src + D, mask=held, other=0.0)
    t64 = t.to(tl.int64)[:, None]
    mask = t_ok[:, None] & d_ok
    tl.store(keys + t64 * s_kt + g * s_kg + h * s_kh + d[None, :], k, mask=mask)
    tl.store(values + t64 * s_vt + g * s_vg + h * s_vh + d[None, :], v, mask=mask)


def _check_buffers(keys: torch.Tensor, values: torch.Tensor, num_layers: int, H: int, D: int) -> int:
    if keys.shape != values.shape or keys.dim() != 4 or keys.shape[1:] != (num_layers, H, D):
        raise ValueError(f"keys/values must be [n, {num_layers}, {H}, {D}], got {tuple(keys.shape)} "
                         f"and {tuple(values.shape)}")
    if keys.stride(-1) != 1 or values.stride(-1) != 1:
        raise ValueError("keys/values need a unit stride on D")
    return keys.shape[0]


def gather_prompt(caches: list[torch.Tensor], blocks: torch.Tensor, n: int, keys: torch.Tensor,
                  values: torch.Tensor) -> None:
    base, offsets = layer_offsets(caches)
    _, H, page, two_d = base.shape
    D = two_d // 2
    if blocks.dim() != 2 or blocks.stride(-1) != 1:
        raise ValueError(f"blocks must be [R, num_blocks] with a unit stride, got {tuple(blocks.shape)}")
    rows = len(caches) * blocks.shape[0]
    if _check_buffers(keys, values, rows, H, D) != n or blocks.shape[1] * page < n:
        raise ValueError(f"need {n} token rows and at least cdiv({n}, {page}) blocks")
    grid = (triton.cdiv(n, BLOCK_T), rows * H)
    _gather_prompt_kernel[grid](base, device_ints(tuple(offsets), base.device), blocks, keys, values, n, H,
                                len(caches), blocks.stride(0), *keys.stride()[:3], *values.stride()[:3],
                                D=D, D_P=triton.next_power_of_2(D), PAGE=page, BLOCK=BLOCK_T,
                                ALIGN=_alignment(offsets))


def scatter_kept(caches: list[torch.Tensor], keys: torch.Tensor, values: torch.Tensor, slots: torch.Tensor) -> None:
    _by_slots(_scatter_kept_kernel, caches, keys, values, slots)


def gather_slots(caches: list[torch.Tensor], slots: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
    _by_slots(_gather_slots_kernel, caches, keys, values, slots)


def _by_slots(kernel, caches: list[torch.Tensor], keys: torch.Tensor, values: torch.Tensor,
              slots: torch.Tensor) -> None:
    """One launch of a kernel that moves keys/values [n, G, H, D] to or from per-head slots [G, n, H]."""
    base, offsets = layer_offsets(caches)
    _, H, page, two_d = base.shape
    D = two_d // 2
    n = _check_buffers(keys, values, len(caches), H, D)
    if slots.shape != (len(caches), n, H) or slots.dtype != torch.int64 or not slots.is_contiguous():
        raise ValueError(f"slots must be contiguous int64 [{len(caches)}, {n}, {H}], got {tuple(slots.shape)}")
    grid = (triton.cdiv(n, BLOCK_T), len(caches) * H)
    kernel[grid](base, device_ints(tuple(offsets), base.device), slots, keys, values, n, H,
                 *keys.stride()[:3], *values.stride()[:3],
                 D=D, D_P=triton.next_power_of_2(D), BLOCK=BLOCK_T, ALIGN=_alignment(offsets))


def gather_prompt_reference(caches: list[torch.Tensor], blocks: torch.Tensor, n: int, keys: torch.Tensor,
                            values: torch.Tensor) -> None:
    D, G = caches[0].shape[-1] // 2, len(caches)
    for r, request_blocks in enumerate(blocks):
        for g, cache in enumerate(caches):
            tokens = cache[request_blocks.long()].permute(0, 2, 1, 3).flatten(0, 1)[:n]    # [n, H, 2D]
            keys[:, r * G + g] = tokens[..., :D]
            values[:, r * G + g] = tokens[..., D:]


def scatter_kept_reference(caches: list[torch.Tensor], keys: torch.Tensor, values: torch.Tensor,
                           slots: torch.Tensor) -> None:
    D = caches[0].shape[-1] // 2
    for g, cache in enumerate(caches):
        rows = cache.view(-1, 2 * D)
        kept = slots[g] >= 0                                                    # [n, H]
        rows[slots[g][kept], :D] = keys[:, g][kept]
        rows[slots[g][kept], D:] = values[:, g][kept]


def gather_slots_reference(caches: list[torch.Tensor], slots: torch.Tensor, keys: torch.Tensor,
                           values: torch.Tensor) -> None:
    D = caches[0].shape[-1] // 2
    for g, cache in enumerate(caches):
        rows = cache.view(-1, 2 * D)[slots[g].clamp(min=0)]                     # [n, H, 2D]
        held = (slots[g] >= 0).unsqueeze(-1)
        keys[:, g] = torch.where(held, rows[..., :D], 0)
        values[:, g] = torch.where(held, rows[..., D:], 0)
