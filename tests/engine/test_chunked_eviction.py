"""Block-wise eviction during prefill (keydiff chunked=true, DESIGN.md §4.3) inside vLLM 0.26 on CPU:
* tokens equal an independent torch reference that runs the same chunked schedule, in a mixed batch;
* a request never holds more than P + chunk/page_size blocks (and so is admitted for that);
* requests whose prompts together overflow the KV pool run side by side, without preemption, where the
  same prompts without eviction run two at a time;
* blocks go back to the pool, also after an abort mid-prefill and after preemption.
One engine for the module."""

from __future__ import annotations

import pytest

from tests.engine.inprocess import inprocess_llm
from tests.engine.test_eviction import MAX_TOKENS, check_against_reference, params, random_prompt, scheduler_of

pytestmark = pytest.mark.engine

PAGE = 16
POOL = 160           # blocks (2560 tokens)
CASES = [{"budget": 64, "chunk_size": 32},           # cuts before the last at the default 4 x 64 tokens
         {"budget": 0.25, "chunk_size": 100, "chunk_budget": 0.25},  # 112-token chunks (whole pages); one budget
         {"budget": 0.1},                            # the default chunk, 128, and chunk budget, 0.4
         {"budget": 200, "window": 8, "chunk_size": 64, "chunk_budget": 300},  # a protected recent window
         {"budget": 0.5, "chunk_size": 256, "chunk_budget": 0.6}]  # one chunk = vLLM's whole token budget


def chunked(case: dict) -> dict:
    return {"policy": "keydiff", "chunked": True, **case}


@pytest.fixture(scope="module")
def engine(tiny_llama):
    with inprocess_llm(tiny_llama, block_size=PAGE, num_gpu_blocks_override=POOL, max_model_len=1280,
                       max_num_batched_tokens=256) as llm:
        yield llm


def spec_of(case: dict):
    """The RequestEviction of a chunked case."""
    from vllm_evict.engine.request_config import parse_request

    return parse_request({"vllm_evict": chunked(case)})


def plan_of(case: dict, prompt_len: int) -> tuple[int, int, list[int], int]:
    """(P, chunk tokens, eviction points, P_c: the pages the cuts before the last keep) of a chunked case."""
    from vllm_evict.engine.request_config import CompactionSchedule

    schedule = CompactionSchedule(spec_of(case), prompt_len, PAGE)
    points = [schedule.point(c).at for c in range(schedule.prompt_points)]
    return schedule.pages, schedule.chunk, points, schedule.chunk_pages


def test_chunked_keydiff_matches_the_chunked_reference_in_a_mixed_batch(engine, reference):
    from vllm_evict.policies import EvictionConfig

    pool = scheduler_of(engine).kv_cache_manager.block_pool
    idle_free = pool.get_num_free_blocks()
    prompt = random_prompt(3, 600)
    requests = [None] + [chunked(c) for c in CASES] + [None]
    outputs = engine.generate([{"prompt_token_ids": prompt}] * len(requests), [params(r) for r in requests])
    full = reference.generate(prompt, MAX_TOKENS)
    check_against_reference(outputs[0], full, "no eviction")
    check_against_reference(outputs[-1], full, "no eviction (last)")
    differs_from_one_shot = 0
    for case, out in zip(CASES, outputs[1:-1]):
        pages, chunk, points, chunk_pages = plan_of(case, len(prompt))
        expected = reference.replay(prompt, MAX_TOKENS, spec_of(case), page_size=PAGE)
        check_against_reference(out, expected, f"chunked {case}")
        assert expected.kept_per_layer[0] == [pages * PAGE + MAX_TOKENS - 1] * len(expected.kept_per_layer[0])  # + decode
        report = out.kv_transfer_params["vllm_evict"]
        assert report["compactions"] == len(points) and len(points) > 1, (case, report)
        assert report["chunk_size"] == chunk and report["pages_per_head"] == pages
        assert report["chunk_pages_per_head"] == chunk_pages >= pages
        assert report["blocks_before"] <= chunk_pages + chunk // PAGE, (case, report)
        one_shot = reference.generate(prompt, MAX_TOKENS, EvictionConfig.from_dict(
            {"policy": "keydiff", "budget": case["budget"], **({"window": case["window"]} if "window" in case else {})}),
            page_size=PAGE)
        differs_from_one_shot += one_shot.token_ids != expected.token_ids
    assert differs_from_one_shot >= 1  # the engine runs the chunked schedule, not one-shot eviction
    assert pool.get_num_free_blocks() == idle_free


