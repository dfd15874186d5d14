"""Kernel warm-up at engine start: the compaction path runs once for every policy and allocation, so that no
request pays a Triton compile (docs/OPERATIONS.md)."""

from __future__ import annotations

import time

import torch
from vllm.logger import init_logger
from vllm.utils.torch_utils import is_quantized_kv_cache

from vllm_evict.engine.compaction import compaction_batches, token_head_bytes
from vllm_evict.engine.request_config import RequestEviction
from vllm_evict.engine.request_state import WorkerEviction, kept_most
from vllm_evict.engine.worker import compact_one

logger = init_logger(__name__)


def warm_up_scoring(runner) -> None:
    """At engine start (vLLM's kernel warm-up, CUDA only): compile every kernel of the compaction path
    before the first request, for the engine's cache dtype (docs/OPERATIONS.md)."""
    if runner.device.type != "cuda":
        return
    from vllm_evict.engine.cuda_backend import query_dtype
    from vllm_evict.engine.hnd_cache import paged_cache

    model, parallel, cache_dtype = runner.model_config, runner.parallel_config, runner.cache_config.cache_dtype
    head_dim = model.get_head_size()
    one = torch.ones((), dtype=torch.float32, device=runner.device)  # the layers' default k/v/q scales

    def make_cache(dtype: str):
        return lambda kv_cache: paged_cache(kv_cache, head_dim, dtype, model.dtype, one, one, one)

    # layers vLLM keeps in the model dtype beside quantized ones (TurboQuant's boundary layers) compact too
    dtypes = [cache_dtype] + (["auto"] if runner.cache_config.kv_cache_dtype_skip_layers else [])
    # the kernels' modules and local memory come from the device's free memory, outside vLLM's profile
    logger.info("vllm-evict: loading the scoring kernels (%.2f GiB device memory free)",
                torch.cuda.mem_get_info(runner.device)[0] / 2**30)
    start = time.perf_counter()
    for dtype in dtypes:
        warm_up(make_cache(dtype), runner.device, model.get_num_attention_heads(parallel),
                model.get_num_kv_heads(parallel), head_dim, model.dtype, runner.cache_config.block_size,
                query_dtype(dtype, model.dtype), dtype)
    logger.info("vllm-evict: scoring kernels ready in %.1f s (%.2f GiB device memory free)",
                time.perf_counter() - start, torch.cuda.mem_get_info(runner.device)[0] / 2**30)


