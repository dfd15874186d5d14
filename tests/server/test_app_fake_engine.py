"""Server logic against a scripted fake engine (no vLLM engine start: fast, runs everywhere).

The real-engine end-to-end tests are in test_server_e2e.py (marked `engine`).
"""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import pytest

pytest.importorskip("vllm")

from fastapi.testclient import TestClient  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from server.app import create_app  # noqa: E402
from server.metrics import METRIC_NAMES, ServerMetrics, SlidingWindowRate, make_stat_logger_factory  # noqa: E402

MAX_MODEL_LEN = 128
FAKE_REPORT = {"policy": "snapkv", "allocation": "uniform", "budget": 0.5, "prompt_tokens": 40,
               "kept_tokens_per_head": [[20.0, 20.0], [20.0, 20.0]], "blocks_before": 6, "blocks_after": 4,
               "blocks_freed": 2, "latency_ms": 3.5}


class FakeEngine:
    """Mimics the AsyncLLM surface the app uses; emits token ids 10, 11, ... one per step."""

    def __init__(self, tokenizer, report=None, step_s: float = 0.0):
        self.tokenizer = tokenizer
        self.model_config = SimpleNamespace(max_model_len=MAX_MODEL_LEN, model="/fake/model",
                                            served_model_name="fake", get_vocab_size=lambda: len(tokenizer))
        self.errored = False
        self.report = report
        self.step_s = step_s
        self.seen: list[tuple[list[int], object, str]] = []
        self.aborted: list[str] = []
        self.active: set[str] = set()

    def get_tokenizer(self):
        return self.tokenizer

    async def check_health(self):
        return None

    async def abort(self, request_id, internal=False):
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        self.aborted.extend(ids)

    async def generate(self, prompt, sp, request_id):
        from vllm.outputs import CompletionOutput, RequestOutput

        ids = list(prompt["prompt_token_ids"])
        self.seen.append((ids, sp, request_id))
        self.active.add(request_id)
        try:
            for step in range(sp.max_tokens):
                if self.step_s:
                    await asyncio.sleep(self.step_s)
                else:
                    await asyncio.sleep(0)
                last = step == sp.max_tokens - 1
                outs = [CompletionOutput(index=i, text=self.tokenizer.decode([10 + step]), token_ids=[10 + step],
                                         cumulative_logprob=None, logprobs=None,
                                         finish_reason="length" if last else None)
                        for i in range(sp.n)]
                params = None
                if last and self.report and sp.extra_args and "vllm_evict" in sp.extra_args:
                    params = {"vllm_evict": dict(self.report)}
                yield RequestOutput(request_id=request_id, prompt=prompt.get("prompt"), prompt_token_ids=ids,
                                    prompt_logprobs=None, outputs=outs, finished=last, kv_transfer_params=params)
        except (asyncio.CancelledError, GeneratorExit):
            self.aborted.append(request_id)
            raise
        finally:
            self.active.discard(request_id)


@pytest.fixture(scope="module")
def tokenizer(tiny_llama):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_llama)


def make_client(tokenizer, **kwargs):
    engine = FakeEngine(tokenizer, report=kwargs.pop("report", None), step_s=kwargs.pop("step_s", 0.0))
    metrics = ServerMetrics()
    app = create_app(engine, served_model_names=["fake", "alias"], metrics=metrics, log_stats_interval_s=None,
                     **kwargs)
    return TestClient(app), engine, metrics


@pytest.fixture
def client(tokenizer):
    c, engine, metrics = make_client(tokenizer, report=FAKE_REPORT)
    with c:
        yield c, engine, metrics


CHAT = {"model": "fake", "messages": [{"role": "user", "content": "the key value of the city"}], "max_tokens": 4}


def assert_openai_error(resp, status, param=None):
    assert resp.status_code == status, resp.text
    body = resp.json()
    assert set(body) == {"error"}
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["message"]
    if param is not None:
        assert body["error"]["param"] == param, body
    return body["error"]


