"""Engine construction shared by tests, benchmarks and examples (CPU-friendly defaults)."""

from __future__ import annotations

from typing import Any

import torch

CPU_DEFAULTS: dict[str, Any] = dict(
    dtype="float32",              # bf16 takes slow fallback paths on AVX2 CPUs
    block_size=16,
    max_model_len=2048,
    kv_cache_memory_bytes=1 << 30,
    max_num_batched_tokens=256,   # small chunks: long prompts exercise chunked prefill
    max_num_seqs=32,
    seed=0,
)


def gpu_defaults() -> dict[str, Any]:
    """What a GPU engine of the tests and benchmarks needs where FlashInfer is not installed (the project's
    GPU machine): vLLM's Triton Gated DeltaNet prefill, where on Hopper it would pick FlashInfer's."""
    import importlib.util

    if not torch.cuda.is_available() or importlib.util.find_spec("flashinfer") is not None:
        return {}
    return dict(gdn_prefill_backend="triton")


def make_llm(model: str, **overrides: Any):
    """A `vllm.LLM` with the vllm-evict plugin's engine kwargs; CPU defaults when no GPU is present."""
    from vllm import LLM

    from vllm_evict.engine import engine_kwargs

    kwargs = dict(CPU_DEFAULTS) if not torch.cuda.is_available() else gpu_defaults()
    kwargs.update(overrides)
    return LLM(**engine_kwargs(model=str(model), **kwargs))
