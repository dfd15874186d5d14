"""`vllm.general_plugins` entry point: runs once in every vLLM process (API, EngineCore, workers)."""

from __future__ import annotations

import os

_registered = False


def register() -> None:
    global _registered
    if _registered:
        return
    _registered = True
    from vllm_evict._version_check import check_vllm_version

    check_vllm_version()
    from vllm_evict.engine import surface

    surface.check("engine")  # before any hook: refuse a vLLM whose patched internals changed shape

    # The runner hooks target vLLM's V1 GPU model runner (the CPU runner is V1 too).
    os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "0")
    from vllm.platforms import current_platform
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    if current_platform.is_cpu():
        register_backend(AttentionBackendEnum.CPU_ATTN, "vllm_evict.engine.cpu_backend.EvictCPUAttentionBackend")
    elif current_platform.is_cuda():
        register_backend(AttentionBackendEnum.FLASH_ATTN,
                         "vllm_evict.engine.cuda_backend.EvictFlashAttentionBackend")
        register_backend(AttentionBackendEnum.TRITON_ATTN,  # vLLM's backend for per-token-head caches
                         "vllm_evict.engine.triton_backend.EvictTritonAttentionBackend")
        register_backend(AttentionBackendEnum.TURBOQUANT,  # vLLM's backend for TurboQuant caches
                         "vllm_evict.engine.turboquant_backend.EvictTurboQuantAttentionBackend")
        _install_triton_scoring()
    from vllm_evict.engine.runner_hooks import install_runner_hooks

    install_runner_hooks()
    _install_request_validation()
    _allow_prompts_beyond_kv_cache()
    import sys

    if "vllm.entrypoints.openai.api_server" in sys.modules:  # the API process of `vllm serve`
        from vllm_evict.engine.openai_api import install_serving_hooks

        install_serving_hooks()


def _install_triton_scoring() -> None:
    """Raw scores on CUDA go through the fused Triton kernels: query-based policies
    (kernels/window_scores.py), KeyDiff and K-norm (kernels/key_scores.py)."""
    from vllm_evict.kernels.window_scores import has_triton, window_scores

    from vllm_evict.policies import register_key_kernel, register_raw_kernel

    if has_triton():
        from vllm_evict.kernels.key_scores import key_scores

        register_raw_kernel(window_scores)
        register_key_kernel(key_scores)


def _install_request_validation() -> None:
    """Resolve every request's eviction once, in the API process: bad parameters are rejected there (a 400
    from the OpenAI server, a ValueError from `LLM.generate`), and the engine core receives the canonical
    nested form with the defaults applied (request_config.resolve_request). A request that could never fit
    the KV cache, even alone, is refused there too, once the prompt is tokenized and the cache size known
    (scheduler.never_fit_reason; the scheduler keeps the same check for requests that bypass this)."""
    from vllm.v1.engine.input_processor import InputProcessor

    from vllm_evict.engine.layout import check_on_engine
    from vllm_evict.engine.request_config import parse_request, resolve_request

    if getattr(InputProcessor, "_vllm_evict_validates", False):
        return
    original_validate, original_process = InputProcessor._validate_params, InputProcessor.process_inputs

    def _validate_params(self, params, *args, **kwargs):
        original_validate(self, params, *args, **kwargs)
        if hasattr(params, "extra_args"):  # SamplingParams (pooling requests have no eviction)
            params.extra_args = resolve_request(params.extra_args)
            spec = parse_request(params.extra_args)
            if spec is not None:
                check_on_engine(spec, self.vllm_config)

    def process_inputs(self, *args, **kwargs):
        request = original_process(self, *args, **kwargs)
        num_prompt = (len(request.prompt_token_ids) if request.prompt_token_ids is not None
                      else len(request.prompt_embeds))
        reason = never_fits(self.vllm_config, num_prompt, request.sampling_params)
        if reason is not None:
            raise ValueError(reason)
        return request

    InputProcessor._validate_params = _validate_params
    InputProcessor.process_inputs = process_inputs
    InputProcessor._vllm_evict_validates = True
    _record_each_engine_s_cache()


