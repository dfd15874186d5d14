"""turboquant_backend.TurboQuantPagedCache: eviction on vLLM's TurboQuant caches (the four presets).

Fresh random keys and values are written by vLLM's own TurboQuant store (its Triton kernel). Then:
* the adapter's gather + decoding gives what vLLM's own full dequantization kernel gives (the one its
  attention runs for long prefill continuations; keys rotated back by an explicit Hadamard matrix), and
  that is the written values up to the format's rounding;
* compaction of a model shaped as vLLM lays out a dense TurboQuant model (a model-dtype boundary layer,
  two TurboQuant layers, another boundary layer: one block table) scores exactly those decoded values per
  layout group (K-norm, and SnapKV with window queries), keeps what the policy API keeps on them (up to
  DESIGN.md §7.3's near ties), and moves each kept token's slot bytes unchanged.
The k8v4 preset is also checked with e4b15 keys (vLLM's fp8 format below compute capability 8.9).
CPU (CI): vLLM's and the project's kernels in the Triton interpreter (subprocess). GPU (``-m gpu``): compiled."""

from __future__ import annotations

import math

import pytest
import torch

from tests.kernels.interpreter import check_in_interpreter
from vllm_evict.engine.hnd_cache import HndPagedCache

PRESETS = ("turboquant_k8v4", "turboquant_4bit_nc", "turboquant_k3v4_nc", "turboquant_3bit_nc")
N, H, D, E, P = 16, 2, 64, 90, 3
# relative error of the decoded values against the written ones (measured about 0.075, 0.09 and 0.19):
# fp8 keys, 4-bit and 3-bit codes
ROUNDING = {8: 0.1, 4: 0.12, 3: 0.25}


def hadamard(d: int) -> torch.Tensor:
    h = torch.ones(1, 1)
    while h.shape[0] < d:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)])
    return h / math.sqrt(d)


def vllm_dequantized(kv: torch.Tensor, blocks: torch.Tensor, preset: str, e4b15: int) -> tuple:
    """Keys and values [E, H, D] of the first E tokens on `blocks`, by vLLM's `_tq_full_dequant_kv`."""
    from vllm.model_executor.layers.quantization.turboquant.centroids import get_centroids
    from vllm.model_executor.layers.quantization.turboquant.config import TurboQuantConfig
    from vllm.v1.attention.ops.triton_turboquant_decode import _tq_full_dequant_kv

    config = TurboQuantConfig.from_cache_dtype(preset, D)
    table = blocks[None].to(torch.int32)
    length = blocks.numel() * N
    k_out = torch.zeros(1, H, length, D, dtype=torch.float16, device=kv.device)
    v_out = torch.zeros_like(k_out)
    cache = kv.transpose(1, 2)  # [B, N, H, S]: the view vLLM's kernels take
    _tq_full_dequant_kv[(length, H)](
        cache, table, get_centroids(D, config.centroid_bits).float().to(kv.device), k_out, v_out,
        k_out.stride(0), k_out.stride(1), k_out.stride(2), v_out.stride(0), v_out.stride(1), v_out.stride(2),
        cache.stride(0), cache.stride(1), cache.stride(2), table.stride(0), HEAD_DIM=D, BLOCK_SIZE=N,
        NUM_KV_HEADS=H, MSE_BYTES=D if config.key_fp8 else math.ceil(D * config.key_mse_bits / 8),
        KPS=config.key_packed_size, VQB=config.value_quant_bits,
        VAL_DATA_BYTES=math.ceil(D * config.value_quant_bits / 8), MSE_BITS=config.key_mse_bits,
        KEY_FP8=int(config.key_fp8), BLOCK_D=D, NORM_CORRECTION=int(config.norm_correction), FP8_E4B15=e4b15)
    keys = k_out[0, :, :E].transpose(0, 1).float()
    if not config.key_fp8:  # stored rotated: back with H (orthonormal, symmetric)
        keys = (keys.cpu() @ hadamard(D)).to(kv.device)
    return keys, v_out[0, :, :E].transpose(0, 1).float()


