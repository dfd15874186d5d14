"""`vllm.general_plugins` entry point: runs once in every vLLM process (API, EngineCore, workers)."""

from __future__ import annotations

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
    import os

    # The runner hooks target vLLM's V1 GPU model runner (the CPU runner is V1 too).
    os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "0")
    from vllm.platforms import current_platform
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    if current_platform.is_cpu():
        register_backend(AttentionBackendEnum.CPU_ATTN, "vllm_evict.engine.cpu_backend.EvictCPUAttentionBackend")
    elif current_platform.is_cuda():
        register_backend(AttentionBackendEnum.FLASH_ATTN,
                         "vllm_evict.engine.cuda_backend.EvictFlashAttentionBackend")
        _install_triton_scoring()
    from vllm_evict.engine.worker import install_runner_hooks

    install_runner_hooks()
    _install_request_validation()
    import sys

    if "vllm.entrypoints.openai.api_server" in sys.modules:  # the API process of `vllm serve`
        from vllm_evict.engine.serving import install_serving_hooks

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
    nested form with the defaults applied (request_config.resolve_request)."""
    from vllm.v1.engine.input_processor import InputProcessor

    from vllm_evict.engine.request_config import resolve_request

    if getattr(InputProcessor, "_vllm_evict_validates", False):
        return
    original = InputProcessor._validate_params

    def _validate_params(self, params, *args, **kwargs):
        original(self, params, *args, **kwargs)
        if hasattr(params, "extra_args"):  # SamplingParams (pooling requests have no eviction)
            params.extra_args = resolve_request(params.extra_args)

    InputProcessor._validate_params = _validate_params
    InputProcessor._vllm_evict_validates = True