def _record_each_engine_s_cache() -> None:
    """The engine client adds each engine's KV cache blocks to `cache_config.num_gpu_blocks` as the engines
    report ready (summed under data parallelism); keep each engine's own count too, so that the API process
    refuses what no engine could hold (`never_fits`), not what only the sum could."""
    from vllm.v1.engine.core_client import MPClient

    original = MPClient._apply_ready_response

    def _apply_ready_response(self, payload):
        cache = self.vllm_config.cache_config
        before = cache.num_gpu_blocks or 0
        original(self, payload)
        if payload and cache.num_gpu_blocks:
            cache.vllm_evict_engine_blocks = [*getattr(cache, "vllm_evict_engine_blocks", []),
                                              cache.num_gpu_blocks - before]

    MPClient._apply_ready_response = _apply_ready_response


def never_fits(vllm_config, num_prompt: int, params) -> str | None:
    """Why a request of `num_prompt` tokens could never fit the KV cache, even alone (scheduler.never_fit_reason),
    as far as this process knows the cache: None before the engines started. Under data parallelism the
    largest engine's cache counts (a request that fits none of them), once every engine reported its own;
    the scheduler checks each request again in every case."""
    from vllm_evict.engine.request_config import parse_request
    from vllm_evict.engine.scheduler import kv_head_groups, never_fit_reason, plan_eviction

    cache = vllm_config.cache_config
    blocks = cache.num_gpu_blocks
    if vllm_config.parallel_config.data_parallel_size > 1:
        engines = getattr(cache, "vllm_evict_engine_blocks", [])
        blocks = max(engines) if len(engines) == vllm_config.parallel_config.data_parallel_size else None
    if params is None or not blocks:
        return None
    spec = parse_request(params.extra_args)
    ev = None if spec is None else plan_eviction(spec, num_prompt, cache.block_size, kv_head_groups(vllm_config))
    return never_fit_reason(num_prompt + params.max_tokens, cache.block_size, blocks, ev)


def _allow_prompts_beyond_kv_cache() -> None:
    """vLLM refuses to start when one --max-model-len sequence does not fit the KV cache. Block-wise
    eviction (chunked=true) holds at most P_c + chunk/block_size blocks whatever its prompt, so with
    $VLLM_EVICT_ALLOW_LONG_PROMPTS set (read when the engine starts) that refusal becomes a warning; the
    scheduler fails, at arrival, each request that could never fit the cache even alone
    (scheduler.peak_blocks)."""
    from vllm.logger import init_logger
    from vllm.v1.core import kv_cache_utils

    from vllm_evict.engine.request_config import LONG_PROMPTS_ENV, long_prompts_allowed

    if getattr(kv_cache_utils, "_vllm_evict_long_prompts", False):
        return
    original = kv_cache_utils._check_enough_kv_cache_memory
    logger = init_logger(__name__)

    def _check_enough_kv_cache_memory(available_memory, get_needed_memory, max_model_len, estimate_max_model_len):
        if not long_prompts_allowed():
            return original(available_memory, get_needed_memory, max_model_len, estimate_max_model_len)
        original(available_memory, lambda: 0, max_model_len, estimate_max_model_len)  # no cache at all: refused
        if get_needed_memory() > available_memory:
            logger.warning("vllm-evict (%s): --max-model-len %d does not fit the KV cache (about %d tokens); "
                           "longer requests run only if they evict block-wise (chunked=true), others "
                           "that cannot fit fail with an error", LONG_PROMPTS_ENV, max_model_len,
                           estimate_max_model_len(available_memory))

    kv_cache_utils._check_enough_kv_cache_memory = _check_enough_kv_cache_memory
    kv_cache_utils._vllm_evict_long_prompts = True
