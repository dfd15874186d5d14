"""The hybrid-model engine tests, shared by test_hybrid_gemma3.py, test_hybrid_gpt_oss.py and
test_hybrid_qwen3_next.py, which import the `test_*` functions below and provide the fixtures `engine`
(one per module), `reference` and `exact`: a model with sliding-window or linear-attention layers
beside its full-attention ones evicts the full-attention KV cache group only, and its tokens follow the
independent reference decoder (vllm_evict.testing.reference), which runs the same HF model with attention
it computes itself (sliding window, sinks). Pages are the engine's blocks of the full-attention group (vLLM
sizes them to a linear-attention state's bytes: 48 tokens on the tiny Qwen3-Next).

`exact`: tokens and logprobs equal the reference's (a float32 model). A bf16 model (GPT-OSS on vLLM's CPU
platform) parts from an exact decoder at near-ties, so its tokens are checked by teacher forcing instead:
each engine token, fed to the reference, is within BF16_GAP of the reference's best at every step and
within BF16_MEAN_GAP on average (the tokens of no eviction, fed to an evicting request's reference, fit
it worse than the engine's own wherever they break those bounds; where they do not, that reference cannot
tell the eviction from none: the tiny Qwen3-Next's one full-attention layer among its linear-attention
ones, with a draft, on an AVX2 CPU).
"""

from __future__ import annotations

import random

from tests.engine.test_eviction import check_against_reference, params, random_prompt, scheduler_of

PAGE = 16  # the block size asked for (a model with linear attention gets vLLM's own)
MAX_TOKENS = 24
# logprob gaps of a bf16 engine's tokens under the exact reference. The mean's bound sits between the worst
# evicting request measured (0.143: GPT-OSS with an EAGLE3 draft, SnapKV at 0.5, on an AVX-512 CPU, whose bf16
# kernels differ; 0.11 without the draft) and the tokens of no eviction under that request's reference (0.26
# there; 0.16-0.21 for every case without the draft)
BF16_GAP, BF16_MEAN_GAP = 0.75, 0.15

ONE_SHOT = [{"policy": "snapkv", "budget": 0.25}, {"policy": "snapkv", "budget": 0.25, "allocation": "adakv"},
            {"policy": "keydiff", "budget": 0.3}, {"policy": "tova", "budget": 0.3, "allocation": "adakv"}]


def again(page: int) -> list[dict]:
    """Block-wise and decode-time cases for pages of `page` tokens."""
    return [{"policy": "snapkv", "budget": 0.5, "chunked": True, "chunk_budget": 0.5},  # KeyDiff cuts, then SnapKV's
            {"policy": "keydiff", "budget": 0.5, "chunked": True, "allocation": "adakv", "chunk_budget": 0.5},
            {"policy": "snapkv", "decode_budget": 3 * page, "decode_every": page},
            {"policy": "tova", "budget": 0.5, "decode_budget": 4 * page, "decode_every": page, "allocation": "adakv"}]


def page_of(engine) -> int:
    return scheduler_of(engine).page_size


def spec_of(case: dict):
    from vllm_evict.engine.request_config import parse_request

    return parse_request({"vllm_evict": case})


def check(out, expected_of, exact: bool, label: str, full=None) -> None:
    """out equals the reference (exact), or its tokens stay within the bf16 gaps under teacher forcing;
    expected_of(forced) runs the reference (forced: the tokens to feed, or None for greedy)."""
    if exact:
        check_against_reference(out, expected_of(None), label)
        return
    tokens = list(out.outputs[0].token_ids)
    gaps = expected_of(tokens).gaps
    assert within_bf16(gaps), f"{label}: gaps {gaps}"
    if full is not None and full != tokens:  # the whole cache's tokens fit this eviction's reference worse,
        full_gaps = expected_of(full).gaps   # where that reference tells them apart from its own
        assert within_bf16(full_gaps) or sum(full_gaps) > sum(gaps), (label, sum(full_gaps), sum(gaps))


def within_bf16(gaps: list[float]) -> bool:
    return max(gaps) <= BF16_GAP and sum(gaps) / len(gaps) <= BF16_MEAN_GAP


def idle(engine) -> bool:
    scheduler = scheduler_of(engine)
    pool = scheduler.kv_cache_manager.block_pool
    return pool.get_num_free_blocks() == pool.num_gpu_blocks - 1 and not scheduler.evictions


