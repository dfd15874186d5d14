"""triton_backend.PerTokenHeadPagedCache: eviction on vLLM's per-token-head quantized caches (int8, fp8, int4).

Fresh random keys and values are written by vLLM's own per-token-head write (its Triton kernel, into the
cache and the fp32 scale views its attention backend makes over the same bytes). Then, for two layers:
* the adapter's gather + dequantize gives what an independent decoding of vLLM's views gives (data x scale;
  int4: nibbles less the zero point in the scale's low mantissa bits, times the scale, rotated back by an
  explicit Hadamard matrix), and that is the written values up to the format's rounding (int4: on the CPU);
* compaction (K-norm, and SnapKV with window queries) scores exactly those dequantized values, keeps what
  the policy API keeps on them (up to DESIGN.md §7.3's near ties), and moves each kept token's bytes (data
  and scale) unchanged to its slot: vLLM's scale views read the moved scales there.
CPU (CI): vLLM's and the project's kernels in the Triton interpreter (subprocess). GPU (``-m gpu``): compiled."""

from __future__ import annotations

import pytest
import torch

from tests.kernels.interpreter import check_in_interpreter

MODES = ("int8_per_token_head", "fp8_per_token_head", "int4_per_token_head")
N, H, D, E, P = 16, 2, 64, 90, 3


def hadamard(d: int) -> torch.Tensor:
    h = torch.ones(1, 1)
    while h.shape[0] < d:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)])
    return h


