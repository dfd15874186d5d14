"""Bounded load against an OpenAI server on loopback: N concurrent streaming clients, a mix of
eviction settings, a share of them disconnecting mid-stream. Not a unit test; tests/server/test_load.py
runs a short one in CI.

Each client loops until the deadline: one streaming completion at a time, its eviction drawn from --mix.
A request ends as `done` (a finish reason arrived), `disconnected` (this client closed the stream on
purpose), `failed` (an HTTP error status or a transport error) or `lost` (the stream ended with no finish
reason, or timed out). A disconnecting request closes after a random number of tokens (read from the
continuous usage of each event); TTFT is to the first event and the inter-token latency is measured per
event, which carries several tokens when the server streams to a slow reader. Every second the sampler
reads the server's /metrics (KV-cache usage, running and waiting requests) and, with --pid, the resident
memory of that process tree. After the deadline the run drains: it waits until nothing runs or waits, sends
one plain request, and reads the KV usage once more.

  python benchmarks/load.py --url http://127.0.0.1:8000 --clients 200 --seconds 600 --out load.json
  (vanilla vLLM: --mix none, the same load without the eviction field)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time

MIXES = {
    "mixed": [None, {"policy": "snapkv", "budget": 0.25}, {"policy": "dropkv", "budget": 0.1},
              {"policy": "keydiff", "budget": 0.2}, {"policy": "snapkv", "budget": 0.2, "allocation": "adakv"},
              {"policy": "streaming", "budget": 64}],
    "none": [None],
}


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return round(values[min(len(values) - 1, int(q * len(values)))] * 1e3, 2)


class Stats:
    def __init__(self) -> None:
        self.outcomes = {"done": 0, "disconnected": 0, "failed": 0, "lost": 0}
        self.status: dict[int, int] = {}
        self.ttft: list[float] = []
        self.itl: list[float] = []
        self.samples: list[dict] = []


async def one_request(http, args, model: str, eviction, disconnect_after: int | None, stats: Stats,
                      rng: random.Random) -> None:
    import httpx

    # continuous usage: every event says how many tokens the request has, since vLLM merges the tokens of a
    # slow reader into one event (the disconnect point counts tokens, not events)
    body = {"model": model, "prompt": [3 + rng.randrange(500) for _ in range(args.prompt_len)],
            "max_tokens": args.max_tokens, "stream": True, "ignore_eos": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    if eviction is not None:
        body["eviction"] = eviction
    start, last, tokens, finish = time.perf_counter(), None, 0, None
    try:
        async with http.stream("POST", args.url + "/v1/completions", json=body, timeout=args.timeout) as response:
            stats.status[response.status_code] = stats.status.get(response.status_code, 0) + 1
            if response.status_code != 200:
                await response.aread()
                stats.outcomes["failed"] += 1
                return
            async for data in sse_data(response):
                event = json.loads(data)
                if not event.get("choices"):  # the final usage event
                    continue
                now = time.perf_counter()
                if last is None:
                    stats.ttft.append(now - start)
                else:
                    stats.itl.append(now - last)
                last = now
                tokens = event["usage"]["completion_tokens"] if event.get("usage") else tokens + 1
                finish = event["choices"][0].get("finish_reason") or finish
                if disconnect_after is not None and tokens >= disconnect_after:
                    stats.outcomes["disconnected"] += 1  # leaving the block closes the connection
                    return
    except httpx.TimeoutException:
        stats.outcomes["lost"] += 1
        return
    except httpx.HTTPError:
        stats.outcomes["failed"] += 1
        return
    stats.outcomes["done" if finish else "lost"] += 1


async def sse_data(response):
    """The `data:` payloads of a server-sent-event stream, [DONE] excluded. Lines end at b"\n" only:
    httpx's aiter_lines also ends them at U+2028, U+0085 and the other str.splitlines separators, which
    random tokens put raw inside the JSON (the first GPU soak died on such a split chunk)."""
    buf = b""
    async for chunk in response.aiter_bytes():
        *lines, buf = (buf + chunk).split(b"\n")
        for line in lines:
            line = line.rstrip(b"\r")
            if line.startswith(b"data: ") and line != b"data: [DONE]":
                yield line[6:]


async def client(http, args, model: str, deadline: float, stats: Stats, rng: random.Random) -> None:
    while time.time() < deadline:
        disconnect = rng.random() < args.disconnect
        await one_request(http, args, model, rng.choice(MIXES[args.mix]),
                          rng.randint(1, max(1, args.max_tokens - 1)) if disconnect else None, stats, rng)


def metrics(text: str) -> dict[str, float]:
    """KV usage, running and waiting requests from a Prometheus exposition (summed over label sets)."""
    from prometheus_client.parser import text_string_to_metric_families

    wanted = {"vllm:kv_cache_usage_perc": "kv_usage", "vllm:num_requests_running": "running",
              "vllm:num_requests_waiting": "waiting"}
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in wanted:
                out[wanted[sample.name]] = out.get(wanted[sample.name], 0.0) + sample.value
    return out


def rss_bytes(pid: int | None) -> int | None:
    if pid is None:
        return None
    import psutil

    try:
        root = psutil.Process(pid)
        return sum(p.memory_info().rss for p in [root, *root.children(recursive=True)])
    except psutil.Error:
        return None


async def sampler(http, args, start: float, stop: asyncio.Event, stats: Stats) -> None:
    while not stop.is_set():
        sample = {"t": round(time.time() - start, 1), "rss": rss_bytes(args.pid)}
        try:
            sample.update(metrics((await http.get(args.url + "/metrics", timeout=10)).text))
        except Exception:  # noqa: BLE001 - a missed sample is recorded as missing, not fatal
            pass
        stats.samples.append(sample)
        try:
            await asyncio.wait_for(stop.wait(), 1.0)
        except asyncio.TimeoutError:
            pass


async def run(args) -> dict:
    import httpx

    stats = Stats()
    limits = httpx.Limits(max_connections=args.clients + 8, max_keepalive_connections=args.clients + 8)
    async with httpx.AsyncClient(limits=limits) as http:
        model = (await http.get(args.url + "/v1/models", timeout=30)).json()["data"][0]["id"]
        start = time.time()
        stop = asyncio.Event()
        sampling = asyncio.create_task(sampler(http, args, start, stop, stats))
        rngs = [random.Random(args.seed * 100003 + i) for i in range(args.clients)]
        await asyncio.gather(*(client(http, args, model, start + args.seconds, stats, rng) for rng in rngs))
        load_s = time.time() - start
        drain_start = time.time()
        while time.time() - drain_start < args.drain_seconds:  # nothing running or waiting any more
            now = metrics((await http.get(args.url + "/metrics", timeout=10)).text)
            if now.get("running", 1) == 0 and now.get("waiting", 1) == 0:
                break
            await asyncio.sleep(0.5)
        plain = await http.post(args.url + "/v1/completions", timeout=args.timeout,
                                json={"model": model, "prompt": "hello", "max_tokens": 2})
        after = metrics((await http.get(args.url + "/metrics", timeout=10)).text)
        stop.set()
        await sampling
    rss = [s["rss"] for s in stats.samples if s.get("rss")]
    warm = [s["rss"] for s in stats.samples if s.get("rss") and s["t"] >= min(10.0, args.seconds / 3)]
    return {
        "clients": args.clients, "seconds": args.seconds, "load_s": round(load_s, 1), "mix": args.mix,
        "disconnect_share": args.disconnect, "prompt_len": args.prompt_len, "max_tokens": args.max_tokens,
        "requests": sum(stats.outcomes.values()), **stats.outcomes,
        "status_codes": {str(k): v for k, v in sorted(stats.status.items())},
        "server_errors": sum(v for k, v in stats.status.items() if k >= 500),
        "ttft_ms_p50": percentile(stats.ttft, 0.5), "ttft_ms_p99": percentile(stats.ttft, 0.99),
        "itl_ms_p50": percentile(stats.itl, 0.5), "itl_ms_p99": percentile(stats.itl, 0.99),
        "kv_usage_max": max((s.get("kv_usage", 0.0) for s in stats.samples), default=None),
        "kv_usage_after_drain": after.get("kv_usage"), "plain_after_drain": plain.status_code,
        "rss_mb_first_warm": round(warm[0] / 2**20, 1) if warm else None,
        "rss_mb_max": round(max(rss) / 2**20, 1) if rss else None,
        "rss_mb_end": round(rss[-1] / 2**20, 1) if rss else None,
        "samples": stats.samples,
    }


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", required=True)
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--seconds", type=float, default=60)
    ap.add_argument("--mix", choices=sorted(MIXES), default="mixed")
    ap.add_argument("--disconnect", type=float, default=0.2, help="share of requests closed mid-stream")
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--timeout", type=float, default=300)
    ap.add_argument("--drain-seconds", type=float, default=120)
    ap.add_argument("--pid", type=int, default=None, help="server process: sample the RSS of its process tree")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None)
    return ap.parse_args(argv)


def main(argv=None) -> dict:
    args = parse_args(argv)
    result = asyncio.run(run(args))
    summary = {k: v for k, v in result.items() if k != "samples"}
    print(json.dumps(summary), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()
