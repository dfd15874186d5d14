"""vLLM's own multi-node launch (`--nnodes 2`, the multiprocessing executor across nodes, no Ray) with the
plugin: a headless `vllm-evict serve --node-rank 1 --headless` holds tensor-parallel rank 1, the leader
(`--node-rank 0`) rank 0 and the API server; here both "nodes" are processes of this machine, talking over
TCP as two hosts would. Evicting requests (uniform and Ada-KV, one-shot, block-wise and decode budgets)
return the tokens of the torch reference's replay, as on one node."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from tests.server.process import SERVER_ENGINE_FLAGS, free_port, launch, stop_server

pytestmark = pytest.mark.slow

MAX_TOKENS = 48


@pytest.fixture(scope="module")
def leader(tiny_llama, tmp_path_factory):
    master_port, port = free_port(), free_port()
    common = [sys.executable, "-m", "vllm_evict.cli", "serve", str(tiny_llama), *SERVER_ENGINE_FLAGS,
              "--tensor-parallel-size", "2", "--nnodes", "2", "--master-addr", "127.0.0.1",
              "--master-port", str(master_port), "--distributed-executor-backend", "mp"]
    worker_log = tmp_path_factory.mktemp("worker") / "worker.log"
    with open(worker_log, "wb") as log:  # one CPU core per node's worker
        worker = subprocess.Popen(common + ["--node-rank", "1", "--headless"], stdout=log, stderr=subprocess.STDOUT,
                                  env={**os.environ, "VLLM_CPU_OMP_THREADS_BIND": "1"}, start_new_session=True)
    server = None
    try:
        server = launch(common + ["--node-rank", "0", "--host", "127.0.0.1", "--port", str(port)], port,
                        tmp_path_factory.mktemp("leader"), env={"VLLM_CPU_OMP_THREADS_BIND": "0"})
        yield server
    finally:
        if server is not None:
            stop_server(server)
        try:
            os.killpg(worker.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


@pytest.mark.parametrize("case", [
    {"policy": "snapkv", "budget": 0.25},
    {"policy": "dropkv", "budget": 0.3, "allocation": "adakv"},
    {"policy": "snapkv", "decode_budget": 48, "decode_every": 16, "allocation": "adakv"},
    {"policy": "keydiff", "budget": 96, "chunked": True, "chunk_size": 64, "decode_budget": 64, "decode_every": 16},
])
def test_evicting_requests_follow_the_reference_across_two_nodes(leader, reference, case):
    import httpx

    from tests.engine.test_eviction import random_prompt
    from vllm_evict.engine.request_config import parse_request

    prompt = random_prompt(21, 300)
    model = httpx.get(leader.url + "/v1/models", timeout=30).json()["data"][0]["id"]
    response = httpx.post(leader.url + "/v1/completions", timeout=300, json={
        "model": model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True,
        "return_token_ids": True, "eviction": case})
    assert response.status_code == 200, response.text
    body = response.json()
    report = body["usage"]["eviction"]
    assert report["evicted"], report
    if "decode_budget" in case:
        assert report["decode_compactions"] >= 1, report
    expected = reference.replay(prompt, MAX_TOKENS, parse_request({"vllm_evict": case}), page_size=16)
    assert body["choices"][0]["token_ids"] == expected.token_ids, case
