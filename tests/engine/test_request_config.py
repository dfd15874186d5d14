"""request_config.resolve_request: a request's eviction resolved once, in the API process, into the one
canonical form the engine core and the workers read (no environment read after that)."""

import pytest

from vllm_evict.engine.request_config import DEFAULT_ENV, parse_request, resolve_request
from vllm_evict.policies import get_policy


def test_flat_keys_become_the_nested_form_and_other_keys_stay():
    resolved = resolve_request({"eviction_policy": "snapkv", "eviction_budget": "0.25", "eviction_evict_at": "300",
                                "other": 1})
    assert resolved == {"other": 1, "vllm_evict": {"policy": "snapkv", "budget": 0.25, "allocation": "uniform",
                                                   "gqa": "mean", "alpha": 0.2, "caote_base": "snapkv",
                                                   "chunked": False, "evict_at": 300}}
    assert not any(key.startswith("eviction_") for key in resolved)
    assert resolve_request(resolved) == resolved  # idempotent (one SamplingParams, many prompts)


def test_the_default_is_applied_once(monkeypatch):
    monkeypatch.setenv(DEFAULT_ENV, '{"policy": "dropkv", "budget": 0.1}')
    resolved = resolve_request(None)
    monkeypatch.setenv(DEFAULT_ENV, '{"policy": "knorm", "budget": 0.5}')  # another process, another default
    spec = parse_request(resolved)
    assert spec.config.policy == "dropkv" and spec.config.budget == 0.1


def test_no_eviction(monkeypatch):
    monkeypatch.delenv(DEFAULT_ENV, raising=False)
    assert resolve_request(None) is None  # a plain request is left as it is
    monkeypatch.setenv(DEFAULT_ENV, '{"policy": "dropkv", "budget": 0.1}')
    resolved = resolve_request({"eviction_policy": "none"})
    assert resolved == {"vllm_evict": {"policy": "none"}} and parse_request(resolved) is None


@pytest.mark.parametrize("bad", [{"eviction_policy": "nope", "eviction_budget": 0.1},
                                 {"vllm_evict": {"policy": "snapkv"}}, {"vllm_evict": {"policy": "snapkv",
                                                                                       "budget": 0.1, "x": 1}}])
def test_bad_parameters_raise_in_the_api_process(bad):
    with pytest.raises(ValueError):
        resolve_request(bad)


def test_adakv_in_place_points_write_what_one_rank_can_win_under_tensor_parallelism():
    """Ada-KV evicting again under TP: an in-place point writes over min(spread * its kept pages, its held
    blocks) of the request's first blocks (a rank's heads may win up to spread times their share), and its
    layout is trimmed to what the fullest rank fills unless another prompt point follows (block-wise);
    uniform allocation and TP=1 write their kept pages. The peak counts the written blocks."""
    from vllm_evict.engine.request_config import parse_request
    from vllm_evict.engine.scheduler import plan_eviction

    def schedule(fields, head_groups):
        spec = parse_request({"vllm_evict": {"policy": "snapkv", "allocation": "adakv", **fields}})
        return plan_eviction(spec, 600, 16, head_groups=head_groups, max_tokens=400)

    decode = schedule({"decode_budget": 64, "decode_every": 32}, 2)  # held at its points: 632, then 64 + 32
    assert decode.spread == 2
    assert [decode.schedule.written_blocks(c, 2) for c in range(3)] == [(8, True), (6, True), (6, True)]
    assert [decode.schedule.written_blocks(c, 1) for c in range(2)] == [(4, False), (4, False)]
    # block-wise at 192 tokens in 64-token chunks: points 256, 320, .., 576 (each 12 pages held + 64), then E
    one_stage = {"budget": 192, "chunked": True, "chunk_size": 64, "chunk_budget": 192, "chunk_policy": "snapkv"}
    chunked = schedule(one_stage, 4)
    points = [chunked.schedule.point(c) for c in range(chunked.schedule.prompt_points)]
    assert [p.at for p in points] == [256, 320, 384, 448, 512, 576, 600]
    written = [chunked.schedule.written_blocks(c, 4) for c in range(len(points))]
    assert written[:-1] == [(16, False)] + [(16, False)] * 5 and written[-1] == (14, True)
    at_tp1 = schedule(one_stage, 1)
    assert at_tp1.spread == 1 and at_tp1.peak < chunked.peak
    uniform = plan_eviction(parse_request({"vllm_evict": {"policy": "snapkv", "decode_budget": 64}}), 600, 16,
                            head_groups=2)
    assert uniform.spread == 1 and uniform.schedule.written_blocks(0, uniform.spread) == (4, False)


