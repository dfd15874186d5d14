"""Evicting again (DESIGN.md §4.8) inside vLLM 0.26 on CPU: decode-time eviction (`decode_budget`), block-wise
prefill for every policy (`chunked=true`) and the `random` policy, against the independent torch reference
that replays the same compaction points (`ReferenceDecoder.replay`):
* tokens and logprobs equal the reference for every policy, with and without protect_prompt, with and
  without a prompt eviction, in mixed batches with plain and one-shot requests, >= 3 decode compactions each;
* a decode budget that covers the whole sequence changes no token; n = 2 and a stop token work;
* after every engine step a request holds exactly the blocks of its physical length, never more than its
  schedule's bound, and the pool returns to idle after aborts at random steps and after preemption.
One engine for the module."""

from __future__ import annotations

import random

import pytest

from tests.engine.inprocess import inprocess_llm
from tests.engine.test_eviction import check_against_reference, params, random_prompt, scheduler_of

pytestmark = pytest.mark.engine

PAGE = 16
MAX_TOKENS = 150           # decode points at 32, 64, 96, 128 generated tokens (decode_every 32)
DECODE = {"decode_budget": 48, "decode_every": 32}


@pytest.fixture(scope="module")
def engine(tiny_llama):
    with inprocess_llm(tiny_llama, block_size=PAGE, max_model_len=1280, max_num_batched_tokens=256) as llm:
        yield llm


def spec_of(case: dict):
    from vllm_evict.engine.request_config import parse_request

    return parse_request({"vllm_evict": case})


def check_cases(engine, reference, prompt: list[int], cases: list[dict], max_tokens: int = MAX_TOKENS,
                min_decode_compactions: int = 3) -> list:
    """Run [plain] + cases + [plain] in one batch; each case equals the reference's replay of its points."""
    requests = [None, *cases, None]
    outputs = engine.generate([{"prompt_token_ids": prompt}] * len(requests), [params(c, max_tokens) for c in requests])
    full = reference.generate(prompt, max_tokens)
    check_against_reference(outputs[0], full, "no eviction")
    check_against_reference(outputs[-1], full, "no eviction (last)")
    tie_decided = []
    for case, out in zip(cases, outputs[1:-1]):
        expected = reference.replay(prompt, max_tokens, spec_of(case), page_size=PAGE)
        if expected.near_ties and list(out.outputs[0].token_ids) != expected.token_ids:
            tie_decided.append(case)  # DESIGN.md §7.3: a kept set decided by rounding may differ
            continue
        check_against_reference(out, expected, str(case))
        report = out.kv_transfer_params["vllm_evict"]
        if "decode_budget" in case:
            assert report["decode_compactions"] >= min_decode_compactions, (case, report)
            assert report["decode_evicted_tokens"] > 0 and report["decode_blocks_freed"] > 0, (case, report)
    assert len(tie_decided) <= 1, f"more than one case differs at a near-tie: {tie_decided}"
    return outputs


def all_policies(**fields) -> list[dict]:
    from vllm_evict.policies import POLICIES

    return [{"policy": policy, **fields} for policy in POLICIES]


def test_every_policy_evicts_while_decoding(engine, reference):
    """A decode budget alone (the prompt is not evicted): every policy, in one batch with plain requests."""
    outputs = check_cases(engine, reference, random_prompt(60, 200), all_policies(**DECODE))
    full_tokens = outputs[0].outputs[0].token_ids
    assert sum(out.outputs[0].token_ids != full_tokens for out in outputs[1:-1]) >= len(outputs[2:]) // 2


