"""The engine-start warm-up runs the engine's own compaction path (worker.compact_one) for every policy and
allocation: every layer of every state is compacted to P pages per head on average (DESIGN.md §3), on the CPU
backend's cache adapter and, on a GPU, on the CUDA ones: at the head shapes and page sizes of the models served,
and on the per-token-head quantized caches."""

from __future__ import annotations

import pytest
import torch

from vllm_evict.policies import ALLOCATIONS, POLICIES


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU vLLM's cache ops; on CUDA the tests below run")
@pytest.mark.parametrize("requests, prompt_blocks", [(1, 16), (3, 7)])
def test_warm_up_compacts_every_policy_and_allocation(requests, prompt_blocks):
    """The engine's warm-up (one 16-block prompt), and batches of other lengths as the GPU test below runs."""
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    from vllm_evict.engine.cpu_backend import CpuPagedCache
    from vllm_evict.engine.warm_up import warm_up

    num_kv, page = 2, 16
    isa = _get_attn_isa(torch.float32, page, 32)
    states = warm_up(lambda kv: CpuPagedCache(kv, isa, 1.0, 1.0, "auto"), torch.device("cpu"), 8, num_kv, 32,
                     torch.float32, page, prompt_blocks=prompt_blocks, requests=requests)
    check_compacted(states, num_kv, page, requests)


# (query heads, KV heads, head_dim, page): Llama-3.1-8B; GPT-OSS-20B; Gemma-3-12B; Qwen3-Next-80B-A3B, whose
# attention page vLLM sizes to one layer's Gated DeltaNet state
SERVED_SHAPES = {"llama-3.1-8b": (32, 8, 128, 16), "gpt-oss-20b": (64, 8, 64, 16), "gemma-3-12b": (16, 8, 256, 16),
                 "qwen3-next": (16, 2, 256, 544)}


@pytest.mark.gpu
@pytest.mark.parametrize("model", SERVED_SHAPES)
def test_warm_up_on_cuda_at_served_head_shapes(model):
    from vllm_evict.engine.cuda_backend import CudaPagedCache, query_dtype
    from vllm_evict.engine.warm_up import warm_up

    num_q, num_kv, head_dim, page = SERVED_SHAPES[model]
    one = torch.ones((), dtype=torch.float32, device="cuda")
    states = warm_up(lambda kv: CudaPagedCache(kv, head_dim, "auto", one, one, one, torch.bfloat16),
                     torch.device("cuda"), num_q, num_kv, head_dim, torch.bfloat16, page,
                     query_dtype("auto", torch.bfloat16))
    check_compacted(states, num_kv, page)


@pytest.mark.gpu
def test_nothing_compiles_after_the_warm_up():
    """After the engine-start warm-up, batches of decode points at other lengths and batch sizes (2 and 15
    requests of 72 blocks, the reasoning shape's points) compile no Triton kernel: no request pays a compile."""
    import triton

    from vllm_evict.engine.cuda_backend import CudaPagedCache, query_dtype
    from vllm_evict.engine.warm_up import warm_up

    num_q, num_kv, head_dim, page = SERVED_SHAPES["llama-3.1-8b"]
    one = torch.ones((), dtype=torch.float32, device="cuda")
    shape = (lambda kv: CudaPagedCache(kv, head_dim, "auto", one, one, one, torch.bfloat16), torch.device("cuda"),
             num_q, num_kv, head_dim, torch.bfloat16, page, query_dtype("auto", torch.bfloat16))
    warm_up(*shape)
    compiled, hook = [], triton.knobs.runtime.jit_post_compile_hook
    triton.knobs.runtime.jit_post_compile_hook = lambda **info: compiled.append(info["repr"])
    try:
        for requests in (2, 15):
            check_compacted(warm_up(*shape, prompt_blocks=72, requests=requests), num_kv, page, requests)
    finally:
        triton.knobs.runtime.jit_post_compile_hook = hook
    assert not compiled, "compiled after the warm-up:\n" + "\n".join(compiled)


@pytest.mark.gpu
@pytest.mark.parametrize("cache_dtype", ["int8_per_token_head", "fp8_per_token_head", "int4_per_token_head"])
def test_warm_up_on_cuda_per_token_head_caches(cache_dtype):
    """The Triton backend's caches (Llama-3.1-8B's heads): the warm-up compacts their bytes as 32-bit words."""
    from vllm_evict.engine.triton_backend import PerTokenHeadPagedCache
    from vllm_evict.engine.warm_up import warm_up

    num_q, num_kv, head_dim, page = SERVED_SHAPES["llama-3.1-8b"]
    states = warm_up(lambda kv: PerTokenHeadPagedCache(kv, head_dim, cache_dtype, torch.bfloat16),
                     torch.device("cuda"), num_q, num_kv, head_dim, torch.bfloat16, page, torch.bfloat16, cache_dtype)
    check_compacted(states, num_kv, page)


@pytest.mark.gpu
@pytest.mark.parametrize("cache_dtype", ["turboquant_k8v4", "turboquant_4bit_nc", "turboquant_k3v4_nc",
                                         "turboquant_3bit_nc"])
def test_warm_up_on_cuda_turboquant_caches(cache_dtype):
    """TurboQuant's caches (Llama-3.1-8B's heads), written by vLLM's store: the warm-up moves their slots as bytes."""
    from vllm_evict.engine.turboquant_backend import TurboQuantPagedCache
    from vllm_evict.engine.warm_up import warm_up

    num_q, num_kv, head_dim, page = SERVED_SHAPES["llama-3.1-8b"]
    states = warm_up(lambda kv: TurboQuantPagedCache(kv, head_dim, cache_dtype, torch.bfloat16),
                     torch.device("cuda"), num_q, num_kv, head_dim, torch.bfloat16, page, torch.bfloat16, cache_dtype)
    check_compacted(states, num_kv, page)


def check_compacted(states, num_kv: int, page: int, requests: int = 1) -> None:
    assert len(states) == requests * len(POLICIES) * len(ALLOCATIONS)
    assert {s.spec.config.policy for s in states} == set(POLICIES)
    assert any(s.spec.config.allocation == "adakv" for s in states)
    for state in states:
        assert sorted(state.layers) == [0, 1]
        again = state.spec.config.allocation == "adakv"  # then compacted again at a decode point, in place
        assert state.done == (2 if again else 0)
        for layer in state.layers.values():
            assert int(layer.page_counts.sum()) == state.pages * num_kv  # P_d = P here
            expected = torch.clamp(layer.page_counts * page, max=state.evict_at)
            if again:  # a head that keeps all it held ends in a partly filled page
                assert (layer.kept <= expected).all() and (layer.kept > expected - page).all()
            else:
                assert torch.equal(layer.kept, expected), (state.spec.config.policy, state.spec.config.allocation)