def reference_dequantized(cache_view: torch.Tensor, scales: torch.Tensor, mode: str) -> torch.Tensor:
    """Decode vLLM's views (data [T, H, W] of the cache dtype, scales [T, H] float32) independently."""
    from vllm.v1.attention.ops.int4_per_token_head import _get_rht_signs

    if mode == "int8_per_token_head":
        return cache_view[..., :D].float() * scales.unsqueeze(-1)
    if mode == "fp8_per_token_head":
        return cache_view[..., :D].view(torch.float8_e4m3fn).float() * scales.unsqueeze(-1)
    packed = cache_view[..., : D // 2].long()
    values = torch.empty(*packed.shape[:-1], D, dtype=torch.long, device=packed.device)
    values[..., 0::2], values[..., 1::2] = packed % 16, packed // 16   # even index in the low nibble
    bits = scales.view(torch.int32)
    zero_point, step = (bits & 15).float(), (bits & ~15).view(torch.float32)
    rotated = (values.float() - zero_point.unsqueeze(-1)) * step.unsqueeze(-1)
    signs = _get_rht_signs(D, 0, torch.device("cpu"))                     # vLLM's fixed rotation's signs
    return ((rotated.cpu() @ hadamard(D)) * signs / D).to(rotated.device)  # H is symmetric


def check(device: str, seed: int) -> None:
    from vllm.utils.torch_utils import STR_DTYPE_TO_TORCH_DTYPE
    from vllm.v1.attention.backends.triton_attn import TritonAttentionBackend, TritonAttentionImpl
    from vllm.v1.attention.ops.triton_reshape_and_cache_flash import (
        triton_reshape_and_cache_flash_per_token_head_quant)
    from vllm.v1.kv_cache_interface import get_kv_quant_mode

    from vllm_evict.engine.triton_backend import PerTokenHeadPagedCache

    gen = torch.Generator().manual_seed(seed)
    prompt_blocks = torch.randperm(20, generator=gen)[: -(-E // N)].to(device=device, dtype=torch.int32)
    fresh = torch.arange(20, 20 + P, device=device)
    pos = torch.arange(E, device=device)
    slots = prompt_blocks[pos // N].long() * N + pos % N                  # vLLM's slot mapping
    for mode in MODES:
        layers, views, raw = [], [], []
        for i in range(2):
            kv = torch.zeros(TritonAttentionBackend.get_kv_cache_shape(24, N, H, D, mode),
                             dtype=STR_DTYPE_TO_TORCH_DTYPE[mode], device=device)
            impl = object.__new__(TritonAttentionImpl)  # vLLM's own scale views and write, no engine
            impl._kv_quant_mode, impl.fp8_dtype = get_kv_quant_mode(mode), torch.float8_e4m3fn
            key_cache, value_cache = impl._pth_key_value_caches(kv)
            keys = torch.randn(E, H, D, generator=gen) * (1 + 3 * torch.rand(E, H, 1, generator=gen))
            values = torch.randn(E, H, D, generator=gen)
            triton_reshape_and_cache_flash_per_token_head_quant(
                keys.to(device), values.to(device), key_cache, value_cache, impl._k_scale_cache,
                impl._v_scale_cache, slots, impl._kv_quant_mode)
            blk, off = slots // N, slots % N
            expected = [reference_dequantized(c[blk, off], s[blk, off], mode)            # [E, H, D]
                        for c, s in ((key_cache, impl._k_scale_cache), (value_cache, impl._v_scale_cache))]
            # the format's own rounding: int8 / fp8 within 7% of the values, int4 within 25%. On CUDA vLLM's int4
            # write rotates through its hadacore kernel, whose result varied between calls on an H200 (a norm
            # 1.55x the input's once in five calls, docs/results/per-token-head): there the bound is not ours
            # to check, the decoding below is.
            for got, written in zip(expected, (keys, values)):
                err = (got.cpu() - written).norm() / written.norm()
                if mode != "int4_per_token_head" or device == "cpu":
                    assert err < (0.25 if mode == "int4_per_token_head" else 0.07), (mode, float(err))
            layers.append((i, PerTokenHeadPagedCache(kv, D, mode, torch.float32)))
            views.append((impl, kv.clone()))
            raw.append(expected)

        # gather + dequantize of both layers at once equals the independent decoding
        cache = layers[0][1]
        k_words = torch.empty(E, 1, 2, H, cache.stored_dim, dtype=torch.int32, device=device)
        v_words = torch.empty_like(k_words)
        cache.gather_layers([c for _, c in layers], prompt_blocks[None], E, k_words, v_words)
        k_deq, v_deq, _ = cache.dequantize([c for _, c in layers], k_words, v_words, None)
        tol = dict(rtol=1e-5, atol=1e-6)  # int4: a butterfly against a matrix product (on CUDA through bf16)
        if mode == "int4_per_token_head":
            tol = dict(rtol=2e-2, atol=2e-2) if device == "cuda" else dict(rtol=1e-4, atol=1e-5)
        for i in range(2):
            torch.testing.assert_close(k_deq[:, 0, i], raw[i][0], **tol)
            torch.testing.assert_close(v_deq[:, 0, i], raw[i][1], **tol)

        # compaction scores those values (a key-only and a query-based policy), keeps what the policy API keeps
        # on them, and moves the kept tokens' bytes, scales with them
        for policy in ("knorm", "snapkv"):
            check_compaction(policy, layers, views, raw, prompt_blocks, fresh, tol, gen, device)


def check_compaction(policy, layers, views, raw, prompt_blocks, fresh, tol, gen, device) -> None:
    from tests.engine.recording import compact_recording
    from tests.policies.test_cuda import near_tie_ok
    from vllm_evict.engine import compaction
    from vllm_evict.policies import score_tokens, select_tokens

    config, q_window, seen = compact_recording(policy, layers, prompt_blocks, fresh, gen, tokens=E, page=N, pages=P,
                                               heads=H, head_dim=D)
    (k_seen, v_seen, keep, counts), = seen
    keep, counts = keep.view(2, H, E), counts.view(2, H)
    for i, (impl, before) in enumerate(views):
        torch.testing.assert_close(k_seen.view(E, 2, H, D)[:, i], raw[i][0], **tol)
        torch.testing.assert_close(v_seen.view(E, 2, H, D)[:, i], raw[i][1], **tol)
        ref_scores = score_tokens(policy, None if q_window is None else q_window[i].cpu(), raw[i][0].cpu(),
                                  raw[i][1].cpu(), scale=D ** -0.5, **config.score_options())
        ref_keep = select_tokens(ref_scores, P * N, page_size=N, **config.select_options())
        near_tie_ok(ref_scores, ref_keep, keep[i].cpu(), ref_keep.sum(dim=1).tolist())
        dest = compaction.compaction_slots(keep[i], counts[i], fresh, N)          # [E, H] per-head slots
        moved = dest >= 0
        assert int(moved.sum()) == H * P * N
        token, head = moved.nonzero(as_tuple=True)
        rows = layers[i][1].kv_cache.view(-1, layers[i][1].kv_cache.shape[-1])   # per-head page rows
        source = (prompt_blocks[token // N].long() * H + head) * N + token % N
        assert torch.equal(rows[dest[moved]], before.view(torch.int32).view(-1, rows.shape[-1])[source])
        # vLLM's scale view at a kept token's new slot reads the token's own scale
        new_block, new_offset = dest[moved] // N // H, dest[moved] % N
        assert torch.equal(impl._k_scale_cache[new_block, new_offset, head],
                           scales_at(before, prompt_blocks[token // N].long(), token % N, head))


def scales_at(kv: torch.Tensor, block: torch.Tensor, offset: torch.Tensor, head: torch.Tensor) -> torch.Tensor:
    """The key scales stored at (block, offset, head) of a [B, H, N, 2W] per-token-head cache's bytes."""
    raw = kv.view(torch.uint8)
    width = raw.shape[-1] // 2
    return raw[block, head, offset, width - 4: width].contiguous().view(torch.float32).view(-1)


def test_per_token_head_caches_in_the_interpreter():
    check_in_interpreter("tests.engine.test_per_token_head_cache", seeds=2, vllm_kernels=True)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_per_token_head_caches_on_cuda():
    for seed in range(3):
        check("cuda", seed)