def sse_events(text: str) -> list:
    events = [line[len("data: "):] for line in text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


# ------------------------------------------------------------------------------------------- happy paths
def test_chat_non_streaming_with_eviction(client):
    c, engine, _ = client
    r = c.post("/v1/chat/completions", json={**CHAT, "eviction": {"policy": "snapkv", "budget": 0.5}})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "chat.completion" and body["model"] == "fake"
    assert body["choices"][0]["message"]["role"] == "assistant"
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"]["completion_tokens"] == 4
    prompt_ids, sp, _ = engine.seen[-1]
    assert body["usage"]["prompt_tokens"] == len(prompt_ids)
    assert sp.extra_args == {"vllm_evict": {"policy": "snapkv", "budget": 0.5, "allocation": "uniform",
                                            "gqa": "mean", "alpha": 0.2, "caote_base": "snapkv",
                                            "chunked": False}}
    evb = body["usage"]["eviction"]
    assert evb["evicted"] is True and evb["blocks_freed"] == 2 and evb["kept_tokens"] == 20.0
    assert evb["compression_ratio"] == pytest.approx(0.5)
    # the chat template was applied
    assert engine.tokenizer.decode(prompt_ids).startswith("<|im_start|>user\n")


def test_chat_without_eviction_reports_none(client):
    c, engine, _ = client
    r = c.post("/v1/chat/completions", json=CHAT)
    assert r.status_code == 200
    assert r.json()["usage"]["eviction"] == {"policy": "none", "evicted": False}
    assert engine.seen[-1][1].extra_args is None
    r = c.post("/v1/chat/completions", json={**CHAT, "eviction": {"policy": "none"}})
    assert r.status_code == 200 and engine.seen[-1][1].extra_args is None


def test_no_engine_report_is_not_faked(tokenizer):
    c, _, _ = make_client(tokenizer, report=None)
    with c:
        r = c.post("/v1/chat/completions", json={**CHAT, "eviction": {"policy": "dropkv", "budget": 8}})
    assert r.status_code == 200
    evb = r.json()["usage"]["eviction"]
    assert evb["evicted"] is False and evb["policy"] == "dropkv" and "blocks_freed" not in evb


def test_chat_streaming_usage_and_done(client):
    c, _, _ = client
    r = c.post("/v1/chat/completions", json={**CHAT, "n": 2, "stream": True, "stream_options": {"include_usage": True},
                                             "eviction": {"policy": "snapkv", "budget": 0.5}})
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/event-stream")
    events = sse_events(r.text)
    assert all(e["object"] == "chat.completion.chunk" for e in events)
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    text = {0: "", 1: ""}
    finish = {}
    for e in events[:-1]:
        for ch in e["choices"]:
            text[ch["index"]] += ch["delta"].get("content") or ""
            if ch["finish_reason"]:
                finish[ch["index"]] = ch["finish_reason"]
    assert finish == {0: "length", 1: "length"} and text[0] == text[1] != ""
    last = events[-1]
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == 8
    assert last["usage"]["eviction"]["policy"] == "snapkv"


def test_n_fans_out_one_engine_request_per_sequence(client):
    c, engine, _ = client
    start = len(engine.seen)
    r = c.post("/v1/chat/completions", json={**CHAT, "n": 3, "seed": 7, "eviction": {"policy": "snapkv", "budget": 0.5}})
    assert r.status_code == 200, r.text
    seen = engine.seen[start:]
    assert [sp.n for _, sp, _ in seen] == [1, 1, 1] and [sp.seed for _, sp, _ in seen] == [7, 8, 9]
    assert len({rid for _, _, rid in seen}) == 3
    evb = r.json()["usage"]["eviction"]
    assert evb["evicted_sequences"] == 3 and evb["num_sequences"] == 3 and evb["blocks_freed"] == 6
    assert len(evb["sequences"]) == 3 and evb["compression_ratio"] == pytest.approx(0.5)


def test_completions_batch_and_token_prompt(client):
    c, engine, _ = client
    r = c.post("/v1/completions", json={"model": "alias", "prompt": ["one two", "three"], "max_tokens": 3, "n": 2,
                                        "echo": True})
    assert r.status_code == 200, r.text
    body = r.json()
    assert [ch["index"] for ch in body["choices"]] == [0, 1, 2, 3]
    assert body["choices"][0]["text"].startswith("one two") and body["choices"][2]["text"].startswith("three")
    assert body["usage"]["completion_tokens"] == 12
    r = c.post("/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 2, "stream": True})
    events = sse_events(r.text)
    assert "".join(ch["text"] for e in events for ch in e["choices"]) != ""
    assert engine.seen[-1][0] == [5, 6, 7]


def test_models_health_metrics(client):
    c, _, metrics = client
    assert c.get("/health").status_code == 200
    models = c.get("/v1/models").json()
    assert [m["id"] for m in models["data"]] == ["fake", "alias"]
    c.post("/v1/chat/completions", json={**CHAT, "eviction": {"policy": "snapkv", "budget": 0.5}})
    families = {f.name: f for f in text_string_to_metric_families(c.get("/metrics").text)}
    for name in METRIC_NAMES:
        assert name in families, name
    ev = {s.labels["policy"]: s.value for s in families["vllm_evict:evictions"].samples
          if s.name.endswith("_total")}
    assert ev.get("snapkv", 0) >= 1
    freed = [s.value for s in families["vllm_evict:eviction_blocks_freed"].samples if s.name.endswith("_total")]
    assert sum(freed) >= 2
    lat = [s for s in families["vllm_evict:eviction_latency_seconds"].samples if s.name.endswith("_sum")]
    assert lat and lat[0].value == pytest.approx(0.0035)


# ------------------------------------------------------------------------------------------- errors
@pytest.mark.parametrize("eviction", [
    {"policy": "nope", "budget": 0.1},
    {"policy": "snapkv", "budget": 0},
    {"policy": "snapkv", "budget": -3},
    {"policy": "snapkv", "budget": 1.5},
    {"policy": "snapkv", "budget": "lots"},
    {"policy": "snapkv", "budget": 0.1, "allocation": "greedy"},
    {"policy": "snapkv", "budget": 0.1, "window": "x"},
    {"policy": "snapkv", "budget": 0.1, "frobnicate": 1},
    {"budget": 0.1},
    {"policy": ["snapkv"], "budget": 0.1},
    "snapkv",
])
def test_invalid_eviction_is_400(client, eviction):
    c, _, _ = client
    r = c.post("/v1/chat/completions", json={**CHAT, "eviction": eviction})
    err = assert_openai_error(r, 400, param="eviction")
    assert err["type"] == "invalid_request_error"
    r = c.post("/v1/completions", json={"prompt": "x", "eviction": eviction})
    assert_openai_error(r, 400, param="eviction")


def test_malformed_bodies_are_400(client):
    c, _, _ = client
    assert_openai_error(c.post("/v1/chat/completions", content=b"{not json",
                               headers={"content-type": "application/json"}), 400)
    assert_openai_error(c.post("/v1/chat/completions", json={"model": "fake"}), 400, param="messages")
    assert_openai_error(c.post("/v1/chat/completions", json={**CHAT, "temperature": "hot"}), 400, param="temperature")
    assert_openai_error(c.post("/v1/chat/completions", json={**CHAT, "n": 0}), 400, param="n")
    assert_openai_error(c.post("/v1/chat/completions", json={**CHAT, "messages": [{"role": "robot"}]}), 400)
    assert_openai_error(c.post("/v1/completions", json={"prompt": 3}), 400)
    assert_openai_error(c.post("/v1/completions", json={"prompt": [99999]}), 400, param="prompt")
    assert_openai_error(c.post("/v1/chat/completions", json={**CHAT, "logprobs": True}), 400, param="logprobs")
    assert_openai_error(c.get("/v1/nothing-here"), 404)


def test_too_long_prompts_are_400(client):
    c, engine, _ = client
    n_before = len(engine.seen)
    long = "the key value of the city river " * 60
    err = assert_openai_error(c.post("/v1/completions", json={"prompt": long}), 400, param="prompt")
    assert err["code"] == "context_length_exceeded"
    err = assert_openai_error(c.post("/v1/chat/completions", json={**CHAT, "max_tokens": MAX_MODEL_LEN}), 400,
                              param="max_tokens")
    assert err["code"] == "context_length_exceeded"
    assert len(engine.seen) == n_before  # rejected before reaching the engine


def test_unknown_model_404(client):
    c, _, _ = client
    err = assert_openai_error(c.post("/v1/chat/completions", json={**CHAT, "model": "gpt-9"}), 404, param="model")
    assert err["code"] == "model_not_found"


def test_api_key(tokenizer):
    c, _, _ = make_client(tokenizer, api_key="sekret")
    with c:
        assert_openai_error(c.post("/v1/chat/completions", json=CHAT), 401)
        assert_openai_error(c.post("/v1/chat/completions", json=CHAT, headers={"Authorization": "Bearer nope"}), 401)
        assert c.get("/v1/models", headers={"Authorization": "Bearer sekret"}).status_code == 200
        assert c.post("/v1/chat/completions", json=CHAT,
                      headers={"Authorization": "Bearer sekret"}).status_code == 200
        assert c.get("/health").status_code == 200  # health and metrics stay open
        assert c.get("/metrics").status_code == 200


def test_server_default_eviction(tokenizer):
    c, engine, _ = make_client(tokenizer, eviction_defaults={"policy": "dropkv", "budget": 0.25})
    with c:
        assert c.post("/v1/chat/completions", json=CHAT).status_code == 200
        assert engine.seen[-1][1].extra_args["vllm_evict"]["policy"] == "dropkv"
        assert c.post("/v1/chat/completions", json={**CHAT, "eviction": {"budget": 16}}).status_code == 200
        args = engine.seen[-1][1].extra_args["vllm_evict"]
        assert args["policy"] == "dropkv" and args["budget"] == 16
        assert c.post("/v1/chat/completions", json={**CHAT, "eviction": {"policy": "none"}}).status_code == 200
        assert engine.seen[-1][1].extra_args is None


def test_openai_client_extra_body(tokenizer):
    openai = pytest.importorskip("openai")
    c, engine, _ = make_client(tokenizer, report=FAKE_REPORT)
    with c:
        oc = openai.OpenAI(base_url="http://testserver/v1", api_key="x", http_client=c, max_retries=0)
        resp = oc.chat.completions.create(model="fake", messages=CHAT["messages"], max_tokens=3,
                                          extra_body={"eviction": {"policy": "snapkv", "budget": 0.5}})
        assert resp.choices[0].message.content
        assert resp.usage.model_extra["eviction"]["evicted"] is True
        with pytest.raises(openai.BadRequestError) as exc:
            oc.chat.completions.create(model="fake", messages=CHAT["messages"],
                                       extra_body={"eviction": {"policy": "snapkv", "budget": 2.0}})
        assert exc.value.body["param"] == "eviction"
        with pytest.raises(openai.NotFoundError):
            oc.completions.create(model="nope", prompt="hi")


# ------------------------------------------------------------------------------------------- metrics units
def test_stat_logger_feeds_gauges():
    from vllm.v1.metrics.stats import FinishedRequestStats, IterationStats, SchedulerStats

    metrics = ServerMetrics()
    cfg = SimpleNamespace(cache_config=SimpleNamespace(num_gpu_blocks=101, block_size=16),
                          model_config=SimpleNamespace(max_model_len=2048))
    logger = make_stat_logger_factory(metrics)(cfg, 0)
    logger.log_engine_initialized()
    assert metrics.kv_blocks._value.get() == 100
    assert metrics.batch_capacity._value.get() == pytest.approx(100 / 128)
    it = IterationStats()
    it.num_generation_tokens = 7
    it.time_to_first_tokens_iter = [0.05]
    it.finished_requests = [FinishedRequestStats(finish_reason=None, num_generation_tokens=5,
                                                 mean_time_per_output_token=0.02)]
    logger.record(SchedulerStats(num_running_reqs=4, num_waiting_reqs=1, kv_cache_usage=0.2), it)
    assert metrics.kv_used_blocks._value.get() == 20 and metrics.kv_free_blocks._value.get() == 80
    assert metrics.avg_seq_blocks._value.get() == 5 and metrics.batch_capacity._value.get() == 20
    assert metrics.running._value.get() == 4 and metrics.waiting._value.get() == 1
    assert metrics.generation_tokens._value.get() == 7
    assert metrics.decode_tps._value.get() == 0  # set_function gauges are read at collect time
    fams = {f.name: f for f in text_string_to_metric_families(
        __import__("prometheus_client").generate_latest(metrics.registry).decode())}
    assert fams["vllm_evict:decode_throughput_tokens_per_second"].samples[0].value > 0
    logger.record(SchedulerStats(num_running_reqs=0, kv_cache_usage=0.0), None)
    assert metrics.batch_capacity._value.get() == 20  # idle: keeps the last average length


def test_sliding_window_rate():
    now = [100.0]
    r = SlidingWindowRate(10.0, clock=lambda: now[0])
    now[0] = 120.0
    r.add(50)
    now[0] = 125.0
    r.add(50)
    assert r.rate() == pytest.approx(10.0)
    now[0] = 131.0
    assert r.rate() == pytest.approx(5.0)
    now[0] = 200.0
    assert r.rate() == 0.0


# ------------------------------------------------------------------------------------------- disconnects
@pytest.fixture
def live_fake_server(tokenizer):
    """The app with a slow fake engine behind a real uvicorn (in a thread) on a free port."""
    import socket
    import threading
    import time

    import uvicorn

    engine = FakeEngine(tokenizer, step_s=0.02)
    metrics = ServerMetrics()
    app = create_app(engine, served_model_names=["fake"], metrics=metrics, log_stats_interval_s=None)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.time() + 20
    while not server.started:
        assert time.time() < deadline and thread.is_alive()
        time.sleep(0.05)
    yield f"http://127.0.0.1:{port}", engine, metrics
    server.should_exit = True
    thread.join(10)


def _wait_until(cond, timeout=5.0):
    import time

    deadline = time.time() + timeout
    while time.time() < deadline:
        if cond():
            return True
        time.sleep(0.02)
    return cond()


@pytest.mark.parametrize("endpoint,body", [
    ("/v1/chat/completions", {**CHAT, "max_tokens": 100}),
    ("/v1/completions", {"prompt": ["a b", "c d"], "max_tokens": 100}),
])
def test_disconnect_mid_stream_aborts(live_fake_server, endpoint, body):
    import httpx

    base, engine, metrics = live_fake_server
    with httpx.Client(base_url=base, timeout=10) as hc:
        with hc.stream("POST", endpoint, json={**body, "stream": True}) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            got = [next(lines) for _ in range(6)]
            assert any(line.startswith("data: ") for line in got)
            assert engine.active
        # stream closed after a few chunks: every engine request must end (aborted), well before 100 steps
        assert _wait_until(lambda: not engine.active, 1.5), engine.active
        assert engine.aborted
        assert hc.get("/health").status_code == 200
    assert metrics.aborted._value.get() >= 1


def test_disconnect_non_streaming_aborts(live_fake_server):
    import httpx

    base, engine, metrics = live_fake_server
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(base + "/v1/chat/completions", json={**CHAT, "max_tokens": 100}, timeout=0.3)
    assert _wait_until(lambda: not engine.active, 1.5), engine.active
    assert engine.aborted and metrics.aborted._value.get() >= 1
