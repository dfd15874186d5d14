"""Faults of a real `vllm-evict serve`, each on a server of its own (tiny model, CPU):

* SIGTERM with evicting requests in flight, under `--shutdown-timeout` (vLLM's graceful drain): every
  in-flight stream finishes, the process exits in bounded time, and a restarted server serves again;
* the engine-core process killed: the API does not hang: /health fails (503 or the server gone) and a
  request gets an error, within a bounded time."""

from __future__ import annotations

import json
import os
import signal
import threading
import time


from tests.server.process import stop_server

EVICTION = {"policy": "snapkv", "budget": 0.25}
PROMPT = "The quick brown fox jumps over the lazy dog. " * 20


def stream_completion(server, results: list, index: int, max_tokens: int = 48, ended: list | None = None,
                      started: threading.Event | None = None) -> None:
    """One streaming completion; appends (index, tokens generated, finish reason or the error seen), and
    its end time to `ended`; sets `started` at its first token (or at its end, whatever it was).

    Tokens come from the final chunk's usage (0 without one): vLLM merges a request's deltas into one chunk
    when the API process falls behind the engine (a starved machine), so chunks are not tokens."""
    import httpx

    tokens, finish = 0, None
    try:
        with httpx.stream("POST", server.url + "/v1/completions", timeout=120, json={
                "model": model_id(server), "prompt": PROMPT, "max_tokens": max_tokens, "stream": True,
                "stream_options": {"include_usage": True}, "ignore_eos": True,
                "eviction": EVICTION}) as response:
            for line in response.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    if started is not None:
                        started.set()
                    chunk = json.loads(line[6:])
                    for choice in chunk["choices"]:
                        finish = choice.get("finish_reason") or finish
                    if chunk.get("usage"):
                        tokens = chunk["usage"]["completion_tokens"]
    except httpx.HTTPError as exc:
        finish = f"error: {type(exc).__name__}"
    results.append((index, tokens, finish))
    if ended is not None:
        ended.append(time.time())
    if started is not None:
        started.set()


_MODEL_IDS: dict[str, str] = {}


def model_id(server) -> str:
    import httpx

    if server.url not in _MODEL_IDS:
        _MODEL_IDS[server.url] = httpx.get(server.url + "/v1/models", timeout=30).json()["data"][0]["id"]
    return _MODEL_IDS[server.url]


def test_sigterm_drains_in_flight_requests_and_a_restart_serves(server_factory):
    server = server_factory(extra_args=["--shutdown-timeout", "60"])
    model_id(server)
    results: list = []
    ended: list = []
    started = [threading.Event() for _ in range(4)]
    # long enough that the first streams are still running when the last one's first token comes on a starved
    # machine (the API process may take seconds to hand a request to the engine; one that has not reached it
    # is not in flight for vLLM's drain)
    tokens = 2000
    threads = [threading.Thread(target=stream_completion, args=(server, results, i, tokens, ended, started[i]))
               for i in range(4)]
    for thread in threads:
        thread.start()
    for event in started:  # every stream has its first token
        event.wait(120)
    start = time.time()
    os.kill(server.proc.pid, signal.SIGTERM)
    for thread in threads:
        thread.join(120)
    server.proc.wait(90)
    exit_s = time.time() - start
    assert sorted(r[2] for r in results) == ["length"] * 4, (results, server.log_tail(40))
    assert sorted(r[1] for r in results) == [tokens] * 4, results
    running = sum(end > start for end in ended)
    assert running >= 2, "the streams ended before the SIGTERM: nothing was in flight"
    assert exit_s < 90, exit_s
    print(f"SIGTERM: 4 streams of {tokens} tokens, {running} still running at the signal, "
          f"all finished; exit after {exit_s:.1f} s")
    stop_server(server)  # the process group's leftovers, if any

    again = server_factory()
    results = []
    stream_completion(again, results, 0, max_tokens=4)
    assert results == [(0, 4, "length")], results


def engine_core_pids(server) -> list[int]:
    import psutil

    return [p.pid for p in psutil.Process(server.proc.pid).children(recursive=True)
            if "EngineCore" in " ".join(p.cmdline() + [p.name()])]


def test_engine_core_death_fails_fast_instead_of_hanging(server_factory):
    import httpx

    server = server_factory()
    model_id(server)
    pids = engine_core_pids(server)
    assert pids, "no engine-core process found"
    for pid in pids:
        os.kill(pid, signal.SIGKILL)
    deadline = time.time() + 60
    health = None
    while time.time() < deadline:
        try:
            health = httpx.get(server.url + "/health", timeout=10).status_code
        except httpx.HTTPError as exc:
            health = type(exc).__name__  # the API server went down with its engine
        if health != 200:
            break
        time.sleep(1.0)
    assert health != 200, "health still answers 200 a minute after the engine died"
    start = time.time()
    try:
        response = httpx.post(server.url + "/v1/completions", timeout=60, json={
            "model": model_id(server), "prompt": "hello", "max_tokens": 4, "eviction": EVICTION})
        assert response.status_code >= 500, response.text
    except httpx.TransportError:
        pass  # refused: the server is gone, which a client sees at once
    assert time.time() - start < 60
    print(f"engine death: health {health}; a request failed after {time.time() - start:.1f} s")
