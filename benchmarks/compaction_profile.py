"""Where a request's scoring + compaction time goes on GPU. Not a unit test.

Runs the engine's own compaction (`compaction.compact_request`: all layers of one request at once,
layers folded into the head axis in groups) on Llama-3.1-8B-shaped layers (32 layers, 8 KV heads,
32 query heads, d=128, bf16, page 16, separate cache tensors per layer as vLLM allocates them) for
prompt lengths in order. Prints the device time of one request (CUDA events, median of repeats), the
first call at each length (compiles included), the host time to enqueue it, and the top kernels.
--decode-points R: instead, R requests compacted together at their third decode point (1K prompts, decode
budget 1024 every 128 tokens: the reasoning shape's points), eagerly; the kernels' summed device time is what
a replayed compaction graph spends on the GPU.

  python benchmarks/compaction_profile.py --lengths 8192 32768 --policies dropkv snapkv keydiff
  python benchmarks/compaction_profile.py --decode-points 15 --policies dropkv --allocations uniform adakv
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

LAYERS, H, G, D, N = 32, 8, 4, 128, 16
DECODE_GROUP_BYTES = 1 << 30  # about what an 8B engine's profiled activations allow (compaction.group_bytes)


def setup(policy: str, n: int, precision: str, allocation: str):
    from vllm_evict.kernels.window_scores import WindowScoreConfig, window_scores
    from vllm_evict.engine.cuda_backend import CudaPagedCache
    from vllm_evict.engine.request_config import RequestEviction
    from vllm_evict.engine.request_state import WorkerEviction
    from vllm_evict.policies import EvictionConfig, register_raw_kernel

    # What the plugin registers on CUDA (engine/plugin.py), with the precision asked for.
    kernel_config = WindowScoreConfig(precision=precision)
    register_raw_kernel(lambda *a, **k: window_scores(*a, config=kernel_config, **k))
    dev, dt = "cuda", torch.bfloat16
    config = EvictionConfig.from_dict({"policy": policy, "budget": 0.1, "allocation": allocation})
    pages = config.num_pages(n, N)
    num_prompt_blocks = -(-n // N)
    one = torch.ones((), device=dev)
    layers = []
    for i in range(LAYERS):
        kv = torch.randn(num_prompt_blocks + pages + 8, H, N, 2 * D, device=dev, dtype=dt)
        layers.append((i, CudaPagedCache(kv, D, "auto", one, one)))
    window = config.window_size()

    def run():
        state = WorkerEviction.for_prompt("r", RequestEviction(config), n, N)
        state.q_window = {i: torch.randn(window, H * G, D, device=dev, dtype=dt) for i in range(LAYERS)} if window else {}
        blocks = (torch.randperm(num_prompt_blocks, device=dev).to(torch.int32),
                  torch.arange(num_prompt_blocks, num_prompt_blocks + pages, device=dev))
        return state, blocks

    return layers, run


def profile(policy: str, n: int, precision: str, allocation: str, repeats: int) -> dict:
    from vllm_evict.engine.compaction import compact_request

    layers, make_state = setup(policy, n, precision, allocation)

    def timed() -> tuple[float, float]:
        state, blocks = make_state()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0 = time.perf_counter()
        start.record()
        compact_request(state, layers, D ** -0.5, *blocks)
        end.record()
        host = time.perf_counter() - t0
        torch.cuda.synchronize()
        return start.elapsed_time(end), host * 1e3

    first_device, first_host = timed()                           # compiles included
    warm = [timed() for _ in range(repeats)]
    row = {"policy": policy, "allocation": allocation, "n": n, "layers": LAYERS, "precision": precision,
           "first_call_ms": round(first_device, 3), "first_call_host_ms": round(first_host, 3),
           "device_ms": round(statistics.median(w[0] for w in warm), 3),
           "host_enqueue_ms": round(statistics.median(w[1] for w in warm), 3)}
    from torch.profiler import ProfilerActivity, profile as torch_profile

    state, blocks = make_state()
    torch.cuda.synchronize()
    with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
        compact_request(state, layers, D ** -0.5, *blocks)
        torch.cuda.synchronize()
    kernels = sorted(prof.key_averages(), key=lambda e: -e.device_time_total)[:10]
    row["top_kernels_us"] = {e.key[:60]: [round(e.device_time_total, 1), e.count] for e in kernels}
    return row


def decode_points(policy: str, allocation: str, num_requests: int, repeats: int) -> dict:
    """Device time of one decode-point compaction batch of num_requests requests (compact_requests, then
    Ada-KV's stacked layouts as the worker reads them), by kernel."""
    from torch.profiler import ProfilerActivity, profile as torch_profile

    from compaction_launches import BLOCKS_EACH, DecodePointBatch
    from vllm_evict.engine.cuda_backend import CudaPagedCache
    from vllm_evict.kernels.window_scores import window_scores
    from vllm_evict.policies import EvictionConfig, register_raw_kernel

    register_raw_kernel(window_scores)
    dev, dt = "cuda", torch.bfloat16
    config = EvictionConfig.from_dict({"policy": policy, "allocation": allocation}, budget_required=False)
    one = torch.ones((), device=dev)
    layers = [(i, CudaPagedCache(torch.randn(num_requests * BLOCKS_EACH, H, N, 2 * D, device=dev, dtype=dt), D,
                                 "auto", one, one)) for i in range(LAYERS)]
    queries = {}  # window queries by window length, made once (outside the timed spans)

    def window_queries(w: int) -> torch.Tensor:
        if w not in queries:
            queries[w] = torch.randn(LAYERS, w, H * G, D, device=dev, dtype=dt)
        return queries[w]

    batch = DecodePointBatch(config, layers, num_requests, window_queries, DECODE_GROUP_BYTES)
    for _ in range(2):  # the first two points (compiles), then the third, timed from the same layouts
        batch.point()
        batch.advance()
    saved = [(s.layers, s.shift) for s in batch.states]

    def timed() -> float:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        batch.point()
        end.record()
        torch.cuda.synchronize()
        for state, (kept_layers, shift) in zip(batch.states, saved):
            state.layers, state.shift = kept_layers, shift
        return start.elapsed_time(end)

    spans = [timed() for _ in range(repeats)]
    with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
        batch.point()
        torch.cuda.synchronize()
    kernels = sorted(prof.key_averages(), key=lambda e: -e.device_time_total)
    busy = sum(e.self_device_time_total for e in kernels)
    return {"policy": policy, "allocation": allocation, "requests": num_requests, "point": 3,
            "eager_span_ms": round(statistics.median(spans), 3), "kernel_ms": round(busy / 1e3, 3),
            "kernel_ms_per_request": round(busy / 1e3 / num_requests, 3),
            "top_kernels_us": {e.key[:70]: [round(e.self_device_time_total, 1), e.count] for e in kernels[:14]}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", nargs="+", type=int, default=[8192, 16384, 32768])
    ap.add_argument("--policies", nargs="+", default=["dropkv", "snapkv", "keydiff"])
    ap.add_argument("--allocations", nargs="+", default=["uniform"])
    ap.add_argument("--precisions", nargs="+", default=["ieee", "bf16x3"])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--decode-points", type=int, nargs="+", default=None, metavar="R",
                    help="profile decode-point batches of R requests instead (--policies, --allocations)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    rows = []
    if args.decode_points:
        for allocation in args.allocations:
            for policy in args.policies:
                for num_requests in args.decode_points:
                    rows.append(decode_points(policy, allocation, num_requests, args.repeats))
                    print(json.dumps(rows[-1]), flush=True)
        args.precisions = []
    for precision in args.precisions:
        for allocation in args.allocations:
            for policy in args.policies:
                for n in args.lengths:
                    rows.append(profile(policy, n, precision, allocation, args.repeats))
                    print(json.dumps(rows[-1]), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
