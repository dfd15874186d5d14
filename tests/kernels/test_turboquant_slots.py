"""kernels/turboquant_slots.py: TurboQuant slots decoded by the kernel against the torch reference.

Fresh random slots of each preset at head sizes 64 and 128 (codes and fp8 keys random bytes, the fp16 norms,
scales and zeros random values), split into the two halves compaction gathers, in the engine's head-major
staging layout and token-major; k8v4 also with e4b15 keys. vLLM's own TurboQuant store and dequantization
are checked against the same kernel in tests/engine/test_turboquant_cache.py. CPU (CI): the kernel in the
Triton interpreter (subprocess). GPU (``-m gpu``): compiled, float32 and bf16."""

from __future__ import annotations

import pytest
import torch

from tests.engine.test_turboquant_cache import PRESETS, hadamard
from tests.kernels.interpreter import check_in_interpreter
from vllm_evict.testing.turboquant import random_slots


def check(device: str, seed: int, dtypes=(torch.float32,)) -> None:
    from vllm.model_executor.layers.quantization.turboquant.centroids import get_centroids
    from vllm.model_executor.layers.quantization.turboquant.config import TurboQuantConfig

    from vllm_evict.kernels.turboquant_slots import dequantize_slots, dequantize_slots_reference

    gen = torch.Generator().manual_seed(seed)
    n, R, G, H = 37 + seed, 2, 3, 2
    for D in (64, 128):
        rotation = hadamard(D).to(device)
        for preset in PRESETS:
            config = TurboQuantConfig.from_cache_dtype(preset, D)
            centroids = get_centroids(D, config.centroid_bits).float().to(device)
            for e4b15 in (False, True) if config.key_fp8 else (False,):
                slots = random_slots(config, (R, G, H, n), gen, e4b15).to(device)
                half = slots.shape[-1] // 2
                # the engine's staging: [n, R, G, H, S/2] views of head-major storage, each half its own tensor
                first = slots[..., :half].contiguous().permute(3, 0, 1, 2, 4)
                second = slots[..., half:].contiguous().permute(3, 0, 1, 2, 4)
                ref_k, ref_v = dequantize_slots_reference(slots.permute(3, 0, 1, 2, 4), config, centroids, rotation,
                                                          e4b15)
                assert torch.isfinite(ref_k).all() and torch.isfinite(ref_v).all()
                for dtype in dtypes:
                    keys, values = dequantize_slots(first, second, config, centroids, rotation, e4b15, dtype)
                    assert keys.shape == values.shape == (n, R, G, H, D) and keys.dtype == values.dtype == dtype
                    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)
                    torch.testing.assert_close(keys.float(), ref_k, **tol, msg=lambda m: f"{preset} {D} keys: {m}")
                    torch.testing.assert_close(values.float(), ref_v, **tol,
                                               msg=lambda m: f"{preset} {D} values: {m}")
                # token-major halves (another layout) and a single slot row decode the same
                keys, values = dequantize_slots(first.contiguous(), second.contiguous(), config, centroids, rotation,
                                                e4b15, torch.float32)
                torch.testing.assert_close(keys, ref_k, rtol=1e-5, atol=1e-5)
                torch.testing.assert_close(values, ref_v, rtol=1e-5, atol=1e-5)
                keys, values = dequantize_slots(first[:1, 0, 0, :1], second[:1, 0, 0, :1], config, centroids,
                                                rotation, e4b15, torch.float32)
                torch.testing.assert_close(keys, ref_k[:1, 0, 0, :1], rtol=1e-5, atol=1e-5)


def test_turboquant_slots_in_the_interpreter():
    check_in_interpreter("tests.kernels.test_turboquant_slots", seeds=2, vllm_kernels=True)


def test_bad_slot_halves_are_refused():
    from vllm.model_executor.layers.quantization.turboquant.config import TurboQuantConfig

    from vllm_evict.kernels.turboquant_slots import dequantize_slots

    config = TurboQuantConfig.from_cache_dtype("turboquant_4bit_nc", 64)
    half = torch.zeros(4, config.slot_size_aligned // 2, dtype=torch.uint8)
    args = (config, torch.zeros(16), torch.eye(64), False, torch.float32)
    with pytest.raises(ValueError, match="one shape"):
        dequantize_slots(half, half[:3], *args)
    with pytest.raises(ValueError, match="one shape"):
        dequantize_slots(half, half.float(), *args)
    with pytest.raises(ValueError, match="cannot hold"):
        dequantize_slots(half[:, :10], half[:, :10], *args)
    with pytest.raises(ValueError, match="CUDA"):  # outside the interpreter: a CPU tensor has no kernel
        dequantize_slots(half, half, *args)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_turboquant_slots_on_cuda():
    for seed in range(3):
        check("cuda", seed, dtypes=(torch.float32, torch.bfloat16))
