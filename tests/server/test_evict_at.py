"""The server passes the engine-level fields (`evict_at`, `chunk_size`) through and validates them."""

import pytest

from vllm_evict.server.eviction import EvictionFieldError, resolve, to_extra_args


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


def test_chunked_keydiff_reaches_the_engine_with_its_chunk_size():
    from vllm_evict.engine.request_config import parse_request

    cfg = resolve({"policy": "keydiff", "budget": 0.2, "chunked": True, "chunk_size": 100}, {})
    assert cfg.policy == "keydiff" and cfg.chunked
    spec = parse_request(to_extra_args(cfg))
    assert spec.chunk_size == 100 and spec.chunk_tokens(16) == 112  # rounded up to whole pages
    default = parse_request(to_extra_args(resolve({"policy": "keydiff", "budget": 0.2, "chunked": True}, {})))
    assert default.chunk_size is None and default.chunk_tokens(16) == 128


@pytest.mark.parametrize("bad, field", [({"chunk_size": 64}, "chunk_size"),  # without chunked=true
                                        ({"chunked": True, "chunk_size": 0}, "chunk_size"),
                                        ({"chunked": True, "chunk_size": 1 << 21}, "chunk_size"),
                                        ({"chunked": True, "evict_at": 300}, "evict_at")])
def test_bad_chunked_settings_are_field_errors(bad, field):
    with pytest.raises(EvictionFieldError, match=field):
        resolve({"policy": "keydiff", "budget": 0.2, **bad}, {})


def test_vllm_xargs_strings_are_typed_like_the_engine_types_them(monkeypatch):
    """vllm_xargs values may be strings; the OpenAI request hook reads them with the engine's flat parser
    and merges the server defaults."""
    pytest.importorskip("vllm")
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest

    from vllm_evict.engine import openai_api

    # the OpenAI request hook alone, undone after the test: install_serving_hooks() would also move the
    # eviction report off the RequestOutputs of every later in-process engine test
    monkeypatch.setattr(CompletionRequest, "to_sampling_params",
                        openai_api._with_eviction_field(CompletionRequest.to_sampling_params))
    monkeypatch.setattr(openai_api, "server_defaults", lambda: {"allocation": "adakv"})
    request = CompletionRequest(model="m", prompt="p", max_tokens=4,
                                vllm_xargs={"eviction_policy": "snapkv", "eviction_budget": "0.25",
                                            "eviction_evict_at": "300", "other": 1})
    params = request.to_sampling_params(4, {})
    assert params.extra_args["vllm_evict"] == {**resolve({"policy": "snapkv", "budget": 0.25, "evict_at": 300,
                                                           "allocation": "adakv"}, {}).to_dict()}
    assert params.extra_args["other"] == 1 and "eviction_budget" not in params.extra_args
    from vllm.exceptions import VLLMValidationError

    bad = CompletionRequest(model="m", prompt="p", max_tokens=4, vllm_xargs={"eviction_nope": "1"})
    with pytest.raises(VLLMValidationError, match="eviction_nope"):
        bad.to_sampling_params(4, {})


def test_decode_fields_reach_the_engine_with_or_without_a_prompt_budget():
    """DESIGN.md §4.8 c: a decode budget alone (the prompt is not evicted) or next to a prompt eviction; flat
    vllm_xargs keys are typed like the nested ones."""
    from vllm_evict.engine.request_config import flat_request, parse_request

    alone = parse_request(to_extra_args(resolve({"policy": "snapkv", "decode_budget": 1024}, {})))
    assert alone.config.budget is None and alone.config.num_pages(5000) is None
    assert (alone.decode_budget, alone.decode_tokens(16), alone.protect_prompt) == (1024, 128, False)
    both = parse_request(to_extra_args(resolve({"policy": "random", "budget": 0.2, "decode_budget": 512,
                                                "decode_every": 100, "protect_prompt": True, "seed": 9}, {})))
    assert (both.decode_tokens(16), both.protect_prompt, both.config.seed) == (112, True, 9)  # whole pages
    for adakv in ({"budget": 0.2, "chunked": True}, {"budget": 0.2, "decode_budget": 256},
                  {"decode_budget": 256, "protect_prompt": True}):  # Ada-KV evicts again too (DESIGN.md §4.8)
        spec = parse_request(to_extra_args(resolve({"policy": "snapkv", "allocation": "adakv", **adakv}, {})))
        assert spec.config.allocation == "adakv" and (spec.config.chunked or spec.decode_budget == 256)
    flat = flat_request({"eviction_policy": "dropkv", "eviction_decode_budget": "256",
                         "eviction_decode_every": "64", "eviction_protect_prompt": "true", "eviction_seed": "3"})
    assert flat == {"policy": "dropkv", "decode_budget": 256, "decode_every": 64, "protect_prompt": True, "seed": 3}


@pytest.mark.parametrize("bad, field", [({"decode_budget": 0}, "decode_budget"),
                                        ({"decode_budget": 64.5}, "decode_budget"),
                                        ({"decode_budget": "many"}, "decode_budget"),
                                        ({"decode_budget": 64, "decode_every": 0}, "decode_every"),
                                        ({"decode_budget": 64, "protect_prompt": "maybe"}, "protect_prompt"),
                                        ({"decode_every": 64, "budget": 0.2}, "decode_budget"),
                                        ({"protect_prompt": True, "budget": 0.2}, "decode_budget"),
                                        ({"decode_budget": 64, "allocation": "adakv", "budget": 0.2,
                                          "protect_prompt": True}, "protect_prompt"),
                                        ({"decode_budget": 64, "seed": "x"}, "seed"),
                                        ({}, "budget")])  # neither budget
def test_bad_decode_settings_are_field_errors(bad, field):
    with pytest.raises(EvictionFieldError, match=field):
        resolve({"policy": "snapkv", **bad}, {})
