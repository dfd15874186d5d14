"""Property tests of the eviction parser (hypothesis): any JSON value in any field is either a clean
ValueError or a request the engine reads back unchanged, through vLLM's msgspec messages to the engine
core; nothing else escapes (a TypeError here, or an integer msgspec cannot carry, would be a 500 from
the server instead of a 400)."""

import math

import msgspec
import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import given, settings, strategies as st  # noqa: E402

from vllm_evict.engine.request_config import EXTRA_ARGS_KEY, parse_request, resolve_request  # noqa: E402
from vllm_evict.policies import POLICIES  # noqa: E402

FIELDS = ["policy", "budget", "allocation", "window", "pool_kernel", "sink", "gqa", "alpha", "caote_base",
          "chunked", "evict_at", "chunk_size"]
json_scalars = (st.none() | st.booleans() | st.integers() | st.integers(min_value=-2**80, max_value=2**80)
                | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=12)
                | st.sampled_from(list(POLICIES) + ["none", "uniform", "adakv", "mean", "max", "0.1", "1e400"]))
json_values = st.recursive(json_scalars, lambda inner: st.lists(inner, max_size=3)
                           | st.dictionaries(st.text(max_size=6), inner, max_size=3), max_leaves=6)
field_names = st.sampled_from(FIELDS) | st.text(max_size=10)


def check_resolves_or_value_error(extra_args):
    try:
        resolved = resolve_request(extra_args)
    except ValueError:
        return None
    spec = parse_request(resolved)
    if spec is not None:  # what the engine reads back is exactly what was resolved
        assert msgspec.msgpack.decode(msgspec.msgpack.encode(resolved)) == resolved  # vLLM's IPC carries it
        assert resolve_request(resolved) == resolved
        assert resolved[EXTRA_ARGS_KEY] == spec.to_dict()
        assert 0 < spec.config.budget and not math.isnan(float(spec.config.budget))
    return spec


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(field_names, json_values, max_size=6))
def test_nested_object_fields(obj):
    check_resolves_or_value_error({EXTRA_ARGS_KEY: obj})


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(field_names.map(lambda k: "eviction_" + k), json_values | st.text(max_size=8), max_size=5))
def test_flat_keys(flat):
    check_resolves_or_value_error(flat)


@settings(max_examples=100, deadline=None)
@given(json_values)
def test_whole_object_of_any_type(value):
    check_resolves_or_value_error({EXTRA_ARGS_KEY: value})


@settings(max_examples=200, deadline=None)
@given(policy=st.sampled_from(list(POLICIES)), budget=st.floats(0.001, 1.0) | st.integers(1, 10**6),
       allocation=st.sampled_from(["uniform", "adakv"]), evict_at=st.none() | st.integers(1, 10**6))
def test_valid_requests_round_trip(policy, budget, allocation, evict_at):
    obj = {"policy": policy, "budget": budget, "allocation": allocation}
    if evict_at is not None:
        obj["evict_at"] = evict_at
    spec = check_resolves_or_value_error({EXTRA_ARGS_KEY: obj})
    assert spec is not None and spec.config.policy == policy and spec.evict_at == evict_at


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(field_names, json_values, max_size=6) | json_values)
def test_server_field_is_a_field_error_or_what_the_engine_reads(obj):
    """The OpenAI request's `eviction` field (server/eviction.py): an EvictionFieldError (a 400) or a
    config whose extra_args the engine parses to the same request."""
    from vllm_evict.server.eviction import EvictionFieldError, resolve, to_extra_args

    try:
        cfg = resolve(obj, {})
    except EvictionFieldError:
        return
    extra_args = to_extra_args(cfg)
    spec = check_resolves_or_value_error(extra_args)
    assert (spec is None) == (extra_args[EXTRA_ARGS_KEY] == {"policy": "none"})


@settings(max_examples=100, deadline=None)
@given(field=st.sampled_from(["budget", "evict_at", "window", "sink", "pool_kernel"]),
       value=st.integers(min_value=1, max_value=2**80))
def test_integers_of_any_size(field, value):
    """Integers beyond what vLLM's messages carry are a ValueError (found by the API fuzz: a 500)."""
    check_resolves_or_value_error({EXTRA_ARGS_KEY: {"policy": "snapkv", "budget": 0.2, field: value}})