def check_only_full_attention_is_evicted(engine) -> None:
    """The scheduler compacts the one full-attention group and leaves the sliding-window or linear-attention
    groups alone."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec, SlidingWindowSpec

    scheduler = scheduler_of(engine)
    groups = scheduler.kv_cache_config.kv_cache_groups
    assert scheduler.refusal is None and len(groups) > 1
    evicted = scheduler.kv_cache_manager.group
    assert type(groups[evicted.index].kv_cache_spec) is FullAttentionSpec
    assert all(isinstance(g.kv_cache_spec, (SlidingWindowSpec, MambaSpec)) for i, g in enumerate(groups)
               if i != evicted.index)
    assert scheduler.page_size == groups[evicted.index].kv_cache_spec.block_size


def check_one_shot_mixed_batch(engine, reference, exact: bool, seed: int = 0) -> None:
    """[plain, 100% budget] + one-shot cases + [plain] on one prompt (longer than a prefill chunk and than
    the sliding window): plain and 100% runs give the tokens of no eviction; every case follows the
    reference, frees blocks of the full-attention group only, and the pool returns to idle."""
    prompt, page = random_prompt(seed, 300), page_of(engine)
    requests = [None, {"policy": "snapkv", "budget": 1.0}, *ONE_SHOT, None]
    outputs = engine.generate([{"prompt_token_ids": prompt}] * len(requests), [params(c, MAX_TOKENS) for c in requests])
    prefill = reference.prefill(prompt)
    full = reference.generate(prompt, MAX_TOKENS, prefill=prefill)
    plain = list(outputs[0].outputs[0].token_ids)
    def no_eviction(forced):
        return reference.generate(prompt, MAX_TOKENS, prefill=prefill, forced=forced)

    check(outputs[0], no_eviction, exact, "no eviction")
    for out, label in (outputs[1], "100% budget"), (outputs[-1], "no eviction, last in the batch"):
        if exact:
            assert list(out.outputs[0].token_ids) == plain, label
        else:  # bf16 Gated DeltaNet state parts at near-ties where the prompt is split into other chunks
            check(out, no_eviction, exact, label)
    assert (outputs[1].kv_transfer_params or {}).get("vllm_evict", {}).get("evicted", False) is False
    from vllm_evict.policies import EvictionConfig

    changed = 0
    for case, out in zip(ONE_SHOT, outputs[2:-1]):
        config = EvictionConfig.from_dict(case)
        check(out, lambda forced: reference.generate(prompt, MAX_TOKENS, config, page_size=page, prefill=prefill,
                                                     forced=forced), exact, str(case), full=plain)
        report = out.kv_transfer_params["vllm_evict"]
        assert report["blocks_freed"] > 0 and report["blocks_after"] == -(-300 * case["budget"] // page), report
        changed += list(out.outputs[0].token_ids) != plain
    assert changed >= len(ONE_SHOT) // 2 and full.token_ids
    assert idle(engine)


def check_evicting_again(engine, reference, exact: bool, seed: int = 1) -> None:
    """Block-wise and decode-time eviction, uniform and Ada-KV, in one batch with a plain request: each
    follows the reference's replay of its compaction points (two decode points in bf16, whose kept sets
    drift from an exact decoder's with every point; four in float32)."""
    page = page_of(engine)
    prompt = random_prompt(seed, 200 * page // PAGE)  # chunks of several pages past P pages
    cases = again(page)
    max_tokens = (64 if exact else 36) + 2 * (page - PAGE)  # two decode points at least
    requests = [None, *cases]
    outputs = engine.generate([{"prompt_token_ids": prompt}] * len(requests), [params(c, max_tokens) for c in requests])
    plain = list(outputs[0].outputs[0].token_ids)
    for case, out in zip(cases, outputs[1:]):
        check(out, lambda forced: reference.replay(prompt, max_tokens, spec_of(case), page_size=page, forced=forced),
              exact, str(case), full=plain)
        report = out.kv_transfer_params["vllm_evict"]
        if "decode_budget" in case:
            assert report["decode_compactions"] >= 2 and report["decode_blocks_freed"] > 0, (case, report)
        else:
            assert report["compactions"] >= 2 and report["blocks_freed"] > 0, (case, report)
    assert idle(engine)


def check_aborts_leak_nothing(engine, seed: int = 2, cases: list[dict] | None = None) -> None:
    """Requests aborted at random steps (mid-prefill, around compaction, mid-decode) return every block of
    every group (cases: default the one-shot and evicting-again ones). After every step, the blocks admission
    counts for each request (its quick count of every group's) are the blocks it holds, null ones not counted."""
    from vllm import SamplingParams

    rng = random.Random(seed)
    llm_engine = engine.llm_engine
    manager = llm_engine.engine_core.engine_core.scheduler.kv_cache_manager
    cases = cases or ONE_SHOT + again(page_of(engine))
    ids = []
    for i, case in enumerate(cases * 2):
        req_id = f"abort-{seed}-{i}"
        llm_engine.add_request(req_id, {"prompt_token_ids": random_prompt(100 + i, rng.randrange(150, 400))},
                               SamplingParams(temperature=0, max_tokens=48, ignore_eos=True,
                                              extra_args={"vllm_evict": case}))
        ids.append((req_id, rng.randrange(1, 30)))
    step = 0
    while llm_engine.has_unfinished_requests():
        llm_engine.abort_request([req_id for req_id, at in ids if at == step])
        llm_engine.step()
        step += 1
        assert step < 500
        for req_id in manager.evictions:
            held = sum(not block.is_null for group in manager.coordinator.single_type_managers
                       for block in group.req_to_blocks.get(req_id, ()))
            assert manager._held(req_id) == held, (req_id, step)
    assert idle(engine)


def reference_for(model, dtype):
    from vllm_evict.testing.reference import ReferenceDecoder

    return ReferenceDecoder(model, dtype=dtype)


def test_only_the_full_attention_group_is_evicted(engine):
    check_only_full_attention_is_evicted(engine)


def test_one_shot_eviction_follows_the_reference_in_a_mixed_batch(engine, reference, exact):
    check_one_shot_mixed_batch(engine, reference, exact)


def test_block_wise_and_decode_time_eviction_follow_the_reference(engine, reference, exact):
    check_evicting_again(engine, reference, exact)


def test_aborted_requests_return_every_group_s_blocks(engine):
    check_aborts_leak_nothing(engine)

