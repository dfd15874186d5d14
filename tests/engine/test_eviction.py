"""End-to-end eviction inside vLLM 0.26 (CPU, tiny GQA Llama) against an independent torch reference,
plus scheduler block accounting and leak checks. One engine for the whole module."""

from __future__ import annotations

import pytest
import torch

from tests.engine.inprocess import inprocess_llm

pytestmark = pytest.mark.engine

MAX_TOKENS = 32
PAGE = 16


def random_prompt(seed: int, length: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 1000, (length,), generator=g).tolist()


@pytest.fixture(scope="module")
def engine(tiny_llama):
    # In-process engine core so the tests can read the scheduler's block tables.
    with inprocess_llm(tiny_llama, block_size=PAGE, max_num_batched_tokens=256) as llm:
        yield llm


def scheduler_of(llm):
    return llm.llm_engine.engine_core.engine_core.scheduler


def params(eviction: dict | None, max_tokens: int = MAX_TOKENS):
    from vllm import SamplingParams

    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=0,
                          extra_args={"vllm_evict": eviction} if eviction else None)


def eviction_cases():
    from vllm_evict.policies import POLICIES

    cases = []
    for policy in POLICIES:  # every registered policy
        for budget in (0.25, 0.5):
            for allocation in ("uniform", "adakv"):
                if not POLICIES[policy].supports_adakv and allocation == "adakv":
                    continue
                cases.append({"policy": policy, "budget": budget, "allocation": allocation})
    cases.append({"policy": "dropkv", "budget": 100, "allocation": "adakv"})  # integer token budget
    cases.append({"policy": "snapkv", "budget": 0.3, "window": 8, "pool_kernel": 3, "gqa": "max"})
    return cases


def check_against_reference(out, expected, label):
    from vllm_evict.policies import EvictionConfig  # noqa: F401  (reference imported lazily above)

    got = list(out.outputs[0].token_ids)
    assert got == expected.token_ids, f"{label}: vLLM {got} != reference {expected.token_ids}"
    vllm_logprobs = [step[tok].logprob for step, tok in zip(out.outputs[0].logprobs, got)]
    torch.testing.assert_close(torch.tensor(vllm_logprobs), torch.tensor(expected.logprobs), atol=2e-3, rtol=0,
                               msg=lambda m: f"{label}: {m}")


def test_every_policy_matches_reference_in_one_mixed_batch(engine, reference):
    """All policies x budgets x allocations plus plain requests, in the same engine steps (prompt longer
    than one 256-token prefill chunk; the copies of the prompt share prefix-cache blocks)."""
    prompt = random_prompt(0, 450)
    cases = eviction_cases()
    requests = [None] + cases + [None]
    outputs = engine.generate([{"prompt_token_ids": prompt}] * len(requests), [params(c) for c in requests])
    check_mixed_batch(outputs, cases, reference, prompt, MAX_TOKENS)


def check_mixed_batch(outputs, cases, reference, prompt, max_tokens, label=""):
    """outputs of [plain] + cases + [plain] on one prompt: each equals the reference and reports its
    eviction; eviction changes the greedy output for most cases on this model (the check has teeth)."""
    from vllm_evict.policies import EvictionConfig

    prefill = reference.prefill(prompt)
    full = reference.generate(prompt, max_tokens, prefill=prefill)
    check_against_reference(outputs[0], full, f"{label}no eviction")
    check_against_reference(outputs[-1], full, f"{label}no eviction (last)")
    changed = 0
    for case, out in zip(cases, outputs[1:-1]):
        expected = reference.generate(prompt, max_tokens, EvictionConfig.from_dict(case), page_size=PAGE,
                                      prefill=prefill)
        check_against_reference(out, expected, f"{label}{case}")
        report = out.kv_transfer_params["vllm_evict"]
        assert report["policy"] == case["policy"] and report["blocks_freed"] > 0
        assert report["latency_ms"] > 0
        changed += expected.token_ids != full.token_ids
    assert changed >= len(cases) // 2


def test_a_policy_added_only_to_the_registry_runs_in_the_engine(engine, reference, monkeypatch):
    """A new query-based policy is one class and one registry entry: validation, the engine's scoring
    (no Triton kernel declared, so the torch reference on GPU too) and the reference decoder all find it."""
    from vllm_evict.policies import POLICIES, EvictionConfig
    from vllm_evict.policies.base import WindowPolicy

    class PeakAttention(WindowPolicy):  # keep the keys some window query attends to most
        name = "toy-peak"
        default_window = 8

        def head_raw(self, st):
            return st.p.amax(dim=1)

    monkeypatch.setitem(POLICIES, PeakAttention.name, PeakAttention())
    prompt = random_prompt(7, 300)
    case = {"policy": "toy-peak", "budget": 0.25}
    out = engine.generate([{"prompt_token_ids": prompt}], [params(case)])[0]
    expected = reference.generate(prompt, MAX_TOKENS, EvictionConfig.from_dict(case), page_size=PAGE)
    check_against_reference(out, expected, str(case))
    assert out.kv_transfer_params["vllm_evict"]["policy"] == "toy-peak"
    assert out.kv_transfer_params["vllm_evict"]["blocks_freed"] > 0


