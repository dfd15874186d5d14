"""End to end: a real `vllm-evict serve` (tiny model on CPU, started once for this module) driven by the
official `openai` client and raw `httpx`.

The server is started without a MODEL argument, so this also checks that `vllm-evict serve` alone serves
the tiny local model as `tiny-llama`.

Eviction assertions on numbers (counters moving, reported blocks freed, kept <= prompt) activate for
requests where the engine's `eviction_report` returned data (`usage.eviction.evicted == true`); with an
engine that reports nothing they check the honest `"evicted": false` answer instead.
"""

from __future__ import annotations

import asyncio
import json
import socket
import time

import pytest

pytestmark = pytest.mark.engine

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from server.metrics import METRIC_NAMES  # noqa: E402

API_KEY = "test-secret"
MODEL = "tiny-llama"
LONG_TEXT = ("the key value of the city river blue green red sky grass sun moon code token cache page head layer "
             "attention query memory model request budget policy evict keep score window prompt answer question ")
LONG_PROMPT = LONG_TEXT * 6  # ~250 tokens: long enough for page-granular eviction to free blocks
MESSAGES = [{"role": "system", "content": "You are a tiny test model."},
            {"role": "user", "content": LONG_PROMPT}]


@pytest.fixture(scope="module")
def server(tiny_llama, server_factory):
    # tiny_llama builds the model into VLLM_EVICT_CACHE first; `serve` without MODEL then finds it there
    return server_factory(api_key=API_KEY)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, headers=server.headers(), timeout=300) as c:
        yield c


