"""Issue 16: eviction at tensor_parallel_size=2 (CPU, two worker processes, tiny GQA Llama with 2 KV heads,
so each rank holds one) against the independent torch reference, which is also what TP=1 produces
(tests/engine/test_eviction.py). One engine for the module, engine core in this process so the block
pool can be read."""

from __future__ import annotations

import pytest

from tests.engine.inprocess import inprocess_llm, two_cpu_workers
from tests.engine.test_eviction import (PAGE, check_against_reference, check_mixed_batch, params, random_prompt,
                                       scheduler_of)

pytestmark = pytest.mark.engine

MAX_TOKENS = 24


@pytest.fixture(scope="module")
def engine(tiny_llama):
    with two_cpu_workers():
        with inprocess_llm(tiny_llama, block_size=PAGE, max_num_batched_tokens=256, tensor_parallel_size=2,
                           distributed_executor_backend="mp") as llm:
            yield llm


def test_uniform_policies_match_reference_in_one_mixed_batch(engine, reference):
    """Uniform allocation keeps each head's own top pages, so TP cannot change it: four policies and two
    budgets, plain requests around them, one prompt longer than a 256-token prefill chunk; tokens equal
    the reference and the block pool is back at idle afterwards."""
    assert engine.llm_engine.vllm_config.parallel_config.tensor_parallel_size == 2
    pool = scheduler_of(engine).kv_cache_manager.block_pool
    idle_free = pool.get_num_free_blocks()
    prompt = random_prompt(11, 450)
    cases = [{"policy": p, "budget": b} for p in ("snapkv", "dropkv", "keydiff", "streaming") for b in (0.25, 64)]
    requests = [None] + cases + [None]
    outputs = engine.generate([{"prompt_token_ids": prompt}] * len(requests),
                              [params(c, MAX_TOKENS) for c in requests])
    check_mixed_batch(outputs, cases, reference, prompt, MAX_TOKENS, label="TP=2 ")
    assert pool.get_num_free_blocks() == idle_free


def test_adakv_allocates_within_each_rank(engine, reference):
    """Ada-KV under TP allocates over the KV heads of each rank (docs/LIMITATIONS.md), not over all heads
    of the layer as at TP=1. With one KV head per rank that is the uniform allocation."""
    from vllm_evict.policies import EvictionConfig

    prompt = random_prompt(12, 400)
    cases = [{"policy": "snapkv", "budget": 0.25, "allocation": "adakv"},
             {"policy": "dropkv", "budget": 0.3, "allocation": "adakv"}]
    outputs = engine.generate([{"prompt_token_ids": prompt}] * len(cases), [params(c, MAX_TOKENS) for c in cases])
    prefill = reference.prefill(prompt)
    for case, out in zip(cases, outputs):
        uniform = dict(case, allocation="uniform")
        expected = reference.generate(prompt, MAX_TOKENS, EvictionConfig.from_dict(uniform), page_size=PAGE,
                                      prefill=prefill)
        check_against_reference(out, expected, f"TP=2 {case} (rank-local = uniform)")
