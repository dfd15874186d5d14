"""Preemption under KV pressure: a compacted request that is preempted is recomputed, evicts again at the
same point and still matches the independent reference; no block leaks. Own engine with a tiny KV cache."""

from __future__ import annotations

import pytest
import torch

from tests.engine.inprocess import inprocess_llm

pytestmark = pytest.mark.engine

PAGE = 16


@pytest.fixture(scope="module")
def small_engine(tiny_llama):
    # 72 blocks = 1152 tokens: three 400-token prompts cannot all stay resident without eviction.
    with inprocess_llm(tiny_llama, block_size=PAGE, num_gpu_blocks_override=72, max_model_len=1024,
                       max_num_batched_tokens=128) as llm:
        yield llm


def test_preempted_requests_match_reference_and_free_all_blocks(small_engine, tiny_llama):
    from vllm import SamplingParams

    from vllm_evict.policies import EvictionConfig
    from vllm_evict.testing.reference import ReferenceDecoder

    scheduler = small_engine.llm_engine.engine_core.engine_core.scheduler
    pool = scheduler.kv_cache_manager.block_pool
    idle_free = pool.get_num_free_blocks()
    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(3, 1000, (400,), generator=g).tolist() for _ in range(4)]
    cases = [{"policy": "snapkv", "budget": 0.25, "allocation": "adakv"}, {"policy": "dropkv", "budget": 0.25},
             None, {"policy": "keydiff", "budget": 0.5}]
    params = [SamplingParams(temperature=0, max_tokens=120, ignore_eos=True,
                             extra_args={"vllm_evict": c} if c else None) for c in cases]
    outputs = small_engine.generate([{"prompt_token_ids": p} for p in prompts], params)
    stats = small_engine.llm_engine.engine_core.engine_core.scheduler
    assert pool.get_num_free_blocks() == idle_free
    assert not stats.evictions
    reference = ReferenceDecoder(tiny_llama)
    for prompt, case, out in zip(prompts, cases, outputs):
        config = EvictionConfig.from_dict(case) if case else None
        expected = reference.generate(prompt, 120, config, page_size=PAGE)
        assert list(out.outputs[0].token_ids) == expected.token_ids, case


def test_pressure_caused_preemption(small_engine):
    """Guard that the scenario above really preempts (otherwise it proves nothing about recompute)."""
    from vllm import SamplingParams

    llm_engine = small_engine.llm_engine
    scheduler = llm_engine.engine_core.engine_core.scheduler
    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(3, 1000, (400,), generator=g).tolist() for _ in range(4)]
    cases = [{"policy": "snapkv", "budget": 0.25, "allocation": "adakv"}, {"policy": "dropkv", "budget": 0.25},
             None, {"policy": "keydiff", "budget": 0.5}]
    for i, (p, c) in enumerate(zip(prompts, cases)):
        llm_engine.add_request(f"p{i}", {"prompt_token_ids": p},
                               SamplingParams(temperature=0, max_tokens=120, ignore_eos=True,
                                              extra_args={"vllm_evict": c} if c else None))
    preemptions = 0
    while llm_engine.has_unfinished_requests():
        llm_engine.step()
        preemptions = max(preemptions, sum(r.num_preemptions for r in list(scheduler.running) + list(scheduler.waiting)))
    assert preemptions > 0