# ------------------------------------------------------------------------------------------- helpers
def scrape(http) -> dict[str, dict[tuple, float]]:
    """{family name: {(sample name, sorted labels): value}} from /metrics."""
    r = http.get("/metrics")
    assert r.status_code == 200
    out: dict[str, dict[tuple, float]] = {}
    for fam in text_string_to_metric_families(r.text):
        for s in fam.samples:
            out.setdefault(fam.name, {})[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def metric(m, family: str, sample: str | None = None, **labels) -> float:
    """Sum of a family's samples named `sample` (default: the family's main sample) matching `labels`."""
    fam = m.get(family, {})
    total = 0.0
    for (name, lbls), value in fam.items():
        if sample is not None and name != sample:
            continue
        if sample is None and name not in (family, family + "_total"):
            continue
        d = dict(lbls)
        if all(d.get(k) == v for k, v in labels.items()):
            total += value
    return total


def eviction_of(usage) -> dict:
    d = usage.model_extra.get("eviction") if hasattr(usage, "model_extra") else usage.get("eviction")
    assert isinstance(d, dict), usage
    return d


def check_eviction_block(ev: dict, policy: str, prompt_tokens: int) -> None:
    assert ev["policy"] == policy
    assert isinstance(ev["evicted"], bool)
    if policy == "none":
        assert ev["evicted"] is False
    if ev["evicted"]:  # engine reported: numbers must be consistent
        if "sequences" not in ev:  # one engine request
            assert ev["prompt_tokens"] == prompt_tokens
        for s in ev.get("sequences", [ev]):
            assert s["evicted"] is True and s["policy"] == policy
            assert 0 < s["kept_tokens"] <= s["prompt_tokens"] <= prompt_tokens
            assert 0 < s["compression_ratio"] <= 1.0
            assert s["blocks_freed"] >= 0
            if "blocks_before" in s and "blocks_after" in s:
                assert s["blocks_before"] - s["blocks_after"] == s["blocks_freed"]
        if "sequences" in ev:
            assert ev["evicted_sequences"] == len(ev["sequences"]) <= ev["num_sequences"]
            assert ev["blocks_freed"] == sum(s["blocks_freed"] for s in ev["sequences"])


def sse(text: str) -> list[dict]:
    lines = [ln[len("data: "):] for ln in text.splitlines() if ln.startswith("data: ")]
    assert lines and lines[-1] == "[DONE]", text[-500:]
    return [json.loads(x) for x in lines[:-1]]


def assert_error(r, status: int, param: str | None = None, code: str | None = None) -> dict:
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    if param is not None:
        assert body["error"]["param"] == param, body
    if code is not None:
        assert body["error"]["code"] == code, body
    return body["error"]


def assert_still_serving(http) -> None:
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": "the key value", "max_tokens": 2})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 2 or r.json()["choices"][0]["finish_reason"] == "stop"


def wait_for_metric(http, family: str, predicate, timeout: float = 60.0) -> float:
    deadline = time.time() + timeout
    while True:
        value = metric(scrape(http), family)
        if predicate(value) or time.time() > deadline:
            return value
        time.sleep(0.2)


# ------------------------------------------------------------------------------------------- basics
def test_health_models_and_metrics_families(server, http, client):
    assert httpx.get(server.url + "/health").status_code == 200  # no key needed
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    m = scrape(http)
    for name in METRIC_NAMES:
        assert name in m or name in {f.name for f in text_string_to_metric_families(http.get("/metrics").text)}, name
    assert metric(m, "vllm_evict:kv_cache_blocks") > 0
    total = metric(m, "vllm_evict:kv_cache_blocks")
    assert metric(m, "vllm_evict:kv_cache_used_blocks") + metric(m, "vllm_evict:kv_cache_free_blocks") == total
    assert metric(m, "vllm_evict:batch_capacity_sequences") > 0


def test_chat_non_streaming_plain(client, http):
    before = scrape(http)
    resp = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=6, temperature=0,
                                          extra_body={"ignore_eos": True})
    assert resp.object == "chat.completion" and resp.model == MODEL
    choice = resp.choices[0]
    assert choice.message.role == "assistant" and isinstance(choice.message.content, str)
    assert choice.finish_reason == "length"
    assert resp.usage.completion_tokens == 6 and resp.usage.prompt_tokens > 150
    assert resp.usage.total_tokens == resp.usage.prompt_tokens + 6
    check_eviction_block(eviction_of(resp.usage), "none", resp.usage.prompt_tokens)
    after = scrape(http)
    assert metric(after, "vllm_evict:generation_tokens") >= metric(before, "vllm_evict:generation_tokens") + 6
    assert metric(after, "vllm_evict:requests", endpoint="chat", policy="none") == \
        metric(before, "vllm_evict:requests", endpoint="chat", policy="none") + 1
    assert metric(after, "vllm_evict:time_to_first_token_seconds", "vllm_evict:time_to_first_token_seconds_count") \
        > metric(before, "vllm_evict:time_to_first_token_seconds", "vllm_evict:time_to_first_token_seconds_count")


def test_chat_non_streaming_with_eviction_and_metrics(client, http):
    before = scrape(http)
    resp = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=5, temperature=0,
        extra_body={"ignore_eos": True, "eviction": {"policy": "snapkv", "budget": 0.25, "window": 8}})
    assert resp.choices[0].message.content is not None and resp.usage.completion_tokens == 5
    ev = eviction_of(resp.usage)
    check_eviction_block(ev, "snapkv", resp.usage.prompt_tokens)
    after = scrape(http)
    assert metric(after, "vllm_evict:requests", endpoint="chat", policy="snapkv") == \
        metric(before, "vllm_evict:requests", endpoint="chat", policy="snapkv") + 1
    d = {k: metric(after, k, policy="snapkv") - metric(before, k, policy="snapkv")
         for k in ("vllm_evict:evictions", "vllm_evict:eviction_prompt_tokens", "vllm_evict:eviction_kept_tokens",
                   "vllm_evict:eviction_blocks_freed")}
    if ev["evicted"]:  # active once the engine's eviction_report returns data
        assert d["vllm_evict:evictions"] == 1
        assert d["vllm_evict:eviction_prompt_tokens"] == ev["prompt_tokens"]
        assert d["vllm_evict:eviction_kept_tokens"] == pytest.approx(ev["kept_tokens"], abs=1e-3)
        assert d["vllm_evict:eviction_blocks_freed"] == ev["blocks_freed"]
        assert ev["blocks_freed"] > 0, ev  # 0.25 of ~250 tokens must free whole pages
        assert metric(after, "vllm_evict:eviction_compression_ratio", "vllm_evict:eviction_compression_ratio_count",
                      policy="snapkv") >= 1
    else:
        assert all(v == 0 for v in d.values()), d


