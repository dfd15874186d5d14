"""`vllm-evict serve --data-parallel-size 2` on CPU (two engines behind one API server, vLLM's internal
load balancing), each engine with a KV cache of 40 blocks: evicting requests run on both engines (and the
`vllm_evict:*` metrics say which, per engine), and a request that no engine could ever hold is a 400 at
arrival, streaming or not, as on one engine (the API process keeps each engine's cache size, not only
their sum)."""

from __future__ import annotations

import re
from concurrent.futures import ThreadPoolExecutor

import pytest

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server(server_factory):
    return server_factory(extra_args=["--max-model-len", "512", "--data-parallel-size", "2",
                                      "--num-gpu-blocks-override", "40"])


def post(server, **body):
    import httpx

    model = httpx.get(server.url + "/v1/models", timeout=30).json()["data"][0]["id"]
    return httpx.post(server.url + "/v1/completions", json={"model": model, **body}, timeout=300)


@pytest.mark.parametrize("stream", [False, True])
def test_a_request_no_engine_could_hold_is_a_400(server, stream):
    """32 prompt blocks and P = 16 fresh ones at the eviction point: more than one engine's 39 usable
    blocks, though less than the two engines' 78 together."""
    prompt = [5 + i % 50 for i in range(500)]
    response = post(server, prompt=prompt, max_tokens=4, stream=stream, eviction={"policy": "snapkv", "budget": 0.5})
    assert response.status_code == 400, (response.status_code, response.text)
    message = response.json()["error"]["message"]
    assert "can never fit the KV cache" in message and "the cache has 39" in message, message


def test_evicting_requests_run_on_both_engines(server):
    import httpx

    def evicting(i):
        return post(server, prompt=[5 + (i + j) % 50 for j in range(300)], max_tokens=8, ignore_eos=True,
                    eviction={"policy": "snapkv", "budget": 0.2})

    with ThreadPoolExecutor(8) as pool:
        responses = list(pool.map(evicting, range(8)))
    for response in responses:
        assert response.status_code == 200, response.text
        report = response.json()["usage"]["eviction"]
        assert report["evicted"] and report["blocks_freed"] > 0, report
    metrics = httpx.get(server.url + "/metrics", timeout=30).text
    served: dict[str, float] = {}  # finished requests per engine, over vLLM's finish-reason series
    for engine, count in re.findall(r'^vllm:request_success_total\{[^}]*engine="(\d+)"[^}]*\} (\S+)', metrics, re.M):
        served[engine] = served.get(engine, 0.0) + float(count)
    assert set(served) == {"0", "1"} and all(count > 0 for count in served.values()), served
    # the vllm_evict:* series carry vLLM's engine label: each engine's evictions and its own cache
    evicted = {engine: float(count) for engine, count in re.findall(
        r'^vllm_evict:evictions_total\{engine="(\d+)",policy="snapkv"\} (\S+)', metrics, re.M)}
    assert set(evicted) == {"0", "1"} and min(evicted.values()) > 0 and sum(evicted.values()) == 8, evicted
    blocks = re.findall(r'^vllm_evict:kv_cache_blocks\{engine="(\d+)"\} (\S+)', metrics, re.M)
    assert sorted(blocks) == [("0", "39.0"), ("1", "39.0")], blocks
