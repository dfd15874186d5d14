"""Eviction with speculative decoding (vLLM's n-gram drafter, 4 draft tokens) on CPU: a decode step carries
draft tokens that the target may reject, so the step that would reach a decode point stops a token short
and a step of one verified token reaches it (DESIGN.md §4.8 g). Greedy speculation is lossless, so every
request's tokens equal the reference's replay of the same points as without speculation: one-shot,
block-wise and decode-budget requests, uniform and Ada-KV, in one batch with a plain request, while the
drafter proposes tokens the target both accepts and rejects. Also with vLLM's dynamic speculation
(`num_speculative_tokens_per_batch_size`: fewer or no drafts at larger batches, where eviction runs them),
whose draft count changes as the batch's requests finish. One engine for each."""

from __future__ import annotations

import contextlib

import pytest

from tests.engine.inprocess import inprocess_llm
from tests.engine.test_eviction import check_against_reference, params, random_prompt, scheduler_of

pytestmark = pytest.mark.engine

PAGE = 16
MAX_TOKENS = 150  # decode points every 32 generated tokens: 4 of them
CASES = [
    {"policy": "snapkv", "budget": 0.3},
    {"policy": "keydiff", "budget": 0.3, "chunked": True, "chunk_size": 64},
    {"policy": "dropkv", "decode_budget": 48, "decode_every": 32},
    {"policy": "snapkv", "decode_budget": 48, "decode_every": 32, "allocation": "adakv"},
    {"policy": "tova", "budget": 0.5, "decode_budget": 64, "decode_every": 32, "allocation": "adakv"},
]


NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 2}
# 4 drafts a step at batches of 1-2, none at 3-4, 2 at 5 and more: the test's 6 requests pass through all three
DYNAMIC = {**NGRAM, "num_speculative_tokens_per_batch_size": [[1, 2, 4], [3, 4, 0], [5, 1024, 2]]}


@pytest.fixture(scope="module", params=[NGRAM, DYNAMIC], ids=["fixed", "dynamic"])
def engine(tiny_llama, request):
    speculation = request.param
    with inprocess_llm(tiny_llama, block_size=PAGE, max_model_len=1280, max_num_batched_tokens=256,
                       speculative_config=speculation, disable_log_stats=False) as llm:
        yield llm


@contextlib.contextmanager
def drafts_per_step(llm):
    """Records (requests, drafts a request) of every step the engine's scheduler schedules tokens in."""
    scheduler = scheduler_of(llm)
    steps = []

    def schedule(*args, **kwargs):
        output = type(scheduler).schedule(scheduler, *args, **kwargs)
        if output.num_scheduled_tokens:
            steps.append((len(output.num_scheduled_tokens), output.num_spec_tokens_to_schedule))
        return output

    scheduler.schedule = schedule
    try:
        yield steps
    finally:
        del scheduler.schedule


def check_draft_schedule(llm, steps: list[tuple[int, int]], configured: int, dynamic_counts: set[int]) -> None:
    """Every step drafted as the engine's dynamic schedule says for its batch size (`configured` drafts where no
    range of it covers the batch, or without one), and a dynamic schedule's run passed through dynamic_counts."""
    schedule_of = llm.llm_engine.vllm_config.speculative_config.num_speculative_tokens_per_batch_size
    expected = {n: next((k for lo, hi, k in schedule_of or [] if lo <= n <= hi), configured) for n, _ in steps}
    assert all(k == expected[n] for n, k in steps), sorted(set(steps))
    if schedule_of:  # the batch passed through steps with drafts and without
        assert dynamic_counts <= {k for _, k in steps}, sorted(set(steps))


def spec_counters(engine) -> dict[str, float]:
    return {m.name: m.value for m in engine.get_metrics()
            if m.name in ("vllm:spec_decode_num_draft_tokens", "vllm:spec_decode_num_accepted_tokens")}


def test_eviction_with_speculative_decoding_follows_the_reference(engine, reference):
    from vllm_evict.engine.request_config import parse_request

    prompt = (random_prompt(7, 40) * 6)[:230]  # repeated text: the n-gram drafter finds matches
    before = spec_counters(engine)
    requests = [None, *CASES]
    with drafts_per_step(engine) as steps:
        outputs = engine.generate([{"prompt_token_ids": prompt}] * len(requests),
                                  [params(c, MAX_TOKENS) for c in requests])
    check_draft_schedule(engine, steps, configured=4, dynamic_counts={0, 2})
    after = spec_counters(engine)
    drafted = after["vllm:spec_decode_num_draft_tokens"] - before.get("vllm:spec_decode_num_draft_tokens", 0)
    accepted = after["vllm:spec_decode_num_accepted_tokens"] - before.get("vllm:spec_decode_num_accepted_tokens", 0)
    assert 0 < accepted < drafted, (accepted, drafted)  # drafts both accepted and rejected

    check_against_reference(outputs[0], reference.generate(prompt, MAX_TOKENS), "no eviction")
    for case, out in zip(CASES, outputs[1:]):
        expected = reference.replay(prompt, MAX_TOKENS, parse_request({"vllm_evict": case}), page_size=PAGE)
        check_against_reference(out, expected, str(case))
        report = out.kv_transfer_params["vllm_evict"]
        if "decode_budget" in case:
            assert report["decode_compactions"] == 4 and report["decode_blocks_freed"] > 0, (case, report)
    pool = scheduler_of(engine).kv_cache_manager.block_pool
    assert pool.get_num_free_blocks() == pool.num_gpu_blocks - 1 and not scheduler_of(engine).evictions
