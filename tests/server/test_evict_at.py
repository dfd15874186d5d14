"""The server passes the engine-level `evict_at` through and validates it."""

import pytest

from server.eviction import EvictionFieldError, resolve, to_extra_args


def test_evict_at_reaches_extra_args():
    cfg = resolve({"policy": "snapkv", "budget": 0.2, "evict_at": 300}, {})
    assert cfg.policy == "snapkv"
    assert to_extra_args(cfg)["vllm_evict"]["evict_at"] == 300


@pytest.mark.parametrize("bad", [0, -3, 1.5, True, "10"])
def test_bad_evict_at_is_rejected(bad):
    with pytest.raises(EvictionFieldError, match="evict_at"):
        resolve({"policy": "snapkv", "budget": 0.2, "evict_at": bad}, {})


def test_engine_parses_what_the_server_sends():
    from vllm_evict.engine.request_config import parse_request

    extra = to_extra_args(resolve({"policy": "dropkv", "budget": 64, "evict_at": 500}, {}))
    spec = parse_request(extra)
    assert spec.evict_at == 500 and spec.eviction_point(800) == 500 and spec.config.budget == 64


def test_no_eviction_is_explicit():
    """A request that does not evict says so, so an engine-level default cannot apply to it."""
    from vllm_evict.engine.request_config import parse_request

    extra = to_extra_args(resolve({"policy": "none"}, {"policy": "snapkv", "budget": 0.2}))
    assert extra == {"vllm_evict": {"policy": "none"}} and parse_request(extra) is None


def test_engine_unsupported_chunked_is_a_field_error():
    with pytest.raises(EvictionFieldError, match="chunked"):
        resolve({"policy": "keydiff", "budget": 0.2, "chunked": True}, {})