def scratch_cache(cache_dtype: str, num_blocks: int, num_kv_heads: int, page: int, head_dim: int,
                  dtype: torch.dtype, device: torch.device, gen: torch.Generator) -> torch.Tensor:
    """A layer's KV cache as vLLM lays it out for `cache_dtype` (HND), holding finite values: random ones of
    the model dtype, their fp8 bytes, per-token-head data with a scale of 1/64 after each half, or random
    keys and values written by vLLM's TurboQuant store."""
    from vllm_evict.engine.layout import is_turboquant
    from vllm_evict.engine.turboquant_backend import EvictTurboQuantAttentionBackend, store

    if is_turboquant(cache_dtype):  # (not a "quantized" cache to vLLM's is_quantized_kv_cache)
        shape = EvictTurboQuantAttentionBackend.get_kv_cache_shape(num_blocks, page, num_kv_heads, head_dim,
                                                                   cache_dtype)
        cache = torch.zeros(shape, dtype=torch.uint8, device=device)
        keys, values = torch.randn(2, num_blocks * page, num_kv_heads, head_dim, generator=gen, device=device)
        store(cache, keys.to(dtype), values.to(dtype), torch.arange(num_blocks * page, device=device), cache_dtype)
        return cache
    if not is_quantized_kv_cache(cache_dtype):
        return torch.randn(num_blocks, num_kv_heads, page, 2 * head_dim, generator=gen, device=device).to(dtype)
    from vllm.v1.attention.backends.triton_attn import TritonAttentionBackend
    from vllm.v1.kv_cache_interface import kv_cache_uses_per_token_head_scales

    if not kv_cache_uses_per_token_head_scales(cache_dtype):  # per-layer fp8
        values = torch.randn(num_blocks, num_kv_heads, page, 2 * head_dim, generator=gen, device=device)
        return values.to(torch.float8_e4m3fn).view(torch.uint8)
    shape = TritonAttentionBackend.get_kv_cache_shape(num_blocks, page, num_kv_heads, head_dim, cache_dtype)
    halves = torch.randint(0, 120, (*shape[:-1], 2, shape[-1] // 2), generator=gen, device=device, dtype=torch.uint8)
    halves[..., -4:] = torch.tensor([1 / 64], device=device).view(torch.uint8)  # the fp32 scales
    return halves.flatten(-2)


def warm_up(make_cache, device: torch.device, num_q_heads: int, num_kv_heads: int, head_dim: int,
            dtype: torch.dtype, page: int, q_dtype: torch.dtype | None = None, cache_dtype: str = "auto",
            prompt_blocks: int = 16, requests: int = 1) -> list[WorkerEviction]:
    """Run the engine's compaction path (compact_one) for every policy and allocation once on `requests` prompts
    of `prompt_blocks` pages compacted together, in two scratch layers of this head shape (make_cache: the
    backend's paged-cache adapter of a layer's cache as vLLM lays it out for `cache_dtype`, model dtype `dtype`),
    so that every kernel is compiled with the argument types the engine passes (none specialises on a length,
    a batch size, the layer count or a view's offset: tests/kernels/test_compiled_variants.py); window queries
    of `q_dtype` (default: dtype). Ada-KV states then compact again in place at a decode point, the path that
    scores uneven heads. Returns the compacted states."""
    from vllm_evict.policies import ALLOCATIONS, POLICIES
    from vllm_evict.policies.config import EvictionConfig

    gen = torch.Generator(device=device).manual_seed(0)
    n, span = prompt_blocks * page, 2 * prompt_blocks  # a request's prompt blocks and as many fresh ones (P < span/2)

    layers = [(i, make_cache(scratch_cache(cache_dtype, span * requests, num_kv_heads, page, head_dim, dtype,
                                           device, gen))) for i in range(2)]
    bytes_per_token_head = token_head_bytes(layers)
    states = []
    for policy in POLICIES:
        for allocation in ALLOCATIONS:
            config = EvictionConfig.from_dict({"policy": policy, "budget": 4 * page, "allocation": allocation})
            again = config.allocation == "adakv"
            spec = RequestEviction(config, decode_budget=4 * page if again else None, decode_every=page)
            window, pages = config.window_size(), config.num_pages(n, page)
            batch = [WorkerEviction.for_prompt(f"warm-up-{r}", spec, n, page,
                                               prompt_block_ids=list(range(r * span, r * span + prompt_blocks)),
                                               fresh_blocks=list(range(r * span + prompt_blocks,
                                                                       r * span + prompt_blocks + pages)))
                     for r in range(requests)]
            for _ in range(2 if again else 1):
                if window:
                    for state in batch:
                        state.q_window = torch.randn(len(layers), window, num_q_heads, head_dim, generator=gen,
                                                     device=device).to(q_dtype or dtype)
                # as the engine batches them
                for together in compaction_batches(batch, len(layers), num_kv_heads, bytes_per_token_head):
                    compact_one(together, layers, head_dim ** -0.5)
                if again:  # next: the decode point one page later, in place over the layout and that page
                    kept_most(batch)
                    for state in batch:
                        state.advance()
                        first = state.fresh_blocks[0]
                        state.prompt_block_ids = list(range(first, first + pages + 1))
                        state.fresh_blocks = list(range(first, first + -(-state.point.kept // page)))
            states.extend(batch)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return states