def test_question_agnostic_evict_at(engine, reference):
    """evict_at: compress a 300-token context, then prefill the rest of the prompt over the kept cache."""
    from vllm_evict.policies import EvictionConfig

    prompt = random_prompt(1, 420)
    cases = [{"policy": "snapkv", "budget": 0.25, "allocation": "adakv", "evict_at": 300},
             {"policy": "keydiff", "budget": 0.5, "evict_at": 300},
             {"policy": "dropkv", "budget": 0.25, "evict_at": 256}]
    outputs = engine.generate([{"prompt_token_ids": prompt}] * len(cases), [params(c) for c in cases])
    for case, out in zip(cases, outputs):
        spec = dict(case)
        evict_at = spec.pop("evict_at")
        expected = reference.generate(prompt, MAX_TOKENS, EvictionConfig.from_dict(spec), evict_at=evict_at,
                                      page_size=PAGE)
        check_against_reference(out, expected, str(case))



def test_prefix_hit_up_to_the_eviction_point_still_evicts(engine, reference):
    """A cached prompt covering the whole compressed prefix (window-0 policy, E a multiple of the page
    size) must still leave a chunk ending at E, so the request evicts and matches the reference."""
    from vllm_evict.policies import EvictionConfig

    prompt = random_prompt(12, 480)
    engine.generate([{"prompt_token_ids": prompt}], params(None, max_tokens=2))   # fills the prefix cache
    case = {"policy": "keydiff", "budget": 0.25, "evict_at": 320}
    (out,) = engine.generate([{"prompt_token_ids": prompt}], params(case))
    assert out.kv_transfer_params["vllm_evict"]["evicted_prefix_tokens"] == 320
    expected = reference.generate(prompt, MAX_TOKENS, EvictionConfig.from_dict({"policy": "keydiff", "budget": 0.25}),
                                  evict_at=320, page_size=PAGE)
    check_against_reference(out, expected, str(case))


