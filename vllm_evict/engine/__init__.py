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
        kwargs.setdefault("attention_backend", "FLASH_ATTN")
    kwargs.setdefault("scheduler_cls", "vllm_evict.engine.scheduler."
                      + ("AsyncEvictionScheduler" if async_default else "EvictionScheduler"))
    return kwargs


def eviction_report(request_output: Any) -> dict[str, Any] | None:
    """What eviction did to a finished request (see docs/ARCHITECTURE.md), or None if it did not evict."""
    params = getattr(request_output, "kv_transfer_params", None) or {}
    report = params.get(EXTRA_ARGS_KEY) if isinstance(params, dict) else None
    return dict(report) if report else None
