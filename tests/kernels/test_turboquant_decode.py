"""kernels/turboquant_decode.py: the engine's decode attention over 4-bit TurboQuant slots (its partials reduced by
vLLM's stage 2, engine/turboquant_backend.decode_attention) against the torch reference and against vLLM's own
TurboQuant decode.

Fresh random `turboquant_4bit_nc` slots at head sizes 64 and 128 in a head-major cache viewed as vLLM's kernels
take it, shuffled block tables, requests of 1 token (most KV splits empty) up to 300 tokens (several tiles a
split, splits that start inside a page), GQA groups of 4, 3 (padded) and 1, with and without vLLM's norm
correction; and the engine's attention impl against vLLM's own decode method. CPU (CI, the slow suite): the
kernels in the Triton interpreter (subprocess). GPU (``-m gpu``): compiled, float32 and bf16 queries."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tests.engine.test_turboquant_cache import hadamard
from tests.kernels.interpreter import check_in_interpreter
from vllm_evict.testing.turboquant import random_slots

N, SPLITS, NUM_BLOCKS = 16, 8, 48


def check(device: str, seed: int, dtypes=(torch.float32,)) -> None:
    from vllm.model_executor.layers.quantization.turboquant.centroids import get_centroids
    from vllm.model_executor.layers.quantization.turboquant.config import TurboQuantConfig
    from vllm.v1.attention.ops.triton_turboquant_decode import triton_turboquant_decode_attention

    from vllm_evict.engine.turboquant_backend import decode_attention
    from vllm_evict.kernels.turboquant_decode import decode_attention_reference

    gen = torch.Generator().manual_seed(seed)
    # 300 tokens: splits of 38, three tiles each (the online softmax's rescaling); 1 token: seven empty splits
    seq_lens = torch.tensor([1, 37 + seed, 300], dtype=torch.int32)
    B = seq_lens.numel()
    table = torch.stack([torch.randperm(NUM_BLOCKS, generator=gen)[:19] for _ in range(B)]).to(torch.int32)
    for D, Hq, Hk in ((64, 6, 2), (64, 2, 2), (128, 8, 2)):  # GQA groups of 3 (padded), 1 and 4
        rotation = hadamard(D).to(device)
        preset = TurboQuantConfig.from_cache_dtype("turboquant_4bit_nc", D)
        centroids = get_centroids(D, preset.centroid_bits).float().to(device)
        for config in (preset, dataclasses.replace(preset, norm_correction=False)):
            # head-major storage [blocks, Hk, N, S], viewed [blocks, N, Hk, S] as vLLM's kernels take it
            kv = random_slots(config, (NUM_BLOCKS, Hk, N), gen, False).to(device).transpose(1, 2)
            query = torch.randn(B, Hq, D, generator=gen)
            args = (kv, table.to(device), seq_lens.to(device))
            expected = decode_attention_reference(query.to(device), *args, config, centroids, rotation, D ** -0.5)
            for dtype in dtypes:
                q = query.to(device, dtype)
                partials = torch.full((B, Hq, SPLITS, D + 1), float("nan"), device=device)
                out = torch.empty(B, Hq, D, dtype=dtype, device=device)
                lse = torch.empty(B, Hq, device=device)
                got = decode_attention(q, *args, config, centroids, rotation.T.contiguous(), D ** -0.5, partials,
                                       out, lse)
                assert got is out
                name = f"D={D} {Hq}/{Hk} norm_correction={config.norm_correction} {dtype}"
                tol = dict(rtol=1e-4, atol=1e-4) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
                reference = expected if dtype == torch.float32 else decode_attention_reference(
                    q.float(), *args, config, centroids, rotation, D ** -0.5)
                torch.testing.assert_close(got.float(), reference, **tol, msg=lambda m: f"{name}: {m}")
                vllm = triton_turboquant_decode_attention(
                    q, *args, rotation, centroids, D ** -0.5, config.key_mse_bits, config.key_packed_size,
                    config.effective_value_quant_bits, key_fp8=config.key_fp8,
                    norm_correction=config.norm_correction, max_num_kv_splits=SPLITS)
                torch.testing.assert_close(got, vllm, **tol, msg=lambda m: f"{name} vs vLLM: {m}")
    check_engine_decode(device, gen, seq_lens, table)


def check_engine_decode(device: str, gen: torch.Generator, seq_lens: torch.Tensor, table: torch.Tensor) -> None:
    """The engine's attention impl (`EvictTurboQuantAttentionImpl._decode_attention`, as vLLM's forward calls it)
    against vLLM's own method on the same impl: close on 4bit_nc (the engine's kernel), equal on k8v4 (vLLM's
    kernel on both sides). The rotation is a random orthogonal matrix, not the symmetric Hadamard, so a rotation
    passed untransposed shows."""
    from types import SimpleNamespace

    from vllm.model_executor.layers.quantization.turboquant.centroids import get_centroids
    from vllm.model_executor.layers.quantization.turboquant.config import TurboQuantConfig
    from vllm.v1.attention.backends.turboquant_attn import TurboQuantAttentionImpl

    from vllm_evict.engine.turboquant_backend import EvictTurboQuantAttentionImpl

    D, Hq, Hk = 128, 8, 2
    rotation = torch.linalg.qr(torch.randn(D, D, generator=gen))[0].to(device)
    metadata = SimpleNamespace(block_table=table.to(device), seq_lens=seq_lens.to(device))
    query = torch.randn(seq_lens.numel(), Hq, D, generator=gen).to(device)
    for preset, tol in (("turboquant_4bit_nc", dict(rtol=1e-4, atol=1e-4)), ("turboquant_k8v4", dict(rtol=0, atol=0))):
        impl = object.__new__(EvictTurboQuantAttentionImpl)  # the fields both decodes read
        impl.tq_config = TurboQuantConfig.from_cache_dtype(preset, D)
        impl.num_heads, impl.head_size, impl.max_num_kv_splits, impl.scale = Hq, D, SPLITS, D ** -0.5
        centroids = get_centroids(D, impl.tq_config.centroid_bits).float().to(device)
        kv = random_slots(impl.tq_config, (NUM_BLOCKS, Hk, N), gen, False).to(device).transpose(1, 2)
        q = query * (0.02 if impl.tq_config.key_fp8 else 1.0)
        args = (q, kv, metadata, rotation, centroids, rotation.T.contiguous())
        expected = TurboQuantAttentionImpl._decode_attention(impl, *args)
        torch.testing.assert_close(impl._decode_attention(*args), expected, **tol,
                                   msg=lambda m: f"{preset}: the engine's decode against vLLM's: {m}")


@pytest.mark.slow  # interpreted kernels (vLLM's decode too); CI runs it with -m slow
def test_turboquant_decode_in_the_interpreter():
    check_in_interpreter("tests.kernels.test_turboquant_decode", seeds=1, vllm_kernels=True)


def test_other_presets_and_mismatched_partials_are_refused():
    from vllm.model_executor.layers.quantization.turboquant.config import TurboQuantConfig

    from vllm_evict.kernels.turboquant_decode import decode_partials, supports

    assert supports(TurboQuantConfig.from_cache_dtype("turboquant_4bit_nc", 128))
    assert not any(supports(TurboQuantConfig.from_cache_dtype(p, 128))
                   for p in ("turboquant_k8v4", "turboquant_k3v4_nc", "turboquant_3bit_nc"))
    config = TurboQuantConfig.from_cache_dtype("turboquant_4bit_nc", 64)
    kv = torch.zeros(4, N, 2, config.slot_size_aligned, dtype=torch.uint8)
    query = torch.zeros(3, 8, 64)
    table, lens = torch.zeros(3, 1, dtype=torch.int32), torch.ones(3, dtype=torch.int32)
    with pytest.raises(ValueError, match="partials"):
        decode_partials(query, kv, table, lens, config, torch.zeros(16), torch.eye(64), 0.125, torch.zeros(3, 8, 4, 64))
    k8v4 = TurboQuantConfig.from_cache_dtype("turboquant_k8v4", 64)
    with pytest.raises(ValueError, match="4-bit"):
        decode_partials(query, kv, table, lens, k8v4, torch.zeros(16), torch.eye(64), 0.125, torch.zeros(3, 8, 4, 65))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_turboquant_decode_on_cuda():
    for seed in range(3):
        check("cuda", seed, dtypes=(torch.float32, torch.bfloat16))
