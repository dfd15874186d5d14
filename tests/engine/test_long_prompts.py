"""Prompts longer than the whole KV cache: with $VLLM_EVICT_ALLOW_LONG_PROMPTS a --max-model-len
beyond the cache starts, a block-wise evicting request longer than the cache runs and equals the chunked
torch reference, and every request that could never fit is refused at arrival (a ValueError from the input
processor, a 400 from the OpenAI server) instead of waiting forever, while the engine keeps serving. Without the opt-in vLLM's refusal stands."""

from __future__ import annotations

import pytest

from tests.engine.inprocess import inprocess_llm
from tests.engine.test_chunked_eviction import chunked, plan_of, spec_of
from tests.engine.test_eviction import params, random_prompt
from vllm_evict.engine.request_config import LONG_PROMPTS_ENV

pytestmark = pytest.mark.engine

PAGE = 16
POOL = 48            # blocks: 768 tokens
MAX_MODEL_LEN = 2048
ENGINE = dict(block_size=PAGE, num_gpu_blocks_override=POOL, max_model_len=MAX_MODEL_LEN,
              max_num_batched_tokens=256)


@pytest.fixture(scope="module")
def engine(tiny_llama):
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(LONG_PROMPTS_ENV, "1")
        with inprocess_llm(tiny_llama, **ENGINE) as llm:
            yield llm


def run(llm_engine, requests: dict) -> dict:
    for req_id, (prompt, sampling) in requests.items():
        llm_engine.add_request(req_id, {"prompt_token_ids": prompt}, sampling)
    finished = {}
    while llm_engine.has_unfinished_requests():
        for out in llm_engine.step():
            if out.finished:
                finished[out.request_id] = out
    return finished


def test_a_chunked_prompt_longer_than_the_cache_runs_and_matches(engine, reference):

    scheduler = engine.llm_engine.engine_core.engine_core.scheduler
    pool = scheduler.kv_cache_manager.block_pool
    idle_free = pool.get_num_free_blocks()
    assert idle_free == POOL - 1 and 1500 > POOL * PAGE
    prompt = random_prompt(50, 1500)
    case = {"budget": 128, "chunk_size": 64}
    out = run(engine.llm_engine, {"long": (prompt, params(chunked(case)))})["long"]
    _, chunk, points, chunk_pages = plan_of(case, len(prompt))
    expected = reference.replay(prompt, len(out.outputs[0].token_ids), spec_of(case), page_size=PAGE)
    assert list(out.outputs[0].token_ids) == expected.token_ids and expected.token_ids
    report = out.kv_transfer_params["vllm_evict"]
    assert report["compactions"] == len(points) and report["blocks_before"] == chunk_pages + chunk // PAGE
    assert pool.get_num_free_blocks() == idle_free


def test_requests_that_can_never_fit_are_refused_and_the_engine_keeps_serving(engine):
    scheduler = engine.llm_engine.engine_core.engine_core.scheduler
    pool = scheduler.kv_cache_manager.block_pool
    idle_free = pool.get_num_free_blocks()
    long_prompt = random_prompt(51, 1200)
    never_fit = {
        "plain-long": (params(None), 77),                                          # the whole sequence
        "one-shot-long": (params({"policy": "keydiff", "budget": 128}), 83),       # 75 + 8 at E
        "decode-too-long": (params(chunked({"budget": 128}), max_tokens=700), 52),  # 8 + 44
    }
    for name, (sampling, peak) in never_fit.items():
        with pytest.raises(ValueError, match=f"can never fit the KV cache: it holds {peak} blocks .* has {POOL - 1}"):
            engine.llm_engine.add_request(name, {"prompt_token_ids": long_prompt}, sampling)
    finished = run(engine.llm_engine, {
        "chunked-fits": (long_prompt, params(chunked({"budget": 128}), max_tokens=8)),
        "plain-short": (random_prompt(52, 300), params(None, max_tokens=8)),
    })
    for name in ("chunked-fits", "plain-short"):
        assert len(finished[name].outputs[0].token_ids) == 8, name
    assert not scheduler.evictions and not scheduler.requests and not scheduler.failed
    assert pool.get_num_free_blocks() == idle_free


def test_without_the_opt_in_vllm_refuses_a_max_model_len_beyond_the_cache(tiny_llama, engine):
    # `engine` first: the module's opted-in engine is built (and the opt-in unset again) before this one
    with pytest.MonkeyPatch.context() as patch:
        patch.delenv(LONG_PROMPTS_ENV, raising=False)
        with pytest.raises(Exception, match="max seq len") as info:
            with inprocess_llm(tiny_llama, **ENGINE):
                pass
    assert "estimated maximum model length is 768" in str(info.value)
