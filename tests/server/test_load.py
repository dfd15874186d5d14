"""A short bounded load on a real `vllm-evict serve` (the generator is benchmarks/load.py): 16
streaming clients for 45 s, mixed eviction settings, 20% of the requests closed mid-stream. Nothing may be
lost, no 5xx, no KV block held after the drain, and the server's resident memory may grow by at most 25%
from the first warm sample to the end."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

LOAD = Path(__file__).resolve().parents[2] / "benchmarks" / "load.py"
RSS_GROWTH_BOUND = 1.25


def load_module():
    spec = importlib.util.spec_from_file_location("bench_load", LOAD)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow  # 45 s of load on a real server; CI runs it with -m slow
def test_short_load_loses_nothing_and_leaks_nothing(server_factory, tmp_path):
    server = server_factory()
    result = load_module().main(["--url", server.url, "--clients", "16", "--seconds", "45", "--prompt-len", "200",
                                 "--max-tokens", "24", "--pid", str(server.proc.pid), "--out",
                                 str(tmp_path / "load.json")])
    summary = {k: v for k, v in result.items() if k != "samples"}
    assert result["lost"] == 0 and result["failed"] == 0 and result["server_errors"] == 0, summary
    assert result["done"] > 0 and result["disconnected"] > 0, summary
    # 20% of the requests close after a random number of tokens below max_tokens: all of them get there
    assert 0.12 <= result["disconnected"] / result["requests"] <= 0.28, summary
    assert result["plain_after_drain"] == 200 and result["kv_usage_after_drain"] == 0.0, summary
    assert result["rss_mb_end"] <= RSS_GROWTH_BOUND * result["rss_mb_first_warm"], summary


def test_stream_lines_end_at_newline_only():
    """Random tokens put U+2028 and U+0085 raw inside the JSON of a chunk; httpx's aiter_lines splits there
    (the first GPU soak died on it). The generator splits at b"\\n" only, also across network reads."""
    import asyncio
    import json

    events = [{"choices": [{"text": "a\u2028b\x85c\rd", "finish_reason": None}]},
              {"choices": [{"text": "e", "finish_reason": "length"}]}]
    body = b"".join(b"data: " + json.dumps(e, ensure_ascii=False).encode() + b"\n\n" for e in events)
    body += b"data: [DONE]\n\n"

    class Response:
        async def aiter_bytes(self):
            for i in range(0, len(body), 7):  # reads that end mid-line
                yield body[i:i + 7]

    async def collect():
        return [json.loads(data) async for data in load_module().sse_data(Response())]

    assert asyncio.run(collect()) == events
