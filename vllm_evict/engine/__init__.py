"""All coupling to vLLM internals lives in this package (a vLLM upgrade touches only this)."""

from __future__ import annotations

from typing import Any

from vllm_evict.engine.request_config import EXTRA_ARGS_KEY


def engine_kwargs(**user_kwargs: Any) -> dict[str, Any]:
    """Engine keyword arguments for `vllm.LLM(...)` / `AsyncEngineArgs(...)` with the eviction plugin on.

    User-supplied values win, except the scheduler class which the plugin needs.
    """
    from vllm_evict._version_check import check_vllm_version

    check_vllm_version()
    kwargs = dict(user_kwargs)
    import torch

    # The CPU platform forces synchronous scheduling; GPU keeps vLLM's async scheduler.
    async_default = torch.cuda.is_available() and kwargs.get("async_scheduling", True) is not False
    if torch.cuda.is_available():
        kwargs.setdefault("attention_backend", attention_backend(str(kwargs.get("kv_cache_dtype") or "auto")))
    kwargs.setdefault("scheduler_cls", "vllm_evict.engine.scheduler."
                      + ("AsyncEvictionScheduler" if async_default else "EvictionScheduler"))
    return kwargs


# The CUDA attention backends vllm-evict evicts through (engine/cuda_backend.py, engine/triton_backend.py,
# engine/turboquant_backend.py)
EVICTING_BACKENDS = ("FLASH_ATTN", "TRITON_ATTN", "TURBOQUANT")


def attention_backend(kv_cache_dtype: str) -> str | None:
    """The backend a CUDA engine evicts through for this KV cache dtype: vLLM's Triton backend for its
    per-token-head caches (the only backend that reads them); for a TurboQuant cache none is named, so that
    vLLM picks TURBOQUANT for its quantized layers and FlashAttention for the boundary layers it keeps in the
    model dtype (engine/turboquant_backend.py); FlashAttention for every other."""
    from vllm.v1.kv_cache_interface import kv_cache_uses_per_token_head_scales

    from vllm_evict.engine.layout import is_turboquant

    if is_turboquant(kv_cache_dtype):
        return None
    return "TRITON_ATTN" if kv_cache_uses_per_token_head_scales(kv_cache_dtype) else "FLASH_ATTN"


def eviction_report(request_output: Any) -> dict[str, Any] | None:
    """What eviction did to a finished request (see docs/ARCHITECTURE.md), or None if it did not evict."""
    params = getattr(request_output, "kv_transfer_params", None) or {}
    report = params.get(EXTRA_ARGS_KEY) if isinstance(params, dict) else None
    return dict(report) if report else None