@pytest.mark.parametrize("fields, match", [
    ({"policy": "snapkv", "budget": 0.1, "chunk_budget": 0.4}, "chunk_budget=0.4 needs chunked=true"),
    ({"policy": "snapkv", "budget": 0.1, "chunk_policy": "knorm"}, "chunk_policy='knorm' needs chunked=true"),
    ({"policy": "snapkv", "budget": 0.2, "chunked": True, "chunk_budget": 0.1}, "must be at least budget=0.2"),
    ({"policy": "snapkv", "budget": 64, "chunked": True, "chunk_budget": 32}, "must be at least budget=64"),
    ({"policy": "snapkv", "budget": 0.1, "chunked": True, "chunk_budget": 1.5}, "budget must be"),
    ({"policy": "snapkv", "budget": 0.1, "chunked": True, "chunk_policy": "nope"}, "unknown eviction policy"),
    ({"policy": "keydiff", "budget": 0.1, "chunked": True, "chunk_policy": "expected-attention"},
     "reads window queries, and policy 'keydiff' keeps none"),
])
def test_bad_chunk_fields_are_refused(fields, match):
    with pytest.raises(ValueError, match=match):
        parse_request({"vllm_evict": fields})


def test_two_stage_block_wise_schedule():
    """Block-wise cuts before the last keep P_c pages scored by the chunk policy (KeyDiff by default for
    query-based policies, at 4x the budget); the cut at the prompt's end keeps P with the
    request's policy. Flat keys and the nested form agree."""
    from vllm_evict.engine.request_config import CompactionSchedule

    spec = parse_request({"eviction_policy": "snapkv", "eviction_budget": "0.1", "eviction_chunked": "true",
                          "eviction_chunk_size": "128"})
    schedule = CompactionSchedule(spec, 2000, 16)
    points = [schedule.point(c) for c in range(schedule.prompt_points)]
    assert (schedule.pages, schedule.chunk_pages) == (13, 50)  # 200 and 800 tokens of 2,000
    assert [p.at for p in points] == [896, 1024, 1152, 1280, 1408, 1536, 1664, 1792, 1920, 2000]
    assert {p.config.policy for p in points[:-1]} == {"keydiff"} and points[-1].config.policy == "snapkv"
    assert {p.window for p in points} == {32}  # the request's window: the same captured queries for both
    assert {p.kept for p in points[:-1]} == {800} and points[-1].kept == 208
    assert points[-1].held == 800 + 2000 - 1920
    flat = parse_request({"eviction_policy": "snapkv", "eviction_budget": "0.1", "eviction_chunked": "1",
                          "eviction_chunk_policy": "knorm", "eviction_chunk_budget": "0.3"})
    assert flat == parse_request({"vllm_evict": flat.to_dict()})
    assert (flat.chunk_policy, flat.chunk_budget, flat.chunk_config().window_size()) == ("knorm", 0.3, 32)
    one_stage = parse_request({"vllm_evict": {"policy": "keydiff", "budget": 0.1, "chunked": True,
                                              "chunk_budget": 0.1}})
    assert one_stage.chunk_config().policy == "keydiff"
    assert CompactionSchedule(one_stage, 2000, 16).chunk_pages == 13


@pytest.mark.parametrize("fields, match", [
    ({"policy": "snapkv", "budget": 0.1, "decode_policy": "streaming"}, "decode_policy .* need a decode_budget"),
    ({"policy": "snapkv", "decode_budget": 64, "decode_policy": "nope"}, "unknown eviction policy"),
    ({"policy": "keydiff", "decode_budget": 64, "decode_policy": "snapkv"},
     "decode_policy 'snapkv' reads window queries, and policy 'keydiff' keeps none"),
    ({"policy": "snapkv", "allocation": "adakv", "decode_budget": 64, "decode_policy": "streaming"},
     "decode_policy 'streaming' has no allocation 'adakv'"),
])
def test_bad_decode_policies_are_refused(fields, match):
    with pytest.raises(ValueError, match=match):
        parse_request({"vllm_evict": fields})


def test_decode_points_score_with_the_decode_policy():
    """A decode policy scores the decode points only: the prompt's points keep the request's policy, the
    decode points take the decode policy's protected tokens (its sink) with the request's window. Flat keys
    and the nested form agree."""
    from vllm_evict.engine.request_config import CompactionSchedule

    spec = parse_request({"eviction_policy": "snapkv", "eviction_budget": "0.1", "eviction_decode_budget": "256",
                          "eviction_decode_policy": "streaming"})
    assert spec == parse_request({"vllm_evict": spec.to_dict()}) and spec.decode_policy == "streaming"
    schedule = CompactionSchedule(spec, 2000, 16)
    prompt, first, second = (schedule.point(c) for c in range(3))
    assert (prompt.decode, prompt.config.policy) == (False, "snapkv")
    assert {first.config.policy, second.config.policy} == {"streaming"} and first.decode and second.decode
    assert first.window == 32 and first.sink == get_policy("streaming").default_sink != prompt.sink
    assert (first.held, first.kept, second.held) == (208 + 128, 256, 256 + 128)
    same = parse_request({"vllm_evict": {"policy": "snapkv", "budget": 0.1, "decode_budget": 256}})
    assert same.decode_config() is same.config
    assert CompactionSchedule(same, 2000, 16).point(1).config.policy == "snapkv"