class ModelDtypeCache(HndPagedCache):
    """A boundary layer's HND cache [B, H, N, 2D] of the model dtype, read as it is."""

    def __init__(self, kv_cache: torch.Tensor):
        self.kv_cache, self.num_heads, self.page_size, self.head_dim = kv_cache, H, N, D
        self.dtype, self.device = kv_cache.dtype, kv_cache.device
        self.gathered_bytes = 2 * D * kv_cache.dtype.itemsize

    @staticmethod
    def dequantize(caches, keys, values, queries):
        return keys, values, queries


def check(device: str, seed: int) -> None:
    from vllm.model_executor.layers.quantization.turboquant.config import TurboQuantConfig
    from vllm.v1.attention.ops import triton_turboquant_decode

    from vllm_evict.engine.turboquant_backend import EvictTurboQuantAttentionBackend, TurboQuantPagedCache, store

    gen = torch.Generator().manual_seed(seed)
    prompt_blocks = torch.randperm(20, generator=gen)[: -(-E // N)].to(device=device, dtype=torch.int32)
    fresh = torch.arange(20, 20 + P, device=device)
    pos = torch.arange(E, device=device)
    slot_mapping = prompt_blocks[pos // N].long() * N + pos % N                 # vLLM's slot mapping
    cases = [(preset, 0) for preset in PRESETS] + ([("turboquant_k8v4", 1)] if device == "cpu" else [])
    for preset, e4b15 in cases:
        triton_turboquant_decode._FP8_E4B15[0] = e4b15  # the store's fp8 format (device index 0 on the CPU)
        layers, before, decoded = [], [], []
        for i in range(4):
            keys = torch.randn(E, H, D, generator=gen) * (1 + 3 * torch.rand(E, H, 1, generator=gen))
            values = torch.randn(E, H, D, generator=gen)
            if i in (0, 3):  # a boundary layer: the model dtype, written as it is
                kv = torch.randn(24, H, N, 2 * D, generator=gen)
                kv[prompt_blocks[pos // N].long(), :, pos % N] = torch.cat([keys, values], -1)
                layers.append((i, ModelDtypeCache(kv.to(device))))
                before.append(kv.to(device).clone())
                decoded.append((keys.to(device), values.to(device)))
                continue
            shape = EvictTurboQuantAttentionBackend.get_kv_cache_shape(24, N, H, D, preset)
            kv = torch.zeros(shape, dtype=torch.uint8, device=device)
            store(kv, keys.to(device), values.to(device), slot_mapping, preset)
            expected = vllm_dequantized(kv, prompt_blocks, preset, e4b15)
            config = TurboQuantConfig.from_cache_dtype(preset, D)
            for got, written, b in zip(expected, (keys, values), (config.key_quant_bits, config.value_quant_bits)):
                err = float((got.cpu() - written).norm() / written.norm())
                if not (e4b15 and b == 8):  # e4b15 saturates at 1.875: the decoding is checked, not the format
                    assert err < ROUNDING[b], (preset, b, err)
            cache = TurboQuantPagedCache(kv, D, preset, torch.float32)
            cache.fp8_e4b15 = bool(e4b15)
            layers.append((i, cache))
            before.append(kv.clone())
            decoded.append(expected)

        # gather + decoding of both TurboQuant layers at once equals vLLM's dequantization
        tq = [c for _, c in layers[1:3]]
        k_half = torch.empty(E, 1, 2, H, tq[0].stored_dim, dtype=torch.uint8, device=device)
        v_half = torch.empty_like(k_half)
        tq[0].gather_layers(tq, prompt_blocks[None], E, k_half, v_half)
        k_dec, v_dec, _ = tq[0].dequantize(tq, k_half, v_half, None)
        tol = dict(rtol=1e-2, atol=1e-2)  # vLLM's kernel writes fp16 (keys rotated after that)
        for g in range(2):
            torch.testing.assert_close(k_dec[:, 0, g], decoded[g + 1][0], **tol)
            torch.testing.assert_close(v_dec[:, 0, g], decoded[g + 1][1], **tol)

        for policy in ("knorm", "snapkv"):
            check_compaction(policy, layers, before, decoded, prompt_blocks, fresh, tol, gen, device)
    triton_turboquant_decode._FP8_E4B15.pop(0, None)


def check_compaction(policy, layers, before, decoded, prompt_blocks, fresh, tol, gen, device) -> None:
    from tests.engine.recording import compact_recording
    from tests.policies.test_cuda import near_tie_ok
    from vllm_evict.engine import compaction
    from vllm_evict.policies import score_tokens, select_tokens

    config, q_window, seen = compact_recording(policy, layers, prompt_blocks, fresh, gen, tokens=E, page=N, pages=P,
                                               heads=H, head_dim=D)
    # one group per layout: the boundary layer, both TurboQuant layers, the other boundary layer
    assert [k.shape[1] for k, _, _, _ in seen] == [H, 2 * H, H]
    per_layer = [(k.view(E, -1, H, D)[:, g], v.view(E, -1, H, D)[:, g], keep.view(-1, H, E)[g])
                 for k, v, keep, _ in seen for g in range(k.shape[1] // H)]
    for i, (k_seen, v_seen, keep) in enumerate(per_layer):
        torch.testing.assert_close(k_seen, decoded[i][0], **tol)
        torch.testing.assert_close(v_seen, decoded[i][1], **tol)
        ref_scores = score_tokens(policy, None if q_window is None else q_window[i].cpu(), k_seen.cpu(),
                                  v_seen.cpu(), scale=D ** -0.5, **config.score_options())
        ref_keep = select_tokens(ref_scores, P * N, page_size=N, **config.select_options())
        near_tie_ok(ref_scores, ref_keep, keep.cpu(), ref_keep.sum(dim=1).tolist())
        counts = torch.full((H,), P, device=device)
        dest = compaction.compaction_slots(keep, counts, fresh, N)                # [E, H] per-head slots
        moved = dest >= 0
        assert int(moved.sum()) == H * P * N
        token, head = moved.nonzero(as_tuple=True)
        rows = layers[i][1].kv_cache.view(-1, layers[i][1].kv_cache.shape[-1])   # per-head page rows
        source = (prompt_blocks[token // N].long() * H + head) * N + token % N
        assert torch.equal(rows[dest[moved]], before[i].view(-1, rows.shape[-1])[source])  # whole slots


def test_prefill_rows_with_cached_kv_are_found():
    """The batches in which vLLM's TurboQuant prefill must take its per-row path (EvictTurboQuantMetadataBuilder):
    a prefill row whose sequence is longer than its queries. Decode rows (one query) read the cache anyway."""
    from vllm_evict.engine.turboquant_backend import reads_cached_kv

    def batch(*rows):  # (queries, sequence) per row
        starts = torch.tensor([0, *torch.tensor([q for q, _ in rows]).cumsum(0).tolist()])
        return starts, torch.tensor([s for _, s in rows] + [0])  # seq_lens may be longer than the batch (padded)

    assert not reads_cached_kv(*batch((600, 600), (128, 128)))           # fresh prompts only
    assert not reads_cached_kv(*batch((1, 700), (1, 90), (600, 600)))    # decodes beside a fresh prompt
    assert reads_cached_kv(*batch((600, 600), (40, 600)))                # a prefix-cache hit beside a fresh prompt
    assert reads_cached_kv(*batch((1, 700), (128, 256)))                 # a prompt's second chunk


def test_turboquant_caches_in_the_interpreter():
    check_in_interpreter("tests.engine.test_turboquant_cache", seeds=1, vllm_kernels=True)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_turboquant_caches_on_cuda():
    for seed in range(3):
        check("cuda", seed)