def test_chat_streaming_with_and_without_eviction(server, http):
    for eviction in (None, {"policy": "dropkv", "budget": 64}):
        body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 5, "stream": True, "ignore_eos": True,
                "stream_options": {"include_usage": True}}
        if eviction:
            body["eviction"] = eviction
        r = http.post("/v1/chat/completions", json=body)
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = sse(r.text)
        assert events[0]["choices"][0]["delta"]["role"] == "assistant"
        assert all(e["object"] == "chat.completion.chunk" and e["model"] == MODEL for e in events)
        text = "".join(c["delta"].get("content") or "" for e in events for c in e["choices"])
        finishes = [c["finish_reason"] for e in events for c in e["choices"] if c["finish_reason"]]
        assert finishes == ["length"] and text
        assert all(e["usage"] is None for e in events[:-1])
        usage = events[-1]["usage"]
        assert events[-1]["choices"] == [] and usage["completion_tokens"] == 5
        check_eviction_block(usage["eviction"], eviction["policy"] if eviction else "none", usage["prompt_tokens"])


def test_chat_streaming_openai_client(client):
    stream = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=4, stream=True, stream_options={"include_usage": True},
        extra_body={"ignore_eos": True, "eviction": {"policy": "snapkv", "budget": 0.5, "allocation": "adakv"}})
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert chunks[-1].usage.completion_tokens == 4
    check_eviction_block(eviction_of(chunks[-1].usage), "snapkv", chunks[-1].usage.prompt_tokens)


def test_completions_non_streaming_and_streaming(client):
    resp = client.completions.create(model=MODEL, prompt=LONG_PROMPT, max_tokens=4, temperature=0,
                                     extra_body={"ignore_eos": True, "eviction": {"policy": "streaming",
                                                                                  "budget": 0.3}})
    assert resp.object == "text_completion" and resp.choices[0].text and resp.usage.completion_tokens == 4
    check_eviction_block(eviction_of(resp.usage), "streaming", resp.usage.prompt_tokens)

    for prompt in ([[5, 6, 7, 8], [9, 10, 11]], ["the key value", "blue green red"]):
        plain = client.completions.create(model=MODEL, prompt=prompt, max_tokens=3, n=2, seed=1,
                                          extra_body={"ignore_eos": True})
        assert sorted(c.index for c in plain.choices) == [0, 1, 2, 3]
        assert plain.usage.completion_tokens == 12
        check_eviction_block(eviction_of(plain.usage), "none", plain.usage.prompt_tokens)

    stream = client.completions.create(model=MODEL, prompt=LONG_PROMPT, max_tokens=4, stream=True,
                                       stream_options={"include_usage": True},
                                       extra_body={"ignore_eos": True, "eviction": {"policy": "knorm", "budget": 96}})
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices)
    assert chunks[-1].usage.completion_tokens == 4
    check_eviction_block(eviction_of(chunks[-1].usage), "knorm", chunks[-1].usage.prompt_tokens)