def test_every_policy_evicts_decode_time_with_a_protected_prompt(engine, reference):
    """protect_prompt: only the generated tokens are candidates at a decode point; the prompt stays whole."""
    cases = all_policies(decode_budget=32, decode_every=32, protect_prompt=True, seed=5)
    outputs = check_cases(engine, reference, random_prompt(61, 150), cases, max_tokens=170)
    for out in outputs[1:-1]:  # the prompt's blocks and the decode budget's, at most (no block is shared)
        report = out.kv_transfer_params["vllm_evict"]
        assert report["blocks_held"] <= -(-(150 + 32 + 32) // PAGE), report


def test_prompt_and_decode_eviction_in_one_request(engine, reference):
    """One-shot and block-wise prompt eviction, then decode points, next to one-shot-only requests."""
    cases = [{"policy": "snapkv", "budget": 0.25, **DECODE},
             {"policy": "dropkv", "budget": 64, "decode_budget": 64, "decode_every": 16},
             {"policy": "keydiff", "budget": 48, "chunked": True, "chunk_size": 64, **DECODE},
             {"policy": "random", "budget": 0.3, "chunked": True, **DECODE, "protect_prompt": True},
             {"policy": "h2o", "budget": 0.25, "evict_at": 200, **DECODE},
             {"policy": "snapkv", "budget": 0.25},
             {"policy": "snapkv", "budget": 0.25, "allocation": "adakv"}]
    outputs = check_cases(engine, reference, random_prompt(62, 300), cases)
    for case, out in zip(cases, outputs[1:-1]):
        report = out.kv_transfer_params["vllm_evict"]
        assert report["pages_per_head"] == spec_of(case).config.num_pages(case.get("evict_at", 300), PAGE)


def test_decode_points_score_with_the_decode_policy(engine, reference):
    """decode_policy scores the decode points, the request's policy its prompt: one-shot, block-wise and no
    prompt eviction, Ada-KV, protect_prompt; each next to the same request without it, whose tokens differ
    from it for most of them (so a decode policy the engine ignored would fail the reference)."""
    with_policy = [{"policy": "snapkv", "budget": 0.25, **DECODE, "decode_policy": "streaming"},
                   {"policy": "dropkv", "budget": 64, "chunked": True, "chunk_size": 64, **DECODE,
                    "decode_policy": "h2o"},
                   {"policy": "keydiff", "budget": 0.25, "window": 16, **DECODE, "decode_policy": "snapkv"},
                   {"policy": "tova", "budget": 0.25, "allocation": "adakv", **DECODE, "decode_policy": "knorm"},
                   {"policy": "snapkv", **DECODE, "protect_prompt": True, "decode_policy": "random", "seed": 3}]
    without = [{k: v for k, v in case.items() if k != "decode_policy"} for case in with_policy]
    outputs = check_cases(engine, reference, random_prompt(66, 300), with_policy + without)
    n = len(with_policy)
    for case, out in zip(with_policy, outputs[1:1 + n]):
        assert out.kv_transfer_params["vllm_evict"]["decode_policy"] == case["decode_policy"]
    differ = [ours.outputs[0].token_ids != theirs.outputs[0].token_ids
              for ours, theirs in zip(outputs[1:1 + n], outputs[1 + n:-1])]
    assert sum(differ) >= 3, differ


def test_every_policy_evicts_block_wise_while_prefilling(engine, reference):
    """chunked=true for every policy (DESIGN.md §4.8 b): the chunk ends past P_c pages compact what each head
    holds with the chunk policy (for query-based policies KeyDiff by default, or expected attention), window queries
    included (a 16-token chunk is smaller than most windows: the window spans chunks), and the prompt's end
    with the request's policy; and once with one budget and policy for every cut."""
    from vllm_evict.engine.request_config import eviction_points

    prompt = random_prompt(63, 400)
    cases = all_policies(budget=80, chunked=True, chunk_size=48) + [
        {"policy": "snapkv", "budget": 0.2, "chunked": True, "chunk_size": 16, "window": 24,
         "chunk_policy": "expected-attention"},
        {"policy": "obcache-joint", "budget": 96, "chunked": True, "chunk_size": 16, "chunk_policy": "streaming",
         "chunk_budget": 0.5},
        {"policy": "dropkv", "budget": 80, "chunked": True, "chunk_size": 48, "chunk_budget": 80,
         "chunk_policy": "dropkv"}]
    outputs = check_cases(engine, reference, prompt, cases, max_tokens=24)
    for case, out in zip(cases, outputs[1:-1]):
        spec = spec_of(case)
        report = out.kv_transfer_params["vllm_evict"]
        chunk_config = spec.chunk_config()
        chunk_pages = max(chunk_config.num_pages(len(prompt), PAGE), spec.config.num_pages(len(prompt), PAGE))
        points = eviction_points(len(prompt), chunk_pages, PAGE, spec.chunk_tokens(PAGE))
        assert report["compactions"] == len(points) > 2, (case, report)
        assert report["chunk_policy"] == case.get("chunk_policy", "keydiff" if spec.config.needs_queries()
                                                  else case["policy"]), report


def test_adakv_evicts_again_over_uneven_heads(engine, reference):
    """Ada-KV (DESIGN.md §4.8 a): after a point every head holds its own number of tokens, in per-head pages; each
    later point scores those uneven held sets and allocates over them. Decode budgets for every policy, with
    a one-shot or block-wise prompt eviction first, with protect_prompt, next to a uniform request."""
    prompt = random_prompt(65, 260)
    cases = all_policies(allocation="adakv", **DECODE) + [
        {"policy": "snapkv", "budget": 0.25, "allocation": "adakv", **DECODE},
        {"policy": "dropkv", "budget": 64, "allocation": "adakv", "chunked": True, "chunk_size": 48, **DECODE},
        {"policy": "h2o", "allocation": "adakv", "decode_budget": 32, "decode_every": 32, "protect_prompt": True},
        {"policy": "snapkv", "budget": 0.25, **DECODE}]
    check_cases(engine, reference, prompt, cases)
    # the test has teeth: the heads really hold different counts between points
    keydiff = next(case for case in cases if case["policy"] == "keydiff")
    held = reference.replay(prompt, MAX_TOKENS - 20, spec_of(keydiff), page_size=PAGE).kept_per_layer
    assert any(len(set(layer)) > 1 for layer in held), held


def test_every_policy_evicts_block_wise_with_adakv(engine, reference):
    """chunked=true with Ada-KV for every policy: each chunk attends to its layer's uneven heads (per-head
    attention during prefill), and each chunk end past P pages compacts them again."""
    check_cases(engine, reference, random_prompt(66, 400),
                all_policies(budget=80, chunked=True, chunk_size=48, allocation="adakv"), max_tokens=24)


def test_a_decode_budget_covering_the_sequence_changes_nothing(engine, reference):
    """K_d >= prompt + max_tokens with no prompt eviction (or budget 1.0): the greedy tokens of no eviction."""
    prompt = random_prompt(64, 120)
    cases = [{"policy": "snapkv", "decode_budget": 120 + 64, "decode_every": 16},
             {"policy": "random", "budget": 1.0, "decode_budget": 512, "decode_every": 16},
             {"policy": "keydiff", "decode_budget": 120 + 64, "decode_every": 16, "protect_prompt": True}]
    requests = [None, *cases]
    outputs = engine.generate([{"prompt_token_ids": prompt}] * len(requests), [params(c, 64) for c in requests])
    for case, out in zip(cases, outputs[1:]):
        assert out.outputs[0].token_ids == outputs[0].outputs[0].token_ids, case
        assert out.kv_transfer_params["vllm_evict"]["decode_compactions"] == 0


def test_blocks_follow_the_schedule_every_step_and_return_after_aborts(engine):
    """Step the engine with decode-budget requests: after every step each holds exactly the blocks of its
    physical length (semantic length less what compaction removed), which never exceeds the schedule's peak,
    and vLLM's manager tracks it as a running request (its block count's shortcut, though it caches nothing);
    requests aborted at random steps (mid-prefill, mid-decode) give every block back."""
    from vllm_evict.engine.scheduler import peak_blocks

    llm_engine, scheduler = engine.llm_engine, scheduler_of(engine)
    manager = scheduler.kv_cache_manager.coordinator.single_type_managers[0]
    pool = scheduler.kv_cache_manager.block_pool
    idle_free = pool.get_num_free_blocks()
    rng = random.Random(7)
    cases = {f"r{i}": case for i, case in enumerate([
        {"policy": "snapkv", **DECODE}, {"policy": "random", "decode_budget": 32, "decode_every": 16},
        {"policy": "dropkv", "budget": 0.2, **DECODE, "protect_prompt": True},
        {"policy": "keydiff", "budget": 64, "chunked": True, "chunk_size": 32, **DECODE},
        {"policy": "tova", **DECODE}, {"policy": "streaming", "decode_budget": 16, "decode_every": 16},
        {"policy": "h2o", "allocation": "adakv", "budget": 0.2, **DECODE}])}
    abort_at = {req_id: rng.randrange(2, 120) for req_id in ("r1", "r4", "r5")}
    for i, (req_id, case) in enumerate(cases.items()):
        llm_engine.add_request(req_id, {"prompt_token_ids": random_prompt(70 + i, 260)}, params(case, MAX_TOKENS))
    steps, decode_compacted = 0, set()
    while llm_engine.has_unfinished_requests():
        llm_engine.step()
        steps += 1
        for req_id, ev in list(scheduler.evictions.items()):
            request, external = scheduler.requests[req_id], req_id.rsplit("-", 1)[0]
            physical = request.num_computed_tokens - ev.removed
            held = len(manager.req_to_blocks[req_id])
            assert held == -(-physical // PAGE), (req_id, steps, held, physical)
            assert held <= peak_blocks(request.num_prompt_tokens + MAX_TOKENS, PAGE, ev), (req_id, held)
            assert held == 0 or req_id in manager.num_cached_block, (req_id, steps)
            if ev.decode_compactions:
                decode_compacted.add(external)
            if abort_at.get(external) == steps:
                llm_engine.abort_request([external])
    assert decode_compacted >= {"r0", "r2", "r3", "r6"}
    assert not scheduler.evictions and not scheduler.requests
    assert pool.get_num_free_blocks() == idle_free


def test_a_preempted_decode_budget_request_replays_its_points(engine, reference):
    """Preemption mid-decode frees everything; the recompute (prompt and generated tokens prefilled again)
    compacts at the same points, decode points included, and the tokens still equal the reference."""
    scheduler = scheduler_of(engine)
    pool = scheduler.kv_cache_manager.block_pool
    idle_free = pool.get_num_free_blocks()
    prompt = random_prompt(80, 200)
    case = {"policy": "snapkv", "budget": 96, **DECODE}
    original = scheduler.update_from_output
    forced = []

    def preempt_once(scheduler_output, model_runner_output):
        outputs = original(scheduler_output, model_runner_output)
        for req_id, ev in list(scheduler.evictions.items()):
            request = scheduler.requests[req_id]
            if not forced and ev.decode_compactions >= 2 and request in scheduler.running:
                scheduler.running.remove(request)
                scheduler._preempt_request(request, 0.0)
                forced.append(req_id)
        return outputs

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(scheduler, "update_from_output", preempt_once)
        out = engine.generate([{"prompt_token_ids": prompt}], params(case, MAX_TOKENS))[0]
    assert forced
    expected = reference.replay(prompt, MAX_TOKENS, spec_of(case), page_size=PAGE)
    check_against_reference(out, expected, "preempted")
    assert out.kv_transfer_params["vllm_evict"]["decode_compactions"] == 4
    assert pool.get_num_free_blocks() == idle_free


def test_n_and_stop_tokens_with_a_decode_budget(engine, reference):
    """n = 2 (two sequences of one request, each with its own compaction state) and a stop token after
    the decode points: both sequences equal the reference and stop where it generates that token; the pool
    returns to idle."""
    from vllm import SamplingParams

    pool = scheduler_of(engine).kv_cache_manager.block_pool
    idle_free = pool.get_num_free_blocks()
    prompt = random_prompt(90, 180)
    case = {"policy": "keydiff", **DECODE}
    expected = reference.replay(prompt, MAX_TOKENS, spec_of(case), page_size=PAGE)
    stop = expected.token_ids[100]  # past three decode points
    end = expected.token_ids.index(stop) + 1
    params_n = SamplingParams(temperature=1.0, top_k=1, max_tokens=MAX_TOKENS, n=2, stop_token_ids=[stop],  # greedy
                              extra_args={"vllm_evict": case})
    out = engine.generate([{"prompt_token_ids": prompt}], params_n)[0]
    assert len(out.outputs) == 2
    for seq in out.outputs:
        assert list(seq.token_ids) == expected.token_ids[:end]
    assert out.kv_transfer_params["vllm_evict"]["decode_compactions"] >= (end - 1) // 32 >= 3
    assert pool.get_num_free_blocks() == idle_free


def test_requests_at_one_point_compact_together(engine, reference, monkeypatch):
    """Requests of one policy and prompt length reach their points in the same step and compact in one batch
    (compaction.compact_requests folds them into the head axis): each still equals the reference's replay of
    its own prompt, one-shot Ada-KV and decode-time eviction alike."""
    from vllm_evict.engine import worker

    compact, batches = worker.compact_requests, []

    def recording(requests, *args, **kwargs):
        batches.append((requests[0][0].point.decode, len(requests)))
        return compact(requests, *args, **kwargs)

    monkeypatch.setattr(worker, "compact_requests", recording)
    prompts = [random_prompt(300 + i, 72) for i in range(3)]  # 3 prompts fill one 256-token prefill step
    requests = [(prompt, case) for case in ({"policy": "snapkv", "budget": 48, "allocation": "adakv"},
                                            {"policy": "dropkv", **DECODE}) for prompt in prompts]
    outputs = engine.generate([{"prompt_token_ids": prompt} for prompt, _ in requests],
                              [params(case, MAX_TOKENS) for _, case in requests])
    tie_decided = []
    for (prompt, case), out in zip(requests, outputs):
        expected = reference.replay(prompt, MAX_TOKENS, spec_of(case), page_size=PAGE)
        if expected.near_ties and list(out.outputs[0].token_ids) != expected.token_ids:
            tie_decided.append(case)  # DESIGN.md §7.3
            continue
        check_against_reference(out, expected, f"{case} on prompt {prompts.index(prompt)}")
    assert len(tie_decided) <= 1, tie_decided
    assert (False, 3) in batches and batches.count((True, 3)) >= 3, batches  # one-shot, and every decode point


def test_the_engine_process_runs_full_garbage_collections_rarely(engine):
    """The engine core and its worker run in this process (inprocess_llm): their start raised CPython's
    full-collection threshold (engine/host_gc.py), which would otherwise walk every request's token lists
    every 10 middle-generation collections."""
    import gc

    from vllm_evict.engine.host_gc import THRESHOLD2

    assert gc.get_threshold()[2] == THRESHOLD2
