"""Where one layer's scoring + compaction time goes on GPU (issue 14). Not a unit test.

Runs the engine's own per-layer compaction code (`EvictionAttentionMixin._compact`'s steps: gather the
prompt KV from the HND cache, score, select, flat-slot destinations, write) on a Llama-3.1-8B-shaped
layer (8 KV heads, 32 query heads, d=128, bf16, page 16) for prompt lengths in order, and prints device
time per stage (CUDA events, median of repeats) plus the first call at each length (compiles included)
and the host time of one whole layer.

  python benchmarks/compaction_profile.py --lengths 8192 16384 32768 --policies dropkv snapkv keydiff
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch


def stages(policy: str, n: int, precision: str | None):
    from kernels.window_scores import WindowScoreConfig, window_scores
    from vllm_evict.engine.compaction import compaction_slots, plan_compaction
    from vllm_evict.engine.cuda_backend import CudaPagedCache
    from vllm_evict.policies import EvictionConfig, register_raw_kernel

    # What the plugin registers on CUDA (engine/plugin.py), optionally with another precision.
    kernel_config = WindowScoreConfig(precision=precision or "ieee")
    register_raw_kernel(lambda *a, **k: window_scores(*a, config=kernel_config, **k))
    H, G, D, N = 8, 4, 128, 16
    dev, dt = "cuda", torch.bfloat16
    num_prompt_blocks = n // N
    config = EvictionConfig.from_dict({"policy": policy, "budget": 0.1})
    pages = config.num_pages(n, N)
    kv = torch.randn(num_prompt_blocks + pages + 8, H, N, 2 * D, device=dev, dtype=dt)
    one = torch.ones((), device=dev)
    cache = CudaPagedCache(kv, D, "auto", one, one)
    blocks = torch.randperm(num_prompt_blocks, device=dev).to(torch.int32)
    fresh = torch.arange(num_prompt_blocks, num_prompt_blocks + pages, device=dev)
    q_window = torch.randn(config.window_size() or 1, H * G, D, device=dev, dtype=dt)
    held = {}

    def gather():
        held["kv"] = cache.gather_prefix(blocks, n)

    def score():
        keys, values = held["kv"]
        held["plan"] = plan_compaction(config, q_window, keys, values, D ** -0.5, N, pages)

    def slots():
        keep, counts = held["plan"]
        held["slots"] = compaction_slots(keep, counts, fresh, N)[1]

    def write():
        keys, values = held["kv"]
        cache.write_pages(keys.reshape(n * H, D), values.reshape(n * H, D), held["slots"].reshape(-1))

    return [("gather", gather), ("score+select", score), ("slots", slots), ("write", write)]


def timed(fn) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end)


def profile(policy: str, n: int, precision: str | None, repeats: int) -> dict:
    parts = stages(policy, n, precision)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    first = {name: round(timed(fn), 3) for name, fn in parts}        # compiles included
    first_wall = time.perf_counter() - t0
    warm = {name: [] for name, _ in parts}
    host = []
    for _ in range(repeats):
        for name, fn in parts:
            warm[name].append(timed(fn))
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _, fn in parts:   # host time to enqueue one layer (device work still running)
            fn()
        host.append((time.perf_counter() - t0) * 1e3)
        torch.cuda.synchronize()
    row = {"policy": policy, "n": n, "precision": precision or "default",
           "first_call_ms": first, "first_call_wall_ms": round(1e3 * first_wall, 1),
           "warm_ms": {k: round(statistics.median(v), 3) for k, v in warm.items()},
           "host_enqueue_ms": round(statistics.median(host), 3)}
    row["warm_total_ms"] = round(sum(row["warm_ms"].values()), 3)
    from torch.profiler import ProfilerActivity, profile as torch_profile

    with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _, fn in parts:
            fn()
        torch.cuda.synchronize()
    kernels = sorted(prof.key_averages(), key=lambda e: -e.device_time_total)[:8]
    row["top_kernels_us"] = {e.key[:60]: round(e.device_time_total, 1) for e in kernels}
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", nargs="+", type=int, default=[8192, 16384, 32768])
    ap.add_argument("--policies", nargs="+", default=["dropkv", "snapkv", "keydiff"])
    ap.add_argument("--precisions", nargs="+", default=["default"])
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    rows = []
    for precision in args.precisions:
        for policy in args.policies:
            for n in args.lengths:
                row = profile(policy, n, None if precision == "default" else precision, args.repeats)
                rows.append(row)
                print(json.dumps(row), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
