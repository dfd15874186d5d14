"""Schemathesis against a real `vllm-evict serve`: vLLM's own OpenAPI schema of /v1/completions
and /v1/chat/completions, with the `eviction` object added to both request bodies (the server reads it as
an extra field, so vLLM's schema does not declare it): right and wrong types, NaN and infinities, huge
integers, unknown keys, nested junk and unicode policy names, next to fuzzed values of every other field.

Most fully fuzzed bodies fail on some other field first, so a second schema keeps every other field of a
completion request valid and fuzzes the `eviction` object alone; literal NaN / Infinity and huge integers,
which a JSON-schema generator does not produce, are sent as raw JSON text.

Expected: no 5xx; every error an OpenAI-style JSON error; afterwards a plain request answers and the KV
cache is back at idle. `VLLM_EVICT_FUZZ_EXAMPLES` sets the examples per operation (CI: a bounded number)."""

from __future__ import annotations

import os

import pytest

pytestmark = pytest.mark.slow  # a few minutes of fuzzing; CI runs it with -m slow

schemathesis = pytest.importorskip("schemathesis")

import httpx  # noqa: E402
from hypothesis import HealthCheck, given, settings  # noqa: E402

from vllm_evict.policies import ALLOCATIONS, POLICIES  # noqa: E402

EXAMPLES = int(os.environ.get("VLLM_EVICT_FUZZ_EXAMPLES", "60"))
OPERATIONS = [("/v1/completions", "POST"), ("/v1/chat/completions", "POST")]
ANY = {}  # any JSON value
EVICTION_SCHEMA = {"anyOf": [
    {"type": "object", "additionalProperties": True, "properties": {
        "policy": {"anyOf": [{"enum": [*POLICIES, "none"]}, {"type": "string"}, ANY]},
        "budget": {"anyOf": [{"type": "number"}, {"type": "integer"}, {"type": "string"}, ANY]},
        "allocation": {"anyOf": [{"enum": list(ALLOCATIONS)}, ANY]},
        **{name: {"anyOf": [{"type": "integer"}, ANY]} for name in ("evict_at", "window", "pool_kernel", "sink",
                                                                  "decode_budget", "decode_every", "seed")},
        "alpha": {"anyOf": [{"type": "number"}, ANY]},
        "chunked": ANY,
        "protect_prompt": ANY,
    }},
    ANY,
]}
FINITE_LIMITS = ["--max-model-len", "512"]  # bounds the work of a fuzzed max_tokens


@pytest.fixture(scope="module")
def server(server_factory):
    return server_factory(extra_args=FINITE_LIMITS)


@pytest.fixture(scope="module")
def schema(server):
    raw = httpx.get(server.url + "/openapi.json", timeout=30).json()
    for path, method in OPERATIONS:
        body = raw["paths"][path][method.lower()]["requestBody"]["content"]["application/json"]["schema"]
        name = body["$ref"].rsplit("/", 1)[-1] if "$ref" in body else None
        target = raw["components"]["schemas"][name] if name else body
        target.setdefault("properties", {})["eviction"] = EVICTION_SCHEMA
    return schemathesis.openapi.from_dict(raw)


def kv_usage(server) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(server.url + "/metrics", timeout=30).text
    usage = [sample.value for family in text_string_to_metric_families(text) for sample in family.samples
             if sample.name == "vllm:kv_cache_usage_perc"]
    assert usage, "vllm:kv_cache_usage_perc not exported"
    return sum(usage)


@pytest.mark.parametrize("path,method", OPERATIONS)
def test_fuzzed_requests_get_no_server_error(server, schema, path, method):
    import requests

    session = requests.Session()
    tried = []

    @settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    @given(schema[path][method].as_strategy())
    def fuzz(case):
        response = case.call(base_url=server.url, session=session, timeout=120)
        tried.append(response.status_code)
        check_response(server, response, case.body)

    fuzz()
    assert len(tried) >= min(EXAMPLES, 10)
    # the server still answers a plain request, and nothing holds KV blocks any more
    out = httpx.post(server.url + "/v1/completions", json={"model": served_model(server), "prompt": "hello",
                                                            "max_tokens": 4}, timeout=120)
    assert out.status_code == 200, out.text
    assert kv_usage(server) == 0.0
    print(f"{path}: {len(tried)} fuzzed requests, status codes {sorted(set(tried))}")


@pytest.fixture(scope="module")
def eviction_schema(server):
    """One operation, a completion whose other fields are valid: the fuzzing lands on `eviction`."""
    body = {"type": "object", "required": ["model", "prompt", "max_tokens", "eviction"],
            "additionalProperties": False, "properties": {
                "model": {"enum": [served_model(server)]},
                "prompt": {"type": "string", "minLength": 1, "maxLength": 200},
                "max_tokens": {"type": "integer", "minimum": 1, "maximum": 8},
                "eviction": EVICTION_SCHEMA}}
    raw = {"openapi": "3.0.3", "info": {"title": "eviction fuzz", "version": "1"},
           "paths": {"/v1/completions": {"post": {
               "requestBody": {"required": True, "content": {"application/json": {"schema": body}}},
               "responses": {"200": {"description": "a completion"}}}}}}
    return schemathesis.openapi.from_dict(raw)


def check_response(server, response, label) -> None:
    assert response.status_code < 500, (label, response.status_code, response.text[:500], server.log_tail(30))
    if response.status_code >= 400:  # an OpenAI-style error object
        error = response.json()["error"]
        assert isinstance(error["message"], str) and error["message"], response.text[:500]


def test_fuzzed_eviction_objects_in_valid_requests(server, eviction_schema):
    import requests

    session = requests.Session()
    tried = []

    @settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    @given(eviction_schema["/v1/completions"]["POST"].as_strategy())
    def fuzz(case):
        response = case.call(base_url=server.url, session=session, timeout=120)
        tried.append(response.status_code)
        check_response(server, response, case.body)

    fuzz()
    assert 200 in tried and 400 in tried, tried  # both valid and invalid eviction objects were generated
    model = served_model(server)
    for raw in ('{"policy": "snapkv", "budget": NaN}', '{"policy": "snapkv", "budget": Infinity}',
                '{"policy": "snapkv", "budget": -Infinity}', '{"policy": "snapkv", "budget": 0.2, "window": NaN}',
                '{"policy": "snapkv", "budget": 1e999}', '{"policy": "snapkv", "budget": 123456789012345678901234567890}',
                '{"policy": "snapkv", "budget": 0.2, "evict_at": 99999999999999999999999999}',
                '{"policy": "\u0073napkv\u200b", "budget": 0.2}', '{"policy": "🙂", "budget": 0.2}'):
        text = f'{{"model": "{model}", "prompt": "hello there", "max_tokens": 4, "eviction": {raw}}}'
        response = httpx.post(server.url + "/v1/completions", content=text,
                              headers={"Content-Type": "application/json"}, timeout=120)
        check_response(server, response, raw)
        tried.append(response.status_code)
    assert kv_usage(server) == 0.0
    print(f"eviction objects: {len(tried)} requests, status codes {sorted(set(tried))}")


def served_model(server) -> str:
    return httpx.get(server.url + "/v1/models", timeout=30).json()["data"][0]["id"]
