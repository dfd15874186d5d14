"""Full garbage collections while an engine decodes: how often Python's collector walks its oldest generation
and how long each walk takes. Not a unit test.

    python benchmarks/gc_pauses.py --engine evict --num-requests 256 --max-tokens 1000 --out X.json
    VLLM_EVICT_GC_THRESHOLD2=0 python benchmarks/gc_pauses.py ...     (Python's own threshold, for comparison)

The engine is serving.py's in-process one (the tiny test model on CPU, the Llama-3.1-8B shape with dummy weights
on a GPU); --engine evict gives every request a decode budget. A full collection walks every tracked container
that vLLM's freeze at engine start left out, the token-id lists of every running request above all, so its
length grows with the tokens the engine holds (vllm_evict/engine/host_gc.py).

--collect-first runs one full collection before the requests are added. The collector runs its next full
collection only once the objects promoted since outnumber a quarter of the last one's survivors: the freeze at
engine start leaves that bar at the whole startup heap, so a short CPU run never reaches it, while the GPU
engines' step traces show full collections from their first ~130 steps on. After one full collection the bar is
the few live objects left, as in those runs.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import serving  # noqa: E402  (benchmarks/serving.py: the engine and its driver)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engine", choices=["vanilla", "evict"], required=True)
    ap.add_argument("--num-requests", type=int, default=256)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=1000)
    ap.add_argument("--decode-budget", type=int, default=256, help="evict: every request's decode budget")
    ap.add_argument("--collect-first", action="store_true", help="one full collection before the requests")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    if args.engine == "vanilla":
        os.environ["VLLM_PLUGINS"] = "none"
    engine_args = serving.build_parser().parse_args([
        "one", "--engine", args.engine, "--suite", "decode", "--out", args.out,
        "--max-model-len", str(args.prompt_len + args.max_tokens + 64), "--max-num-seqs", str(args.num_requests),
        "--max-num-batched-tokens", str(max(2048, args.prompt_len * 16)), "--kv-cache-memory-bytes", str(1 << 30)])
    engine, _ = serving.make_engine(engine_args)
    driver = serving.Driver(engine, 0, False)
    eviction = {"policy": "dropkv", "decode_budget": args.decode_budget} if args.engine == "evict" else None
    if args.collect_first:
        gc.collect()
    for _ in range(args.num_requests):
        driver.add(driver.prompt(args.prompt_len), args.max_tokens, eviction)
    collections, full, started, step = [0, 0, 0], [], [0.0], [0]

    def record(phase: str, info: dict) -> None:
        if phase == "start":
            started[0] = time.perf_counter()
            return
        collections[info["generation"]] += 1
        if info["generation"] == 2:
            full.append({"step": step[0], "ms": round(1e3 * (time.perf_counter() - started[0]), 2)})

    gc.callbacks.append(record)
    t0 = time.perf_counter()
    while engine.has_unfinished_requests():
        driver.step()
        step[0] += 1
    wall = time.perf_counter() - t0
    gc.callbacks.remove(record)
    out = {"engine": args.engine, "threshold": gc.get_threshold(), "steps": step[0], "wall_s": round(wall, 2),
           "collections_by_generation": collections, "full_collections": len(full),
           "full_ms_total": round(sum(f["ms"] for f in full), 1), "full": full, "argv": sys.argv[1:]}
    print(json.dumps({k: v for k, v in out.items() if k != "full"}), flush=True)
    Path(args.out).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
