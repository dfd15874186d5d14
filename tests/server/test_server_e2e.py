"""End to end: a real `vllm-evict serve` (vLLM's own OpenAI API server plus the plugin; tiny model on CPU,
started once for this module with `--api-key`) driven by the official `openai` client and raw `httpx`.

The server is started without a MODEL argument (so `vllm-evict serve` alone must serve the tiny local model
as `tiny-llama`) and with a server default policy (`--default-eviction-policy dropkv
--default-eviction-budget 0.25`): every request evicts unless it says otherwise, `{"policy": "none"}`
opts out, a request's `eviction` object (or flat `eviction_*` keys in `vllm_xargs`) overrides the defaults
field by field.

Requests that use a long prompt (~210 tokens, 14 blocks of 16) must really evict: `usage.eviction.evicted`
is true and `blocks_freed` > 0. Each test uses its own prompt text, so prefix-cache hits of another test's
requests do not change what it sees.
"""

from __future__ import annotations

import json
import time

import pytest

pytestmark = pytest.mark.engine

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from vllm_evict.server.metrics import METRIC_NAMES  # noqa: E402

API_KEY = "test-secret"
MODEL = "tiny-llama"
DEFAULT_POLICY, DEFAULT_BUDGET = "dropkv", 0.25
SERVER_ARGS = ["--default-eviction-policy", DEFAULT_POLICY, "--default-eviction-budget", str(DEFAULT_BUDGET)]
EVICT = {"policy": "snapkv", "budget": 0.25}  # an explicit request object (differs from the default policy)
LONG_TEXT = ("the key value of the city river blue green red sky grass sun moon code token cache page head layer "
             "attention query memory model request budget policy evict keep score window prompt answer question ")


def long_prompt(tag: str) -> str:
    """~210 tokens, starting with `tag` (a distinct prefix per test: no prefix-cache sharing across tests)."""
    return f"{tag}: " + LONG_TEXT * 6


def messages(tag: str) -> list[dict]:
    return [{"role": "system", "content": "You are a tiny test model."}, {"role": "user", "content": long_prompt(tag)}]


@pytest.fixture(scope="module")
def server(tiny_llama, server_factory):
    # tiny_llama builds the model into VLLM_EVICT_CACHE first; `serve` without MODEL then finds it there
    return server_factory(api_key=API_KEY, extra_args=SERVER_ARGS)


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=300) as c:
        yield c


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, headers=server.headers(), timeout=300) as c:
        yield c


