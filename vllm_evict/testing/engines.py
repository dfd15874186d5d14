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


def make_llm(model: str, **overrides: Any):
    """A `vllm.LLM` with the vllm-evict plugin's engine kwargs; CPU defaults when no GPU is present."""
    from vllm import LLM

    from vllm_evict.engine import engine_kwargs

    kwargs = dict(CPU_DEFAULTS) if not torch.cuda.is_available() else {}
    kwargs.update(overrides)
    return LLM(**engine_kwargs(model=str(model), **kwargs))
