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


def test_adakv_evicting_again_is_refused_under_tensor_parallelism():
    """A rank's heads may win more Ada-KV pages than its blocks hold at an in-place point: refused under TP
    (the request fails with the reason), accepted at TP=1."""
    from vllm_evict.engine.request_config import parse_request
    from vllm_evict.engine.scheduler import plan_eviction

    for fields in ({"budget": 0.2, "chunked": True}, {"decode_budget": 64}):
        spec = parse_request({"vllm_evict": {"policy": "snapkv", "allocation": "adakv", **fields}})
        assert plan_eviction(spec, 600, 16, head_groups=1) is not None
        with pytest.raises(ValueError, match="tensor parallelism"):
            plan_eviction(spec, 600, 16, head_groups=2)