# ------------------------------------------------------------------------------------------- helpers
def scrape(http) -> dict[str, dict[tuple, float]]:
    """{family name: {(sample name, sorted labels): value}} from /metrics."""
    r = http.get("/metrics")
    assert r.status_code == 200, r.text
    out: dict[str, dict[tuple, float]] = {}
    for fam in text_string_to_metric_families(r.text):
        for s in fam.samples:
            out.setdefault(fam.name, {})[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def sample_names(http) -> set[str]:
    return {name for fam in scrape(http).values() for name, _ in fam}


def metric(m, family: str, sample: str | None = None, **labels) -> float:
    """Sum of a family's samples named `sample` (default: the family's main sample) matching `labels`."""
    total = 0.0
    for (name, lbls), value in m.get(family, {}).items():
        if sample is not None and name != sample:
            continue
        if sample is None and name not in (family, family + "_total"):
            continue
        d = dict(lbls)
        if all(d.get(k) == v for k, v in labels.items()):
            total += value
    return total


def wait_for(http, predicate, timeout: float = 30.0) -> dict:
    """Poll /metrics until `predicate(scrape)` holds (or the timeout passes); the last scrape."""
    deadline = time.time() + timeout
    while True:
        m = scrape(http)
        if predicate(m) or time.time() > deadline:
            return m
        time.sleep(0.2)


def wait_for_metric(http, family: str, predicate, timeout: float = 30.0) -> float:
    """Poll /metrics until `predicate(value)` holds (or the timeout passes); the last value read."""
    return metric(wait_for(http, lambda m: predicate(metric(m, family)), timeout), family)


def eviction_of(usage) -> dict:
    d = usage.model_extra.get("eviction") if hasattr(usage, "model_extra") else usage.get("eviction")
    assert isinstance(d, dict), usage
    return d


def check_sequence(s: dict, policy: str, prompt_tokens: int | None = None) -> None:
    """One engine request's report, which must have evicted (long prompt)."""
    assert s["evicted"] is True and s["policy"] == policy, s
    assert s["blocks_freed"] > 0, s  # a quarter of ~210 tokens must free whole 16-token blocks
    assert s["blocks_before"] - s["blocks_after"] == s["blocks_freed"], s
    assert 0 < s["kept_tokens"] < s["prompt_tokens"], s
    assert 0 < s["compression_ratio"] < 1.0, s
    if prompt_tokens is not None:
        assert s["prompt_tokens"] == prompt_tokens, s


def assert_evicted(ev: dict, policy: str, prompt_tokens: int | None = None, num_sequences: int = 1) -> dict:
    """`usage.eviction` of a response whose every sequence evicted; returns it."""
    if num_sequences == 1:
        assert "sequences" not in ev, ev
        check_sequence(ev, policy, prompt_tokens)
        return ev
    assert ev["evicted"] is True and ev["policy"] == policy, ev
    assert ev["num_sequences"] == ev["evicted_sequences"] == len(ev["sequences"]) == num_sequences, ev
    for s in ev["sequences"]:
        check_sequence(s, policy)
    assert ev["blocks_freed"] == sum(s["blocks_freed"] for s in ev["sequences"]) > 0
    assert ev["prompt_tokens"] == sum(s["prompt_tokens"] for s in ev["sequences"])
    return ev


def create(client, endpoint: str, tag: str, *, stream: bool = False, **kw):
    """One chat or completion request for `long_prompt(tag)` (unless `prompt` / `messages` is given).
    Returns (texts by choice index, finish reasons by choice index, usage); a stream is read to its end
    with `include_usage`, and its chunks checked: usage only in the final, choice-less chunk."""
    if endpoint == "chat":
        kw.setdefault("messages", messages(tag))
        fn = client.chat.completions.create
    else:
        kw.setdefault("prompt", long_prompt(tag))
        fn = client.completions.create
    texts: dict[int, str] = {}
    finishes: dict[int, str] = {}
    if not stream:
        resp = fn(model=MODEL, **kw)
        assert resp.model == MODEL
        for c in resp.choices:
            texts[c.index] = c.message.content if endpoint == "chat" else c.text
            finishes[c.index] = c.finish_reason
        return texts, finishes, resp.usage
    chunks = list(fn(model=MODEL, stream=True, stream_options={"include_usage": True}, **kw))
    assert len(chunks) >= 2
    assert chunks[-1].choices == [] and chunks[-1].usage is not None, chunks[-1]
    assert all(c.usage is None for c in chunks[:-1])
    for chunk in chunks[:-1]:
        assert chunk.object == ("chat.completion.chunk" if endpoint == "chat" else "text_completion")
        for c in chunk.choices:
            piece = (c.delta.content if endpoint == "chat" else c.text) or ""
            texts[c.index] = texts.get(c.index, "") + piece
            if c.finish_reason:
                assert c.index not in finishes, "two finish reasons for one choice"
                finishes[c.index] = c.finish_reason
    return texts, finishes, chunks[-1].usage


def assert_error(r, status: int, param: str | None = None) -> dict:
    """An OpenAI-style error response (JSON, not a stream)."""
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/json"), r.headers
    body = r.json()
    assert set(body) == {"error"} and {"message", "type", "param", "code"} <= set(body["error"]), body
    if param is not None:
        assert body["error"]["param"] == param, body
    return body["error"]


def assert_still_serving(client) -> None:
    texts, finishes, usage = create(client, "completions", "still serving", max_tokens=2,
                                    extra_body={"ignore_eos": True})
    assert usage.completion_tokens == 2 and finishes == {0: "length"}
    assert_evicted(eviction_of(usage), DEFAULT_POLICY, usage.prompt_tokens)


# ------------------------------------------------------------------------------------------- basics
def test_health_and_models(server, client):
    assert httpx.get(server.url + "/health").status_code == 200  # no key needed
    assert [m.id for m in client.models.list().data] == [MODEL]


def test_api_key_required(server, client):
    body = {"model": MODEL, "prompt": "the key value", "max_tokens": 2}
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Basic {API_KEY}"}):
        assert httpx.post(server.url + "/v1/completions", json=body, headers=headers).status_code == 401
        assert httpx.post(server.url + "/v1/chat/completions", headers=headers,
                          json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}).status_code == 401
        assert httpx.get(server.url + "/v1/models", headers=headers).status_code == 401
    with openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0) as bad:
        with pytest.raises(openai.AuthenticationError):
            bad.completions.create(model=MODEL, prompt="the key value", max_tokens=2)
    assert httpx.post(server.url + "/v1/completions", json=body,
                      headers={"Authorization": f"Bearer {API_KEY}"}).status_code == 200
    assert_still_serving(client)