def test_several_sequences_with_eviction(client):
    # two prompts -> two engine requests, each evicted on its own; n=2 -> parallel samples of one prompt
    resp = client.completions.create(model=MODEL, prompt=[LONG_PROMPT, "x " + LONG_PROMPT], max_tokens=3,
                                     extra_body={"ignore_eos": True, "eviction": {"policy": "snapkv", "budget": 0.25}})
    assert len(resp.choices) == 2 and resp.usage.completion_tokens == 6
    ev = eviction_of(resp.usage)
    check_eviction_block(ev, "snapkv", resp.usage.prompt_tokens)
    if ev["evicted"]:
        assert ev["num_sequences"] == 2 and ev["evicted_sequences"] == 2
    resp = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=3, n=2, temperature=0.8,
                                          seed=3, extra_body={"ignore_eos": True,
                                                              "eviction": {"policy": "snapkv", "budget": 0.25}})
    assert len(resp.choices) == 2 and resp.usage.completion_tokens == 6
    ev = eviction_of(resp.usage)
    check_eviction_block(ev, "snapkv", resp.usage.prompt_tokens)
    if ev["evicted"]:  # every sample is its own engine request with its own report
        assert ev["num_sequences"] == 2 and ev["evicted_sequences"] == 2


def test_sampling_fields(client):
    kw = dict(model=MODEL, prompt=LONG_PROMPT, max_tokens=8, temperature=0, extra_body={"ignore_eos": True})
    greedy = client.completions.create(**kw).choices[0].text
    assert client.completions.create(**kw).choices[0].text == greedy  # greedy is deterministic
    # stop string taken from the greedy output: generation ends right before it
    half = len(greedy) // 2
    starts = [i for i in range(len(greedy) - 1) if greedy[i:i + 2].isalnum()]
    assert starts, greedy
    i = next((i for i in starts if i >= half), starts[-1])
    stop = greedy[i:i + 2]
    cut = client.completions.create(**{**kw, "stop": [stop]}).choices[0]
    assert cut.finish_reason == "stop" and cut.text == greedy[:greedy.find(stop)]
    # seeded sampling is reproducible; max_completion_tokens caps chat output
    sampled = [client.completions.create(model=MODEL, prompt=LONG_PROMPT, max_tokens=6, temperature=1.0, top_p=0.9,
                                         seed=123, extra_body={"ignore_eos": True}).choices[0].text for _ in range(2)]
    assert sampled[0] == sampled[1]
    resp = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_completion_tokens=3,
                                          extra_body={"ignore_eos": True})
    assert resp.usage.completion_tokens == 3 and resp.choices[0].finish_reason == "length"


def test_ignored_openai_fields_are_accepted(client):
    resp = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2, user="u-1",
                                          metadata={"k": "v"}, store=False, presence_penalty=0.1,
                                          frequency_penalty=0.1, logit_bias={"5": -1.0},
                                          extra_body={"ignore_eos": True})
    assert resp.usage.completion_tokens == 2


# ------------------------------------------------------------------------------------------- errors
BAD_EVICTIONS = [
    {"policy": "no-such-policy", "budget": 0.1},
    {"policy": "snapkv", "budget": 0},
    {"policy": "snapkv", "budget": -1},
    {"policy": "snapkv", "budget": 1.5},
    {"policy": "snapkv", "budget": "half"},
    {"policy": "snapkv", "budget": 0.1, "allocation": "zigzag"},
    {"policy": "snapkv", "budget": 0.1, "window": -2},
    {"policy": "snapkv", "budget": 0.1, "pool_kernel": 4},
    {"policy": "snapkv", "budget": 0.1, "unknown_option": 1},
    {"budget": 0.5},
    "snapkv",
    7,
]


@pytest.mark.parametrize("eviction", BAD_EVICTIONS, ids=[str(i) for i in range(len(BAD_EVICTIONS))])
def test_invalid_eviction_400(http, eviction):
    r = http.post("/v1/chat/completions", json={"model": MODEL, "messages": MESSAGES, "max_tokens": 2,
                                                "eviction": eviction})
    err = assert_error(r, 400, param="eviction")
    assert err["type"] == "invalid_request_error"
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 2, "stream": True,
                                           "eviction": eviction})
    assert_error(r, 400, param="eviction")


