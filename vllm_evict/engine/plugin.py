"""`vllm.general_plugins` entry point: runs once in every vLLM process (API, EngineCore, workers)."""

from __future__ import annotations

_registered = False


def register() -> None:
    global _registered
    if _registered:
        return
    from vllm_evict._version_check import check_vllm_version

    check_vllm_version()
    _registered = True