def test_blocks_held_and_no_leaks(engine):
    """After eviction a request holds exactly P + cdiv(tokens after E, page) blocks; everything returns
    to the free pool after evicting, plain, aborted-mid-prefill and prefix-sharing requests finish."""
    from vllm_evict.policies import EvictionConfig

    llm_engine = engine.llm_engine
    scheduler = scheduler_of(engine)
    pool = scheduler.kv_cache_manager.block_pool
    manager = scheduler.kv_cache_manager.coordinator.single_type_managers[0]
    idle_free = pool.get_num_free_blocks()

    shared = random_prompt(2, 300)
    specs = {
        "evict-a": (shared + random_prompt(3, 150), {"policy": "snapkv", "budget": 0.25, "allocation": "adakv"}),
        "evict-b": (shared + random_prompt(4, 90), {"policy": "dropkv", "budget": 0.5}),
        "plain-a": (shared + random_prompt(5, 60), None),
        "evict-c": (random_prompt(6, 500), {"policy": "keydiff", "budget": 64}),
        "abort-me": (random_prompt(7, 700), {"policy": "snapkv", "budget": 0.2}),
        "plain-b": (random_prompt(8, 200), None),
    }
    # Start the one to abort alone, so it is mid-prefill (256 of 700 tokens) when aborted.
    abort_prompt, abort_ev = specs["abort-me"]
    llm_engine.add_request("abort-me", {"prompt_token_ids": abort_prompt}, params(abort_ev, max_tokens=40))
    llm_engine.step()
    (abort_id,) = [rid for rid in scheduler.requests if rid.startswith("abort-me")]
    assert 0 < scheduler.requests[abort_id].num_computed_tokens < 700
    assert not scheduler.evictions[abort_id].compacted
    for req_id, (prompt, ev) in specs.items():
        if req_id != "abort-me":
            llm_engine.add_request(req_id, {"prompt_token_ids": prompt}, params(ev, max_tokens=40))
    expected_pages = {rid: EvictionConfig.from_dict(ev).num_pages(len(p), PAGE)
                      for rid, (p, ev) in specs.items() if ev}
    aborted = False
    checked = set()
    steps = 0
    while llm_engine.has_unfinished_requests():
        llm_engine.step()
        steps += 1
        if not aborted:
            llm_engine.abort_request(["abort-me"])
            aborted = True
        for req_id, ev in scheduler.evictions.items():
            if ev.compacted:
                request = scheduler.requests[req_id]
                physical = ev.held_blocks * PAGE + request.num_computed_tokens - ev.evict_at
                external_id = req_id.rsplit("-", 1)[0]  # vLLM appends a random suffix
                assert ev.pages == expected_pages[external_id]
                assert len(manager.req_to_blocks[req_id]) == -(-physical // PAGE), req_id
                checked.add(external_id)
    assert checked == {"evict-a", "evict-b", "evict-c"}
    assert not scheduler.evictions and not scheduler.requests
    assert pool.get_num_free_blocks() == idle_free


@pytest.mark.parametrize("bad", [{"policy": "nope", "budget": 0.1}, {"policy": "snapkv", "budget": 0},
                                 {"policy": "snapkv", "budget": 1.5}, {"policy": "snapkv", "budget": 0.2,
                                                                        "pool_kernel": 4},
                                 {"policy": "snapkv", "budget": 0.2, "evict_at": 0},
                                 {"policy": "keydiff", "budget": 0.2, "chunked": True, "evict_at": 50},
                                 {"policy": "snapkv", "budget": 0.2, "allocation": "adakv", "decode_budget": 64,
                                  "protect_prompt": True},
                                 {"policy": "snapkv", "decode_budget": 8}])  # less than a page
def test_invalid_eviction_fails_the_request_not_the_engine(engine, bad):
    prompt = random_prompt(9, 100)
    with pytest.raises(ValueError, match="policy|budget|pool_kernel|evict_at|chunked|protect_prompt"):
        engine.generate([{"prompt_token_ids": prompt}], params(bad))
    # the engine keeps serving
    out = engine.generate([{"prompt_token_ids": prompt}], params(None, max_tokens=4))
    assert len(out[0].outputs[0].token_ids) == 4


def test_unreadable_eviction_that_bypasses_the_api_fails_that_request(engine):
    """A request whose eviction settings the engine cannot read (a client that skips the API process's
    resolution) ends with finish reason "error"; it never runs without eviction, and the engine keeps
    serving the other requests."""
    llm_engine = engine.llm_engine
    request = llm_engine.input_processor.process_inputs(
        "unreadable", {"prompt_token_ids": random_prompt(10, 100)}, params(None, max_tokens=4),
        supported_tasks=llm_engine.get_supported_tasks())
    request.sampling_params.extra_args = {"vllm_evict": {"policy": "nope", "budget": 0.1}}
    llm_engine.add_request(request.request_id, request, request.params)
    llm_engine.add_request("plain", {"prompt_token_ids": random_prompt(11, 100)}, params(None, max_tokens=4))
    finished = {}
    while llm_engine.has_unfinished_requests():
        for out in llm_engine.step():
            if out.finished:
                finished[out.request_id.split("-")[0]] = out
    assert finished["unreadable"].outputs[0].finish_reason == "error"
    assert finished["unreadable"].outputs[0].token_ids == []
    assert len(finished["plain"].outputs[0].token_ids) == 4
    scheduler = llm_engine.engine_core.engine_core.scheduler
    assert not scheduler.evictions and not scheduler.requests and not scheduler.failed


def test_a_compaction_that_raises_fails_only_its_request(engine, reference, monkeypatch):
    """Fault injection: a policy whose scoring raises inside the worker. That request ends with finish reason
    "error"; the evicting and plain requests of the same batch finish as the reference says, and every
    block returns to the pool."""
    from vllm_evict.policies import POLICIES, EvictionConfig
    from vllm_evict.policies.base import WindowPolicy

    class Broken(WindowPolicy):
        name = "toy-broken"
        default_window = 8

        def head_raw(self, st):
            raise RuntimeError("injected scoring failure")

    monkeypatch.setitem(POLICIES, Broken.name, Broken())
    scheduler = engine.llm_engine.engine_core.engine_core.scheduler
    pool = scheduler.kv_cache_manager.block_pool
    idle_free = pool.get_num_free_blocks()
    good = {"policy": "snapkv", "budget": 0.25}
    prompts = [random_prompt(20 + i, 300) for i in range(3)]
    outs = engine.generate([{"prompt_token_ids": p} for p in prompts],
                           [params({"policy": "toy-broken", "budget": 0.25}), params(good), params(None)])
    assert outs[0].outputs[0].finish_reason == "error"
    check_against_reference(outs[1], reference.generate(prompts[1], MAX_TOKENS, EvictionConfig.from_dict(good),
                                                        page_size=PAGE), str(good))
    assert len(outs[2].outputs[0].token_ids) == MAX_TOKENS
    assert not scheduler.evictions and not scheduler.requests and not scheduler.failed
    assert pool.get_num_free_blocks() == idle_free