@pytest.mark.parametrize("stream", [False, True], ids=["full", "stream"])
@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_generation_evicts(client, endpoint, stream):
    """An explicit `eviction` object: the request evicts, and `usage.eviction` says so (streams: in the
    final usage chunk)."""
    texts, finishes, usage = create(client, endpoint, f"gen {endpoint} {stream}", stream=stream, max_tokens=5,
                                    temperature=0, extra_body={"ignore_eos": True, "eviction": EVICT})
    assert list(texts) == [0] and texts[0] and finishes == {0: "length"}
    assert usage.completion_tokens == 5 and usage.prompt_tokens > 200
    assert usage.total_tokens == usage.prompt_tokens + 5
    ev = assert_evicted(eviction_of(usage), EVICT["policy"], usage.prompt_tokens)
    assert ev["budget"] == EVICT["budget"]


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_server_default_policy_evicts(client, endpoint):
    """No `eviction` field: the server's `--default-eviction-*` apply."""
    _, _, usage = create(client, endpoint, f"default {endpoint}", max_tokens=3, extra_body={"ignore_eos": True})
    ev = assert_evicted(eviction_of(usage), DEFAULT_POLICY, usage.prompt_tokens)
    assert ev["budget"] == DEFAULT_BUDGET


def test_partial_object_merges_with_defaults(client):
    _, _, usage = create(client, "completions", "merge", max_tokens=3,
                         extra_body={"ignore_eos": True, "eviction": {"budget": 0.5}})
    ev = assert_evicted(eviction_of(usage), DEFAULT_POLICY, usage.prompt_tokens)
    assert ev["budget"] == 0.5
    assert ev["kept_tokens"] > usage.prompt_tokens * 0.25  # more kept than the default budget would


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_policy_none_opts_out(client, http, endpoint):
    before = scrape(http)
    for extra in ({"eviction": {"policy": "none"}}, {"vllm_xargs": {"eviction_policy": "none"}}):
        texts, _, usage = create(client, endpoint, f"none {endpoint}", max_tokens=3,
                                 extra_body={"ignore_eos": True, **extra})
        assert texts[0] and usage.completion_tokens == 3
        assert eviction_of(usage) == {"policy": "none", "evicted": False}
    after = scrape(http)
    assert metric(after, "vllm_evict:evictions") == metric(before, "vllm_evict:evictions")


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_vllm_xargs_flat_keys_evict(client, endpoint):
    _, _, usage = create(client, endpoint, f"xargs {endpoint}", max_tokens=3, extra_body={
        "ignore_eos": True, "vllm_xargs": {"eviction_policy": "snapkv", "eviction_budget": 0.5}})
    ev = assert_evicted(eviction_of(usage), "snapkv", usage.prompt_tokens)
    assert ev["budget"] == 0.5


