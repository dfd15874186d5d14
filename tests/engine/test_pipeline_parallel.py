"""Pipeline parallelism (`pipeline_parallel_size=2`, CPU worker processes of the tiny Llama's 3 layers):
each stage compacts its own layers at the points the scheduler plans for both. One-shot, block-wise and
decode-budget requests, uniform and Ada-KV, in one batch with plain requests, follow the independent torch
reference (the model and eviction of every layer, in one process), and every block returns to the pool,
after aborts at random steps too. Two engines, one after the other: PP=2 (two workers), and PP=2 x TP=2
(four workers, each holding one KV head of its stage's layers; Ada-KV all-gathers its scores inside each
stage's TP group), which is slow on two cores."""

from __future__ import annotations

import pytest

from tests.engine.hybrid import check_aborts_leak_nothing, idle
from tests.engine.inprocess import inprocess_llm, cpu_workers
from tests.engine.test_eviction import check_against_reference, params, random_prompt

pytestmark = pytest.mark.engine

PAGE = 16
MAX_TOKENS = 100  # decode points at 32, 64 and 96 generated tokens (decode_every 32)
CASES = [
    {"policy": "snapkv", "budget": 0.3},
    {"policy": "dropkv", "budget": 0.25, "allocation": "adakv"},
    {"policy": "keydiff", "budget": 0.3, "chunked": True, "chunk_size": 64},
    {"policy": "dropkv", "decode_budget": 48, "decode_every": 32},
    {"policy": "snapkv", "decode_budget": 48, "decode_every": 32, "allocation": "adakv"},
]


@pytest.fixture(scope="module", params=[1, pytest.param(2, marks=pytest.mark.slow)], ids=["pp2", "pp2xtp2"])
def engine(request, tiny_llama):
    tp = request.param
    with cpu_workers(2 * tp):
        with inprocess_llm(tiny_llama, block_size=PAGE, max_model_len=1280, max_num_batched_tokens=256,
                           pipeline_parallel_size=2, tensor_parallel_size=tp, distributed_executor_backend="mp") as llm:
            config = llm.llm_engine.vllm_config.parallel_config
            assert (config.pipeline_parallel_size, config.tensor_parallel_size) == (2, tp)
            yield llm


def test_every_mode_follows_the_reference_across_stages(engine, reference):
    from vllm_evict.engine.request_config import parse_request

    prompt = random_prompt(3, 300)
    requests = [None, *CASES, None]
    outputs = engine.generate([{"prompt_token_ids": prompt}] * len(requests), [params(c, MAX_TOKENS) for c in requests])
    full = reference.generate(prompt, MAX_TOKENS)
    check_against_reference(outputs[0], full, "no eviction")
    check_against_reference(outputs[-1], full, "no eviction (last)")
    changed = 0
    for case, out in zip(CASES, outputs[1:-1]):
        expected = reference.replay(prompt, MAX_TOKENS, parse_request({"vllm_evict": case}), page_size=PAGE)
        check_against_reference(out, expected, str(case))
        report = out.kv_transfer_params["vllm_evict"]
        key = "decode_blocks_freed" if "decode_budget" in case else "blocks_freed"
        assert report[key] > 0, (case, report)
        changed += expected.token_ids != full.token_ids
    assert changed >= len(CASES) // 2
    assert idle(engine)


def test_aborts_at_random_steps_return_every_block(engine):
    check_aborts_leak_nothing(engine, seed=4, cases=CASES)
