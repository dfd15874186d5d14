"""Settings eviction does not support are refused at engine start with a message that names the flag,
instead of failing mid-serving: a quantized KV cache other than FlashAttention's e4m3 fp8, the Triton
backend's per-token-head caches and TurboQuant's on CUDA."""

from __future__ import annotations

import re

import pytest

from vllm_evict.engine.attention import check_cache_dtype

MESSAGE = "vllm-evict does not support the KV cache dtype '{0}' (--kv-cache-dtype {0}) on the {1} attention backend"
PER_TOKEN_HEAD = ["int8_per_token_head", "fp8_per_token_head", "int4_per_token_head"]
TURBOQUANT = ["turboquant_k8v4", "turboquant_4bit_nc", "turboquant_k3v4_nc", "turboquant_3bit_nc"]
BACKENDS = {"FLASH_ATTN", "TRITON_ATTN", "TURBOQUANT", "CPU_ATTN"}


@pytest.mark.parametrize("backend", ["FLASH_ATTN", "TRITON_ATTN", "CPU_ATTN"])
@pytest.mark.parametrize("dtype", ["auto", "bfloat16", "float16"])
def test_model_dtype_caches_pass(dtype, backend):
    check_cache_dtype(dtype, backend)


@pytest.mark.parametrize("dtype, backend", [("fp8", "FLASH_ATTN"), ("fp8_e4m3", "FLASH_ATTN"),
                                            *[(dtype, "TRITON_ATTN") for dtype in PER_TOKEN_HEAD],
                                            *[(dtype, "TURBOQUANT") for dtype in TURBOQUANT]])
def test_quantized_caches_pass_on_the_cuda_backend_that_evicts_them(dtype, backend):
    check_cache_dtype(dtype, backend)
    for other in BACKENDS - {backend}:
        with pytest.raises(ValueError, match=re.escape(MESSAGE.format(dtype, other))):
            check_cache_dtype(dtype, other)


@pytest.mark.parametrize("backend", sorted(BACKENDS))
@pytest.mark.parametrize("dtype", ["fp8_e5m2", "fp8_inc", "nvfp4"])
def test_other_quantized_caches_are_refused(dtype, backend):
    with pytest.raises(ValueError, match=re.escape(MESSAGE.format(dtype, backend))) as raised:
        check_cache_dtype(dtype, backend)
    message = str(raised.value)
    assert "--kv-cache-dtype auto" in message
    cuda = backend != "CPU_ATTN"  # on CUDA the message names every dtype that evicts, and its backend
    assert ("fp8 or fp8_e4m3 (FLASH_ATTN)" in message) == cuda
    assert all((dtype in message) == cuda for dtype in PER_TOKEN_HEAD + TURBOQUANT)


@pytest.mark.engine
def test_engine_start_refuses_fp8_with_the_flag_named(capfd):
    """A real engine start (CPU, tiny model): the attention backend's check runs before vLLM's own."""
    from vllm_evict.testing.engines import make_llm
    from vllm_evict.testing.tiny_models import ensure_tiny_model

    with pytest.raises(Exception):
        make_llm(ensure_tiny_model("llama"), kv_cache_dtype="fp8")
    out, err = capfd.readouterr()
    assert MESSAGE.format("fp8", "CPU_ATTN") in out + err
    assert "start with --kv-cache-dtype auto" in out + err
