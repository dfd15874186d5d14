"""Issue 21, step 1: an fp8 KV cache is refused at engine start with a message that names the flag (until
eviction supports it), instead of failing mid-serving on the first evicting request."""

from __future__ import annotations

import pytest

from vllm_evict.engine.attention import check_cache_dtype

MESSAGE = "vllm-evict does not support an fp8 KV cache yet (--kv-cache-dtype {})"


@pytest.mark.parametrize("dtype", ["auto", "bfloat16", "float16"])
def test_model_dtype_caches_pass(dtype):
    check_cache_dtype(dtype)


@pytest.mark.parametrize("dtype", ["fp8", "fp8_e4m3", "fp8_e5m2"])
def test_fp8_caches_are_refused(dtype):
    with pytest.raises(ValueError, match=MESSAGE.format(dtype).replace("(", r"\(").replace(")", r"\)")):
        check_cache_dtype(dtype)


@pytest.mark.engine
def test_engine_start_refuses_fp8_with_the_flag_named(capfd):
    """A real engine start (CPU, tiny model): the attention backend's check runs before vLLM's own."""
    from vllm_evict.testing.engines import make_llm
    from vllm_evict.testing.tiny_models import ensure_tiny_model

    with pytest.raises(Exception):
        make_llm(ensure_tiny_model("llama"), kv_cache_dtype="fp8")
    out, err = capfd.readouterr()
    assert MESSAGE.format("fp8") in out + err
    assert "start with --kv-cache-dtype auto" in out + err