# ------------------------------------------------------------------------------------------- sampling features
def test_chat_logprobs(client):
    resp = client.chat.completions.create(model=MODEL, messages=messages("logprobs chat"), max_tokens=4,
                                          logprobs=True, top_logprobs=3,
                                          extra_body={"ignore_eos": True, "eviction": EVICT})
    content = resp.choices[0].logprobs.content
    assert len(content) == resp.usage.completion_tokens == 4
    for t in content:
        assert t.logprob <= 0 and len(t.top_logprobs) == 3
        assert all(top.logprob <= 0 for top in t.top_logprobs)
        if t.token in {top.token for top in t.top_logprobs}:
            assert t.logprob == pytest.approx(next(top.logprob for top in t.top_logprobs if top.token == t.token))
    assert_evicted(eviction_of(resp.usage), EVICT["policy"], resp.usage.prompt_tokens)


def test_completion_logprobs(client):
    resp = client.completions.create(model=MODEL, prompt=long_prompt("logprobs completion"), max_tokens=4,
                                     logprobs=2, extra_body={"ignore_eos": True, "eviction": EVICT})
    lp = resp.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 4
    assert all(v <= 0 for v in lp.token_logprobs)
    assert all(2 <= len(top) <= 3 for top in lp.top_logprobs)  # the sampled token may come on top
    assert_evicted(eviction_of(resp.usage), EVICT["policy"], resp.usage.prompt_tokens)


@pytest.mark.parametrize("endpoint,stream", [("chat", False), ("completions", True)])
def test_n2_reports_each_sequence(client, endpoint, stream):
    texts, finishes, usage = create(client, endpoint, f"n2 {endpoint}", stream=stream, n=2, max_tokens=3,
                                    temperature=1.0, seed=3, extra_body={"ignore_eos": True, "eviction": EVICT})
    assert sorted(texts) == [0, 1] and finishes == {0: "length", 1: "length"}
    assert usage.completion_tokens == 6
    ev = assert_evicted(eviction_of(usage), EVICT["policy"], num_sequences=2)
    assert sorted(s["index"] for s in ev["sequences"]) == [0, 1]
    assert all("prompt_index" not in s for s in ev["sequences"])
    assert all(s["prompt_tokens"] == usage.prompt_tokens for s in ev["sequences"])  # one prompt, counted once


@pytest.mark.parametrize("stream", [False, True], ids=["full", "stream"])
def test_batched_completion_reports_prompt_index(client, stream):
    prompts = [long_prompt("batch a"), "x y z " + long_prompt("batch b")]
    texts, finishes, usage = create(client, "completions", "", stream=stream, prompt=prompts, max_tokens=3,
                                    extra_body={"ignore_eos": True, "eviction": EVICT})
    assert sorted(texts) == [0, 1] and finishes == {0: "length", 1: "length"}
    assert usage.completion_tokens == 6
    ev = assert_evicted(eviction_of(usage), EVICT["policy"], num_sequences=2)
    seqs = sorted(ev["sequences"], key=lambda s: s["prompt_index"])
    assert [(s["prompt_index"], s["index"]) for s in seqs] == [(0, 0), (1, 0)]
    assert seqs[0]["prompt_tokens"] < seqs[1]["prompt_tokens"]  # each report belongs to its own prompt
    assert seqs[0]["prompt_tokens"] + seqs[1]["prompt_tokens"] == usage.prompt_tokens


