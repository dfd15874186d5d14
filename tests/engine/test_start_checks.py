"""Settings eviction does not support are refused at engine start with a message that names the flag,
instead of failing mid-serving: an fp8 KV cache (issue 21, until eviction supports it) and pipeline
parallelism (issue 16)."""

from __future__ import annotations

import pytest

from vllm_evict.engine.attention import check_cache_dtype, check_pipeline_parallel

MESSAGE = "vllm-evict does not support an fp8 KV cache yet (--kv-cache-dtype {})"
PP_MESSAGE = "vllm-evict does not support pipeline parallelism (--pipeline-parallel-size 2)"


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


def test_pipeline_parallel_is_refused():
    check_pipeline_parallel(1)
    with pytest.raises(ValueError, match=PP_MESSAGE.replace("(", r"\(").replace(")", r"\)")):
        check_pipeline_parallel(2)


@pytest.mark.engine
def test_engine_start_refuses_pipeline_parallel(capfd):
    from tests.engine.inprocess import two_cpu_workers
    from vllm_evict.testing.engines import make_llm
    from vllm_evict.testing.tiny_models import ensure_tiny_model

    with two_cpu_workers(), pytest.raises(Exception):
        make_llm(ensure_tiny_model("llama"), pipeline_parallel_size=2, distributed_executor_backend="mp")
    out, err = capfd.readouterr()
    assert PP_MESSAGE in out + err