def test_invalid_eviction_via_openai_client(client):
    with pytest.raises(openai.BadRequestError) as exc:
        client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2,
                                       extra_body={"eviction": {"policy": "snapkv", "budget": 2.5}})
    assert exc.value.status_code == 400 and exc.value.body["param"] == "eviction"


def test_too_long_prompt_400(http, client):
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": LONG_TEXT * 200, "max_tokens": 2})
    assert_error(r, 400, code="context_length_exceeded")
    r = http.post("/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "user", "content": LONG_TEXT * 200}],
                                                "stream": True})
    assert_error(r, 400, code="context_length_exceeded")
    # prompt fits, prompt + max_tokens does not
    r = http.post("/v1/chat/completions", json={"model": MODEL, "messages": MESSAGES, "max_tokens": 4000})
    assert_error(r, 400, param="max_tokens", code="context_length_exceeded")
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt=[1] * 5000, max_tokens=1)
    assert_still_serving(http)


def test_malformed_bodies_400(http):
    assert_error(http.post("/v1/chat/completions", content=b'{"model": ', headers={"content-type": "application/json"}),
                 400)
    assert_error(http.post("/v1/chat/completions", json={"model": MODEL}), 400, param="messages")
    assert_error(http.post("/v1/chat/completions", json={"model": MODEL, "messages": "hi"}), 400)
    assert_error(http.post("/v1/chat/completions", json={"model": MODEL, "messages": MESSAGES, "max_tokens": "many"}),
                 400, param="max_tokens")
    assert_error(http.post("/v1/chat/completions", json={"model": MODEL, "messages": MESSAGES, "temperature": 9}),
                 400, param="temperature")
    assert_error(http.post("/v1/completions", json={"model": MODEL, "prompt": {"a": 1}}), 400)
    assert_error(http.post("/v1/completions", json={"model": MODEL, "prompt": [10 ** 7]}), 400, param="prompt")
    assert_error(http.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "top_p": 0}), 400)
    assert_still_serving(http)


def test_auth_401(server, http):
    base = {"model": MODEL, "messages": MESSAGES, "max_tokens": 2}
    assert_error(httpx.post(server.url + "/v1/chat/completions", json=base), 401, code="invalid_api_key")
    assert_error(httpx.post(server.url + "/v1/chat/completions", json=base,
                            headers={"Authorization": "Bearer wrong"}), 401, code="invalid_api_key")
    assert_error(httpx.get(server.url + "/v1/models", headers={"Authorization": "Basic abc"}), 401)
    bad = openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2)
    assert_still_serving(http)


def test_unknown_model_404(http, client):
    assert_error(http.post("/v1/chat/completions", json={"model": "gpt-17", "messages": MESSAGES}), 404,
                 param="model", code="model_not_found")
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-17", prompt="hi", max_tokens=2)
    assert_still_serving(http)