def greedy_and_stop(client, tag: str, *, stream: bool = False):
    """A greedy evicting completion, then the same request with a stop string taken from the second part
    of its output (its first occurrence: several tokens in). Returns (greedy text, stop, stopped response's
    texts, finish reasons, usage)."""
    kw = dict(prompt=long_prompt(tag), max_tokens=16, temperature=0,
              extra_body={"ignore_eos": True, "eviction": EVICT})
    texts, finishes, usage = create(client, "completions", "", **kw)
    assert finishes == {0: "length"}
    assert_evicted(eviction_of(usage), EVICT["policy"], usage.prompt_tokens)
    text = texts[0]
    assert create(client, "completions", "", **kw)[0][0] == text  # greedy with eviction is deterministic
    candidates = [text[i:i + n] for n in (4, 3, 2) for i in range(len(text) // 3, len(text) - n + 1)]
    stop = next((c for c in candidates if c.strip() and "\ufffd" not in c and text.find(c) >= len(text) // 3),
                None)
    assert stop is not None, text
    texts, finishes, usage = create(client, "completions", "", stream=stream, stop=[stop, "never-in-output-xyz"],
                                    **kw)
    return text, stop, texts, finishes, usage


@pytest.mark.parametrize("stream", [False, True], ids=["full", "stream"])
def test_stop_strings(client, stream):
    text, stop, texts, finishes, usage = greedy_and_stop(client, f"stop {stream}", stream=stream)
    assert finishes == {0: "stop"} and texts[0] == text[:text.find(stop)], (text, stop, texts)
    assert 1 < usage.completion_tokens < 16
    ev = eviction_of(usage)
    assert ev["policy"] == EVICT["policy"] and isinstance(ev["evicted"], bool)


def test_stop_string_reports_eviction(client, http):
    """A stop string is matched in the API process, which ends the request itself: the report that the
    engine sent after compaction must still reach the usage block and the metrics."""
    before = scrape(http)
    text, stop, texts, finishes, usage = greedy_and_stop(client, "stop report")
    assert finishes == {0: "stop"}
    assert_evicted(eviction_of(usage), EVICT["policy"], usage.prompt_tokens)
    # three evicting requests, each counted
    assert metric(scrape(http), "vllm_evict:evictions") == metric(before, "vllm_evict:evictions") + 3


CHOICES = ["alpha", "beta", "gamma"]


@pytest.mark.parametrize("stream", [False, True], ids=["full", "stream"])
def test_structured_output_choice(client, stream):
    """vLLM's `structured_outputs` field (the output is one of the choices, then EOS)."""
    texts, finishes, usage = create(client, "chat", f"choice {stream}", stream=stream, max_tokens=16,
                                    extra_body={"structured_outputs": {"choice": CHOICES}, "eviction": EVICT})
    assert texts[0] in CHOICES and finishes == {0: "stop"}, texts
    assert_evicted(eviction_of(usage), EVICT["policy"], usage.prompt_tokens)


# a top-level enum: no room for free whitespace, which a random model could repeat until max_tokens (in an
# object schema, `disable_any_whitespace` did not prevent that with vLLM 0.26 on CPU)
COLOR_SCHEMA = {"type": "string", "enum": ["red", "green", "blue"]}


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_structured_output_json_schema(client, endpoint):
    fmt = {"type": "json_schema", "json_schema": {"name": "color", "schema": COLOR_SCHEMA}}
    if endpoint == "chat":
        kw = {"response_format": fmt, "extra_body": {"eviction": EVICT}}
    else:  # not a parameter of the client's completions.create
        kw = {"extra_body": {"response_format": fmt, "eviction": EVICT}}
    texts, finishes, usage = create(client, endpoint, f"json schema {endpoint}", max_tokens=32, **kw)
    assert finishes == {0: "stop"}, texts
    assert json.loads(texts[0]) in COLOR_SCHEMA["enum"]
    assert_evicted(eviction_of(usage), EVICT["policy"], usage.prompt_tokens)


def test_tokenize_detokenize(client, http):
    r = http.post("/tokenize", json={"model": MODEL, "prompt": long_prompt("tokenize")})
    assert r.status_code == 200, r.text
    tok = r.json()
    assert tok["count"] == len(tok["tokens"]) > 200 and tok["max_model_len"] == 4096
    resp = client.completions.create(model=MODEL, prompt=long_prompt("tokenize"), max_tokens=1,
                                     extra_body={"ignore_eos": True})
    assert resp.usage.prompt_tokens == tok["count"]
    r = http.post("/detokenize", json={"model": MODEL, "tokens": tok["tokens"]})
    assert r.status_code == 200, r.text
    assert r.json()["prompt"] == long_prompt("tokenize")
    # chat messages: the count the chat endpoint bills (chat template applied)
    r = http.post("/tokenize", json={"model": MODEL, "messages": messages("tokenize chat")})
    assert r.status_code == 200, r.text
    chat = client.chat.completions.create(model=MODEL, messages=messages("tokenize chat"), max_tokens=1,
                                          extra_body={"ignore_eos": True})
    assert r.json()["count"] == chat.usage.prompt_tokens > tok["count"]


# ------------------------------------------------------------------------------------------- invalid eviction
BAD_EVICTIONS = [
    {"policy": "no-such-policy", "budget": 0.1},
    {"policy": "snapkv", "budget": 1.5},
    {"policy": "snapkv", "budget": 0},
    {"policy": "snapkv", "budget": "half"},
    {"policy": "snapkv", "budget": 0.1, "allocation": "zigzag"},
    {"policy": "snapkv", "budget": 0.1, "unknown_option": 1},
    "snapkv",
    7,
    [{"policy": "snapkv"}],
]


@pytest.mark.parametrize("eviction", BAD_EVICTIONS, ids=[json.dumps(e) for e in BAD_EVICTIONS])
def test_invalid_eviction_400(http, eviction):
    for stream in (False, True):
        for path, body in (("/v1/chat/completions", {"messages": messages("bad")}),
                           ("/v1/completions", {"prompt": long_prompt("bad")})):
            r = http.post(path, json={"model": MODEL, "max_tokens": 2, "stream": stream, "eviction": eviction,
                                      **body})
            err = assert_error(r, 400, param="eviction")  # before any stream starts: no 200 + error event
            assert "eviction" in err["message"], err


def test_invalid_eviction_via_client_and_xargs(client, http):
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError) as exc:
            client.chat.completions.create(model=MODEL, messages=messages("bad client"), max_tokens=2,
                                           stream=stream, extra_body={"eviction": {"policy": "snapkv",
                                                                                   "budget": 2.5}})
        assert exc.value.status_code == 400 and exc.value.body["param"] == "eviction"
        for xargs in ({"eviction_policy": "snapkv", "eviction_budget": 1.5},
                      {"eviction_policy": "no-such-policy", "eviction_budget": 0.5}):
            r = http.post("/v1/completions", json={"model": MODEL, "prompt": "the key value", "max_tokens": 2,
                                                   "stream": stream, "vllm_xargs": xargs})
            assert_error(r, 400, param="eviction")
    assert_still_serving(client)


@pytest.mark.parametrize("stream", [False, True])
def test_decode_budget_below_the_page_size_400(client, http, stream):
    """The rule that needs the engine's page size (16 tokens here) is checked before any stream starts too."""
    for path, body in (("/v1/chat/completions", {"messages": messages("small decode budget"),
                                                  "eviction": {"policy": "dropkv", "decode_budget": 3}}),
                       ("/v1/completions", {"prompt": long_prompt("small decode budget"),
                                            "vllm_xargs": {"eviction_policy": "dropkv", "eviction_decode_budget": 3}})):
        r = http.post(path, json={"model": MODEL, "max_tokens": 2, "stream": stream, **body})
        message = assert_error(r, 400, param="eviction")["message"]
        assert "decode_budget" in message and "page size (16 tokens)" in message, message
    assert_still_serving(client)


# ------------------------------------------------------------------------------------------- metrics
def test_metrics(client, http):
    _, _, usage = create(client, "completions", "metrics warmup", max_tokens=2, extra_body={"ignore_eos": True})
    assert_evicted(eviction_of(usage), DEFAULT_POLICY)
    # decode-time eviction: the report's decode compactions and tokens reach the decode counters
    before = scrape(http)
    decode = {"policy": "dropkv", "decode_budget": 16, "decode_every": 16}
    _, _, usage = create(client, "completions", "metrics decode", max_tokens=40,
                         extra_body={"ignore_eos": True, "eviction": decode})
    ev = eviction_of(usage)
    assert ev["decode_compactions"] >= 2 and ev["decode_evicted_tokens"] > 0, ev
    after = scrape(http)
    for family, key in (("vllm_evict:decode_compactions", "decode_compactions"),
                        ("vllm_evict:decode_evicted_tokens", "decode_evicted_tokens")):
        delta = metric(after, family, policy="dropkv") - metric(before, family, policy="dropkv")
        assert delta == pytest.approx(ev[key], abs=1e-3), family
    names = sample_names(http)
    assert METRIC_NAMES and all(n.startswith("vllm_evict:") for n in METRIC_NAMES)
    missing = [n for n in METRIC_NAMES if not names & {n + s for s in ("", "_total", "_bucket", "_count", "_sum")}]
    assert not missing, f"not on /metrics: {missing}"

    before = scrape(http)
    _, _, usage = create(client, "chat", "metrics", max_tokens=3,
                         extra_body={"ignore_eos": True, "eviction": EVICT})
    ev = assert_evicted(eviction_of(usage), EVICT["policy"], usage.prompt_tokens)
    after = scrape(http)
    policy = EVICT["policy"]
    assert metric(after, "vllm_evict:evictions", policy=policy) == metric(before, "vllm_evict:evictions",
                                                                          policy=policy) + 1
    assert metric(after, "vllm_evict:evictions") == metric(before, "vllm_evict:evictions") + 1
    for family, value in (("vllm_evict:eviction_blocks_freed", ev["blocks_freed"]),
                          ("vllm_evict:eviction_prompt_tokens", ev["prompt_tokens"]),
                          ("vllm_evict:eviction_kept_tokens", ev["kept_tokens"])):
        delta = metric(after, family, policy=policy) - metric(before, family, policy=policy)
        assert delta == pytest.approx(value, abs=1e-3), family
    for hist in ("vllm_evict:eviction_compression_ratio", "vllm_evict:eviction_latency_seconds"):
        count = hist + "_count"
        assert metric(after, hist, count, policy=policy) == metric(before, hist, count, policy=policy) + 1
    assert metric(after, "vllm_evict:kv_cache_blocks") > 0


# ------------------------------------------------------------------------------------------- disconnects
def hang_up_mid_stream(server, http, tag: str, max_tokens: int) -> tuple[dict, dict]:
    """Stream a long completion, close the connection after its first two chunks, and wait until the engine
    is idle again. The scrapes (before, after)."""
    running, usage = "vllm:num_requests_running", "vllm:kv_cache_usage_perc"
    # idle state first: nothing running, and the KV-cache usage that goes with it
    assert wait_for_metric(http, running, lambda v: v == 0) == 0
    before = scrape(http)
    idle_usage = metric(before, usage)
    with openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=300) as c:
        stream = c.completions.create(model=MODEL, prompt=long_prompt(tag), max_tokens=max_tokens,
                                      stream=True, extra_body={"ignore_eos": True, "eviction": EVICT})
        chunks = [next(stream), next(stream)]
        assert all(ch.choices and ch.choices[0].finish_reason is None for ch in chunks)
        # Hang up at once: the gauges lag the engine by seconds under load, and the tiny model decodes
        # max_tokens in about that time on a fast CPU, so waiting to see it running could outlast it.
        stream.close()
    after = wait_for(http, lambda m: metric(m, running) == 0 and metric(m, usage) <= idle_usage
                     and metric(m, "vllm_evict:kv_cache_used_blocks") == 0)
    assert metric(after, running) == 0
    assert metric(after, usage) <= idle_usage
    assert metric(after, "vllm_evict:kv_cache_used_blocks") == 0
    return before, after


def test_client_disconnect_mid_stream_frees_blocks(server, http):
    # prompt + max_tokens just under --max-model-len 4096: seconds of decoding on a CPU. On a 2-core machine
    # the engine can still finish before the hang-up reaches it (this process starved for that long). Such
    # an attempt observes no abort, so it is repeated; an abort must show within three.
    max_tokens = 3800
    for attempt in range(3):
        before, m = hang_up_mid_stream(server, http, f"disconnect {attempt}", max_tokens)
        generated = metric(m, "vllm:generation_tokens") - metric(before, "vllm:generation_tokens")
        if generated < max_tokens:
            break
    # aborted, not run to its end
    assert 2 <= generated < max_tokens, generated
    assert ("vllm:request_success_total", (("engine", "0"), ("finished_reason", "length"), ("model_name", MODEL))) \
        in m["vllm:request_success"]
    assert metric(m, "vllm:request_success", finished_reason="length") == \
        metric(before, "vllm:request_success", finished_reason="length")
    # its eviction happened (before the hang-up) and is counted although the request never finished
    assert metric(m, "vllm_evict:evictions") == metric(before, "vllm_evict:evictions") + 1
    assert httpx.get(server.url + "/health").status_code == 200
