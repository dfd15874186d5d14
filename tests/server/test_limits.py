"""Request limits of `vllm-evict serve`, on a real server with `--max-model-len 512 --max-n 2` and a
KV cache of 40 blocks (640 tokens): what a client gets over each (docs/OPERATIONS.md, "Request limits")."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def server(server_factory):
    return server_factory(extra_args=["--max-model-len", "512", "--max-n", "2", "--num-gpu-blocks-override", "40"])


def post(server, **body):
    import httpx

    model = httpx.get(server.url + "/v1/models", timeout=30).json()["data"][0]["id"]
    return httpx.post(server.url + "/v1/completions", json={"model": model, **body}, timeout=120)


def error_message(response) -> str:
    assert response.status_code == 400, (response.status_code, response.text)
    return response.json()["error"]["message"]


def test_a_prompt_over_max_model_len_is_a_400(server):
    message = error_message(post(server, prompt=[5] * 600, max_tokens=4))
    assert "512" in message


@pytest.mark.parametrize("stream", [False, True])
def test_a_request_that_can_never_fit_the_kv_cache_is_a_400(server, stream):
    """One-shot eviction holds the prompt's 32 blocks and P fresh ones at the eviction point: at half budget
    that is more than the 39 usable blocks, so the request could only wait forever: a 400 before any stream
    starts. The same prompt runs without eviction, and at a 10% budget."""
    prompt = [5 + i % 50 for i in range(500)]
    message = error_message(post(server, prompt=prompt, max_tokens=4, stream=stream,
                                 eviction={"policy": "snapkv", "budget": 0.5}))
    assert "can never fit the KV cache" in message and "the cache has 39" in message, message
    assert post(server, prompt=prompt, max_tokens=4).status_code == 200
    assert post(server, prompt=prompt, max_tokens=4, eviction={"policy": "snapkv", "budget": 0.1}).status_code == 200


def test_n_over_max_n_is_a_400(server):
    assert "n must be at most 2" in error_message(post(server, prompt="hello", max_tokens=2, n=3, temperature=1.0))
    assert post(server, prompt="hello", max_tokens=2, n=2, temperature=1.0).status_code == 200


@pytest.mark.parametrize("eviction", [{"policy": "snapkv", "budget": 0.25, "window": 100000},
                                      {"policy": "snapkv", "budget": 0.25, "evict_at": 100000}])
def test_window_and_evict_at_beyond_the_prompt_are_bounded_by_it(server, eviction):
    """A window covering the whole prefix protects all of it (nothing to evict: the request runs plain);
    an eviction point past the prompt is the end of the prompt (the whole prompt is compressed)."""
    response = post(server, prompt=[5 + i % 50 for i in range(300)], max_tokens=4, eviction=eviction)
    assert response.status_code == 200, response.text
    report = response.json()["usage"]["eviction"]
    if "window" in eviction:
        assert report["evicted"] is False, report
    else:
        assert report["evicted"] is True and report["evicted_prefix_tokens"] == 300, report