def most_running(llm_engine, scheduler, on_step=None, finished=None) -> int:
    """Step the engine until it is idle; the most requests it ran at once. Finished outputs go to
    `finished` (request id -> output)."""
    most = 0
    while llm_engine.has_unfinished_requests():
        for out in llm_engine.step():
            if out.finished and finished is not None:
                finished[out.request_id] = out
        most = max(most, len(scheduler.running))
        if on_step is not None:
            on_step()
    return most


def test_blocks_held_never_exceed_the_budget_plus_a_chunk_and_prompts_beyond_the_pool_run_together(engine):
    """Four 1200-token prompts need 4 x 75 blocks without eviction, more than the 160-block pool: without
    eviction vLLM runs two at a time; chunked, all run at once and none is preempted, each holding at
    most P + chunk/bs blocks (plus its decode pages), and an abort mid-prefill frees everything."""
    llm_engine = engine.llm_engine
    scheduler = scheduler_of(engine)
    pool = scheduler.kv_cache_manager.block_pool
    manager = scheduler.kv_cache_manager.coordinator.single_type_managers[0]
    idle_free = pool.get_num_free_blocks()
    prompts = [random_prompt(20 + i, 1200) for i in range(4)]
    for i, prompt in enumerate(prompts):
        llm_engine.add_request(f"plain-{i}", {"prompt_token_ids": prompt}, params(None, max_tokens=8))
    assert most_running(llm_engine, scheduler) == 2

    preempted = []
    original_preempt = scheduler._preempt_request

    def count_preemptions(request, timestamp):
        preempted.append(request.request_id)
        return original_preempt(request, timestamp)

    case = {"budget": 128, "chunk_size": 64, "chunk_budget": 160}
    _, chunk, points, pages = plan_of(case, 1200)  # the bound: P_c pages and a chunk
    seen = {"compacting": False, "aborted": False}

    def check_blocks():
        for req_id, ev in list(scheduler.evictions.items()):
            request = scheduler.requests[req_id]
            decode_blocks = -(-max(request.num_computed_tokens - ev.evict_at, 0) // PAGE)
            held = len(manager.req_to_blocks[req_id])
            assert held <= pages + chunk // PAGE + decode_blocks, (req_id, held, request.num_computed_tokens)
            seen["compacting"] |= 0 < ev.done < len(points)
            if req_id.startswith("abort-me") and ev.done >= 2 and not seen["aborted"]:
                llm_engine.abort_request(["abort-me"])
                seen["aborted"] = True

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(scheduler, "_preempt_request", count_preemptions)
        for i, prompt in enumerate(prompts):
            llm_engine.add_request(f"chunked-{i}", {"prompt_token_ids": prompt}, params(chunked(case), max_tokens=40))
        llm_engine.add_request("abort-me", {"prompt_token_ids": random_prompt(30, 1000)},
                               params(chunked(case), max_tokens=40))
        finished = {}
        assert most_running(llm_engine, scheduler, check_blocks, finished) == 5
    assert seen["aborted"] and seen["compacting"]
    for i in range(4):  # the peak is held within a step (from the chunk's allocation to the swap)
        report = finished[f"chunked-{i}"].kv_transfer_params["vllm_evict"]
        assert report["blocks_before"] == pages + chunk // PAGE and report["compactions"] == len(points)
        assert len(finished[f"chunked-{i}"].outputs[0].token_ids) == 40
    assert not preempted, f"chunked requests were preempted: {preempted}"
    assert not scheduler.evictions and not scheduler.requests
    assert pool.get_num_free_blocks() == idle_free


def test_a_preempted_chunked_request_starts_over_and_still_matches(engine, reference):
    """Preemption frees everything: the recompute runs the same chunked schedule from the start."""
    scheduler = scheduler_of(engine)
    pool = scheduler.kv_cache_manager.block_pool
    idle_free = pool.get_num_free_blocks()
    prompt = random_prompt(40, 500)
    case = {"budget": 96, "chunk_size": 48}
    original_step = scheduler.update_from_output
    forced = []

    def preempt_once(scheduler_output, model_runner_output):
        outputs = original_step(scheduler_output, model_runner_output)
        for req_id, ev in scheduler.evictions.items():
            request = scheduler.requests.get(req_id)
            if not forced and ev.done >= 3 and request in scheduler.running:
                scheduler.running.remove(request)
                scheduler._preempt_request(request, 0.0)
                forced.append(req_id)
        return outputs

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(scheduler, "update_from_output", preempt_once)
        out = engine.generate([{"prompt_token_ids": prompt}], params(chunked(case)))[0]
    assert forced
    expected = reference.replay(prompt, MAX_TOKENS, spec_of(case), page_size=PAGE)
    assert list(out.outputs[0].token_ids) == expected.token_ids
    assert pool.get_num_free_blocks() == idle_free
