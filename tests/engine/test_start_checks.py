"""Settings eviction does not support are refused at engine start with a message that names the flag,
instead of failing mid-serving: a quantized KV cache other than e4m3 fp8 on CUDA."""

from __future__ import annotations

import re

import pytest

from vllm_evict.engine.attention import check_cache_dtype

MESSAGE = "vllm-evict does not support the KV cache dtype '{0}' (--kv-cache-dtype {0})"


@pytest.mark.parametrize("cuda", [True, False])
@pytest.mark.parametrize("dtype", ["auto", "bfloat16", "float16"])
def test_model_dtype_caches_pass(dtype, cuda):
    check_cache_dtype(dtype, cuda)


@pytest.mark.parametrize("dtype", ["fp8", "fp8_e4m3"])
def test_e4m3_fp8_caches_pass_on_cuda_only(dtype):
    check_cache_dtype(dtype, cuda=True)
    with pytest.raises(ValueError, match=re.escape(MESSAGE.format(dtype) + " on this platform")):
        check_cache_dtype(dtype, cuda=False)


@pytest.mark.parametrize("cuda", [True, False])
@pytest.mark.parametrize("dtype", ["fp8_e5m2", "fp8_inc", "nvfp4"])
def test_other_quantized_caches_are_refused(dtype, cuda):
    with pytest.raises(ValueError, match=re.escape(MESSAGE.format(dtype))) as raised:
        check_cache_dtype(dtype, cuda)
    assert "--kv-cache-dtype auto" in str(raised.value) and ("or fp8" in str(raised.value)) == cuda


@pytest.mark.engine
def test_engine_start_refuses_fp8_with_the_flag_named(capfd):
    """A real engine start (CPU, tiny model): the attention backend's check runs before vLLM's own."""
    from vllm_evict.testing.engines import make_llm
    from vllm_evict.testing.tiny_models import ensure_tiny_model

    with pytest.raises(Exception):
        make_llm(ensure_tiny_model("llama"), kv_cache_dtype="fp8")
    out, err = capfd.readouterr()
    assert MESSAGE.format("fp8") + " on this platform" in out + err
    assert "start with --kv-cache-dtype auto" in out + err
