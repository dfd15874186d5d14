"""request_config.resolve_request: a request's eviction resolved once, in the API process, into the one
canonical form the engine core and the workers read (no environment read after that)."""

import pytest

from vllm_evict.engine.request_config import DEFAULT_ENV, parse_request, resolve_request


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
    chunked = schedule({"budget": 192, "chunked": True, "chunk_size": 64}, 4)
    points = [chunked.schedule.point(c) for c in range(chunked.schedule.prompt_points)]
    assert [p.at for p in points] == [256, 320, 384, 448, 512, 576, 600]
    written = [chunked.schedule.written_blocks(c, 4) for c in range(len(points))]
    assert written[:-1] == [(16, False)] + [(16, False)] * 5 and written[-1] == (14, True)
    at_tp1 = schedule({"budget": 192, "chunked": True, "chunk_size": 64}, 1)
    assert at_tp1.spread == 1 and at_tp1.peak < chunked.peak
    uniform = plan_eviction(parse_request({"vllm_evict": {"policy": "snapkv", "decode_budget": 64}}), 600, 16,
                            head_groups=2)
    assert uniform.spread == 1 and uniform.schedule.written_blocks(0, uniform.spread) == (4, False)