# ------------------------------------------------------------------------------------------- concurrency
def test_concurrent_mixed_policies(server, http):
    cases = [None, {"policy": "snapkv", "budget": 0.25}, {"policy": "dropkv", "budget": 64},
             {"policy": "streaming", "budget": 0.5}, {"policy": "h2o", "budget": 0.3, "allocation": "adakv"},
             {"policy": "none"}, {"policy": "keydiff", "budget": 80}, {"policy": "tova", "budget": 0.2}]
    before = scrape(http)

    async def one(i: int, eviction):
        ac = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=300)
        extra = {"ignore_eos": True}
        if eviction is not None:
            extra["eviction"] = eviction
        prompt = f"request {i} " + LONG_PROMPT
        async with ac:
            if i % 2 == 0:
                stream = await ac.chat.completions.create(
                    model=MODEL, messages=[{"role": "user", "content": prompt}], max_tokens=6, stream=True,
                    stream_options={"include_usage": True}, extra_body=extra)
                chunks = [c async for c in stream]
                return chunks[-1].usage
            if i % 4 == 1:
                resp = await ac.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": prompt}],
                                                        max_tokens=6, extra_body=extra)
            else:
                resp = await ac.completions.create(model=MODEL, prompt=prompt, max_tokens=6, extra_body=extra)
            return resp.usage

    async def run_all():
        return await asyncio.gather(*(one(i, ev) for i, ev in enumerate(cases)))

    usages = asyncio.run(run_all())
    evicted = 0
    for eviction, usage in zip(cases, usages):
        assert usage.completion_tokens == 6
        policy = (eviction or {}).get("policy", "none")
        ev = eviction_of(usage)
        check_eviction_block(ev, policy, usage.prompt_tokens)
        evicted += bool(ev["evicted"])
    after = scrape(http)
    assert metric(after, "vllm_evict:generation_tokens") >= metric(before, "vllm_evict:generation_tokens") + 6 * len(cases)
    assert metric(after, "vllm_evict:evictions") - metric(before, "vllm_evict:evictions") == evicted
    # everything finished: nothing running, all blocks back
    assert wait_for_metric(http, "vllm_evict:num_requests_running", lambda v: v == 0) == 0
    assert wait_for_metric(http, "vllm_evict:kv_cache_used_blocks", lambda v: v == 0) == 0
    assert_still_serving(http)


# ------------------------------------------------------------------------------------------- disconnects
def test_client_disconnect_mid_stream_aborts(server, http):
    before = scrape(http)
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 3500, "ignore_eos": True, "stream": True,
            "eviction": {"policy": "snapkv", "budget": 0.25}}
    with httpx.Client(base_url=server.url, headers=server.headers(), timeout=300) as c:
        with c.stream("POST", "/v1/chat/completions", json=body) as r:
            assert r.status_code == 200
            got = 0
            for line in r.iter_lines():
                if line.startswith("data: "):
                    got += 1
                if got >= 4:
                    break
            # the gauge is refreshed by the engine's stat logger: poll instead of reading once
            assert wait_for_metric(http, "vllm_evict:num_requests_running", lambda v: v >= 1) >= 1
        # leaving the block closes the connection mid-stream
    assert wait_for_metric(http, "vllm_evict:num_requests_running", lambda v: v == 0) == 0
    assert wait_for_metric(http, "vllm_evict:kv_cache_used_blocks", lambda v: v == 0) == 0
    after = scrape(http)
    assert metric(after, "vllm_evict:requests_aborted") == metric(before, "vllm_evict:requests_aborted") + 1
    # far fewer than 3500 tokens were generated
    assert metric(after, "vllm_evict:generation_tokens") - metric(before, "vllm_evict:generation_tokens") < 3000
    assert httpx.get(server.url + "/health").status_code == 200
    assert_still_serving(http)


def test_client_disconnect_non_streaming_aborts(server, http):
    before = scrape(http)
    body = {"model": MODEL, "prompt": LONG_PROMPT, "max_tokens": 3500, "ignore_eos": True}
    # A raw socket: send the request, read nothing, hang up after 1.5 s (3500 tokens take far longer).
    # The server must notice the hang-up, not a client-side timeout whose semantics vary.
    payload = json.dumps(body).encode()
    headers = {"Host": "127.0.0.1", "Content-Type": "application/json", "Content-Length": str(len(payload)),
               **server.headers()}
    head = "POST /v1/completions HTTP/1.1\r\n" + "".join(f"{k}: {v}\r\n" for k, v in headers.items()) + "\r\n"
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        sock.sendall(head.encode() + payload)
        time.sleep(1.5)
    assert wait_for_metric(http, "vllm_evict:num_requests_running", lambda v: v == 0) == 0
    after = scrape(http)
    assert metric(after, "vllm_evict:requests_aborted") == metric(before, "vllm_evict:requests_aborted") + 1
    assert metric(after, "vllm_evict:generation_tokens") - metric(before, "vllm_evict:generation_tokens") < 3000
    assert httpx.get(server.url + "/health").status_code == 200
    assert_still_serving(http)
