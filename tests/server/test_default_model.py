"""`vllm-evict serve` with no arguments: SmolLM2-135M-Instruct, prepared from the installed
wheel, under its own name, answering a chat question from a passage in the prompt with and without
eviction; and vLLM's own load tool (`vllm-evict bench serve` = `vllm bench serve`) against it with an
eviction object in every request."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.server.process import free_port, launch, stop_server

pytestmark = [pytest.mark.engine, pytest.mark.slow]
httpx = pytest.importorskip("httpx")

# The README's first request (keep the two in step).
PASSAGE = (
    "Harbor Street Bakery opened in 1987 in the small fishing town of Port Elwyn. Its founder, Maria Okafor, "
    "learned to bake from her grandmother and still starts every morning at four o'clock. The bakery is famous "
    "for its rye bread, which is baked in a wood-fired oven that Maria built herself from old harbour bricks. "
    "On weekdays the shop sells about 300 loaves, and on Saturdays, when the market fills the square, it sells "
    "nearly twice as many. Maria's son, Daniel, runs the cafe next door, where fishermen drink coffee before "
    "their boats leave at dawn. In winter the bakery closes on Mondays, and every December it bakes a giant "
    "ginger cake for the town's lantern festival. Visitors often ask for the recipe of the rye bread, but "
    "Maria only says that the secret is patience and a long, slow rise.")
QUESTION, ANSWER = "Who founded Harbor Street Bakery?", "Maria"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from vllm_evict.models import MODEL_NAME

    port = free_port()
    cmd = [sys.executable, "-m", "vllm_evict.cli", "serve", "--host", "127.0.0.1", "--port", str(port)]
    # inductor, as a user's server compiles (conftest.py turns it off for the other engines)
    server = launch(cmd, port, tmp_path_factory.mktemp("default-model"), env={"VLLM_CPU_CI_ENV": "0"})
    try:
        assert [m["id"] for m in httpx.get(server.url + "/v1/models").json()["data"]] == [MODEL_NAME]
        yield server
    finally:
        stop_server(server)


def counter(server, family: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(server.url + "/metrics").text
    return sum(s.value for fam in text_string_to_metric_families(text) if fam.name == family
               for s in fam.samples if s.name == family + "_total")


@pytest.mark.parametrize("eviction", [None, {"policy": "snapkv", "budget": 0.5}, {"policy": "dropkv", "budget": 0.5}])
def test_chat_answers_from_the_passage_with_and_without_eviction(server, eviction):
    from vllm_evict.models import MODEL_NAME

    body = {"model": MODEL_NAME, "temperature": 0, "max_tokens": 32,
            "messages": [{"role": "user", "content": f"{PASSAGE}\n\n{QUESTION}"}]}
    if eviction:
        body["eviction"] = eviction
    r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=300)
    assert r.status_code == 200, f"{r.text}\n{server.log_tail(30)}"
    answer = r.json()["choices"][0]["message"]["content"]
    assert ANSWER in answer, answer
    report = r.json()["usage"].get("eviction")
    if eviction:
        assert report["evicted"] and report["blocks_freed"] > 0, report
    else:
        assert report["evicted"] is False, report


def test_vllm_bench_serve_sends_an_eviction_object_with_every_request(server, tmp_path):
    before = counter(server, "vllm_evict:evictions")
    cmd = [sys.executable, "-m", "vllm_evict.cli", "bench", "serve", "--host", "127.0.0.1",
           "--port", str(server.port), "--dataset-name", "random", "--random-input-len", "256",
           "--random-output-len", "4", "--num-prompts", "4", "--ignore-eos", "--seed", "0",
           "--ready-check-timeout-sec", "0",  # no extra probe request: exactly 4 requests
           "--extra-body", json.dumps({"eviction": {"policy": "snapkv", "budget": 0.25}}),
           "--save-result", "--result-dir", str(tmp_path), "--result-filename", "bench.json"]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=900, check=False)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    result = json.loads((tmp_path / "bench.json").read_text())
    assert result["completed"] == 4 and result["failed"] == 0, result
    assert counter(server, "vllm_evict:evictions") - before == 4
