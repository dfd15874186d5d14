"""Where the eviction engine's time goes on GPU (torch profiler, no nsys). Not a unit test.

1. FlashAttention alone, decode shape (B requests x 8 KV heads x kv_len, 32 query heads): vLLM's stock
   call on the NHD cache vs the per-head call on the HND per-head page view, same bytes.
2. In-process evict engine, Llama-3.1-8B shape or another real config (--config; dummy weights): B requests evicted to kv_len per head,
   then a few decode steps under torch.profiler; and the compaction step of a batch of prompts.
Prints the top operators by device time and by host time.

  python benchmarks/profile_engine.py --batch 64 --kv-len 2048 --out-dir $OUT
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile


def bench(fn, iters=20):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def attention_alone(batch: int, kv_len: int) -> dict:
    from vllm.v1.attention.backends.fa_utils import flash_attn_varlen_func, get_flash_attn_version

    H, G, D, N = 8, 4, 128, 16
    dev, dt = "cuda", torch.bfloat16
    blocks_per = kv_len // N
    num_blocks = batch * blocks_per + 1
    version = get_flash_attn_version()
    # stock: NHD cache [blocks, N, H, D] (vLLM FLASH_ATTN), one sequence per request, 32 query heads
    k = torch.randn(num_blocks, N, H, D, device=dev, dtype=dt)
    v = torch.randn_like(k)
    q = torch.randn(batch, H * G, D, device=dev, dtype=dt)
    table = torch.arange(batch * blocks_per, device=dev, dtype=torch.int32).view(batch, blocks_per)
    lens = torch.full((batch,), kv_len, device=dev, dtype=torch.int32)
    cu = torch.arange(batch + 1, device=dev, dtype=torch.int32)
    out = torch.empty_like(q)

    def stock():
        flash_attn_varlen_func(q=q, k=k, v=v, out=out, cu_seqlens_q=cu, max_seqlen_q=1, seqused_k=lens,
                               max_seqlen_k=kv_len, softmax_scale=D ** -0.5, causal=True, block_table=table,
                               fa_version=version)

    # per-head: HND cache [blocks, H, N, 2D] viewed as [blocks*H, N, 1, D] pages, B*H sequences of G heads
    from vllm.utils.torch_utils import canonicalize_singleton_dim_strides

    kv = torch.randn(num_blocks, H, N, 2 * D, device=dev, dtype=dt)
    paged = kv.view(num_blocks * H, 1, N, 2 * D).transpose(1, 2)
    kp, vp = (canonicalize_singleton_dim_strides(x) for x in paged.split(D, dim=-1))
    heads = torch.arange(H, device=dev, dtype=torch.int32).view(H, 1, 1)
    ptable = (table.unsqueeze(0) * H + heads).reshape(H * batch, blocks_per)
    qh = torch.randn(H * batch, G, D, device=dev, dtype=dt)
    plens = torch.full((H * batch,), kv_len, device=dev, dtype=torch.int32)
    pcu = torch.arange(H * batch + 1, device=dev, dtype=torch.int32)
    pout = torch.empty_like(qh)

    def per_head(max_seqlen_k=kv_len):
        flash_attn_varlen_func(q=qh, k=kp, v=vp, out=pout, cu_seqlens_q=pcu, max_seqlen_q=1, seqused_k=plens,
                               max_seqlen_k=max_seqlen_k, softmax_scale=D ** -0.5, causal=True,
                               block_table=ptable, fa_version=version)

    kv_bytes = 2 * batch * kv_len * H * D * 2
    res = {"batch": batch, "kv_len": kv_len, "fa_version": version, "kv_bytes": kv_bytes,
           "stock_ms": bench(stock), "per_head_ms": bench(per_head),
           "per_head_max_seqlen_10x_ms": bench(lambda: per_head(10 * kv_len))}
    res["stock_TBps"] = kv_bytes / res["stock_ms"] / 1e9
    res["per_head_TBps"] = kv_bytes / res["per_head_ms"] / 1e9
    return res


def attention_splits(shapes: list[tuple[int, int]], spreads: list[float], splits_list: list[int],
                     orders: tuple[str, ...] = ("natural",)) -> list[dict]:
    """Ada-KV decode: the per-head FlashAttention decode call on the engine's HND cache (one KV head per virtual
    sequence), per (batch, kv_len) shape and spread: each request's 8 heads share 8*kv_len tokens in
    proportions softmax(spread * N(0, 1)) (spread 0: every head at kv_len), per num_splits (0: FA's
    heuristic; k: dynamic splits of at most k, what the split per-head graphs pass), per order of the
    sequences (natural: as generated; longest: longest first; engine: longest first through the per-head
    graphs' own call, cuda_backend.ordered_decode_attention, queries in place). Each row also gives
    rho = longest head * SMs / total tokens and per_head.split_kv's choice for it."""
    from vllm.v1.attention.backends.fa_utils import flash_attn_varlen_func, get_flash_attn_version

    from vllm_evict.engine.cuda_backend import CudaPagedCache, ordered_decode_attention
    from vllm_evict.engine.per_head import split_kv

    H, G, D, N = 8, 4, 128, 16
    dev, dt = "cuda", torch.bfloat16
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    version = get_flash_attn_version()
    gen = torch.Generator().manual_seed(0)
    rows = []
    for batch, kv_len in shapes:
        layouts = {}
        for spread in spreads:
            shares = torch.softmax(spread * torch.randn(batch, H, generator=gen), dim=-1)
            layouts[spread] = (shares * H * kv_len).round().clamp(min=N).to(torch.int32).flatten()
        pages_needed = max(int(((lens + N - 1) // N).sum()) for lens in layouts.values())
        kv = torch.randn(pages_needed // H + 2, H, N, 2 * D, device=dev, dtype=dt)
        one = torch.ones((), device=dev)
        cache = CudaPagedCache(kv, D, "auto", one, one)     # the engine's per-head view of the cache
        query_counts = torch.ones(batch * H, device=dev, dtype=torch.int32)
        q = torch.randn(batch * H, G, D, device=dev, dtype=dt)
        out = torch.empty_like(q)
        cu = torch.arange(batch * H + 1, device=dev, dtype=torch.int32)
        for spread, lens in layouts.items():
            counts = ((lens + N - 1) // N).tolist()
            page_ids = torch.randperm(kv.shape[0] * H, generator=gen)
            table = torch.zeros(batch * H, max(counts), dtype=torch.int32)
            start = 0
            for i, c in enumerate(counts):
                table[i, :c] = page_ids[start: start + c]
                start += c
            longest, total = int(lens.max()), int(lens.sum())
            for order in orders:
                # FA3 hands out the virtual sequences in index order: "longest" lists them longest first
                perm = torch.arange(lens.numel()) if order == "natural" else torch.argsort(lens, descending=True)
                ordered_table, seqused = table[perm].to(dev), lens[perm].to(dev)
                query_rows = torch.cat([perm, perm[:1]]).to(device=dev, dtype=torch.int32)
                for splits in splits_list:
                    def call():
                        if order == "engine":
                            ordered_decode_attention(q, cache, query_rows, query_counts, seqused, ordered_table,
                                                     longest, out, D ** -0.5, 0.0, num_splits=splits)
                            return
                        flash_attn_varlen_func(q=q, k=cache.key_pages, v=cache.value_pages, out=out,
                                               cu_seqlens_q=cu, max_seqlen_q=1,
                                               seqused_k=seqused, max_seqlen_k=longest, softmax_scale=D ** -0.5,
                                               causal=True, block_table=ordered_table, fa_version=version,
                                               num_splits=splits)
                    ms = bench(call, iters=50)
                    rows.append({"batch": batch, "kv_len": kv_len, "spread": spread, "order": order,
                                 "max_head": longest, "rho": round(longest * num_sms / total, 3),
                                 "rule_splits": split_kv(longest, total, num_sms), "num_splits": splits,
                                 "ms": round(ms, 4), "TBps": round(2 * total * D * 2 / ms / 1e9, 3)})
                    print(json.dumps(rows[-1]), flush=True)
    return rows


DECODE_STEPS = 20  # timed, not profiled, before the profiled ones


def engine_profile(args, out_dir: Path) -> None:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM, SamplingParams

    from vllm_evict.engine import engine_kwargs
    from vllm_evict.testing.engines import gpu_defaults
    from vllm_evict.testing.tiny_models import tiny_eagle_draft, write_real_config

    model = write_real_config(args.config, Path("/tmp/vllm-evict-bench"))
    extra = {}
    if args.eagle_drafts:  # serving.py's EAGLE plans: a one-layer dummy draft, vLLM's synthetic acceptance
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        import serving  # benchmarks/serving.py

        extra["speculative_config"] = {**json.loads(serving.EAGLE[1]), "model": str(tiny_eagle_draft(model)),
                                       "num_speculative_tokens": args.eagle_drafts}
        extra["async_scheduling"] = False  # decode budgets with speculation: refused under asynchronous scheduling
    if args.max_cudagraph_capture_size:
        extra["compilation_config"] = {"max_cudagraph_capture_size": args.max_cudagraph_capture_size}
    llm = LLM(**engine_kwargs(**gpu_defaults(), model=str(model), load_format="dummy", dtype="bfloat16",
                              gpu_memory_utilization=0.9,
                              block_size=16, max_model_len=args.max_model_len, max_num_batched_tokens=16384, seed=0,
                              skip_tokenizer_init=True, **extra))  # token ids in and out, as serving.py
    engine = llm.llm_engine
    sched = engine.engine_core.engine_core.scheduler
    gen = torch.Generator().manual_seed(0)
    budget = args.kv_len / args.prompt_len

    def add(i, n, max_tokens, eviction):
        sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0,
                            extra_args={"vllm_evict": eviction} if eviction else None)
        engine.add_request(f"{n}-{i}-{time.time()}", {"prompt_token_ids": torch.randint(3, 1000, (n,), generator=gen).tolist()}, sp)

    def table(prof, title, path):
        text = [f"== {title}",
                prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=25),
                prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25)]
        path.write_text("\n".join(text))
        print("\n".join(text)[:6000], flush=True)

    core = engine.engine_core.engine_core
    timers = {"schedule": 0.0, "execute": 0.0, "update": 0.0}

    def timed(obj, name, key):
        orig = getattr(obj, name)

        def wrapper(*a, **k):
            t = time.perf_counter()
            try:
                return orig(*a, **k)
            finally:
                timers[key] += time.perf_counter() - t
        setattr(obj, name, wrapper)

    timed(core.scheduler, "schedule", "schedule")
    timed(core.scheduler, "update_from_output", "update")
    timed(core.model_executor, "execute_model", "execute")
    allocations = args.allocation.split(",")
    evictions = [{"policy": args.policy, "budget": budget, "allocation": a} for a in allocations]
    ev = evictions[0]
    if args.mixed_prefill:
        return mixed_prefill_profile(args, engine, sched, add, table, ev, out_dir)
    if args.prefill_only:
        return prefill_profile(args, engine, add, table, ev, out_dir)
    if args.decode_budget:
        return decode_eviction_profile(args, engine, sched, timers, table, out_dir)
    variants = [] if args.evicted_only else [("plain", None, args.kv_len)]
    variants += [("evicted" if len(allocations) == 1 else f"evicted-{e['allocation']}", e, args.prompt_len)
                 for e in evictions]
    for label, eviction, n in variants:
        prefix = torch.randint(3, 1000, (n - 64,), generator=gen).tolist() if args.shared_prefix else None
        for i in range(args.batch):
            sp = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True, temperature=0,
                                extra_args={"vllm_evict": eviction} if eviction else None)
            prompt = prefix + torch.randint(3, 1000, (64,), generator=gen).tolist() if prefix else \
                torch.randint(3, 1000, (n,), generator=gen).tolist()
            engine.add_request(f"{label}-{i}", {"prompt_token_ids": prompt}, sp)
        while any(r.num_computed_tokens < r.num_prompt_tokens for r in sched.running) or sched.waiting:
            engine.step()
        for _ in range(3):
            engine.step()
        torch.cuda.synchronize()
        for k in timers:
            timers[k] = 0.0
        t0 = time.perf_counter()
        for _ in range(DECODE_STEPS):
            engine.step()
        torch.cuda.synchronize()
        dt = (time.perf_counter() - t0) / DECODE_STEPS
        print(f"### decode {label}: batch {len(sched.running)}, {dt * 1e3:.2f} ms/step (not profiled); per step "
              + ", ".join(f"{k} {v / DECODE_STEPS * 1e3:.2f} ms" for k, v in timers.items()), flush=True)
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            t0 = time.perf_counter()
            for _ in range(3):
                engine.step()
            torch.cuda.synchronize()
            dt = (time.perf_counter() - t0) / 3
        print(f"### decode {label}: {dt * 1e3:.2f} ms/step (profiled)", flush=True)
        table(prof, f"decode {label}", out_dir / f"profile_decode_{label}.txt")
        for r in list(sched.running) + list(sched.waiting):
            engine.abort_request([r.request_id])
        while engine.has_unfinished_requests():
            engine.step()
    if args.evicted_only:
        return
    # the compaction step: batch of 8 prompts evicted at the end of prefill
    for i in range(8):
        add(i, args.prompt_len, 1, ev)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        while engine.has_unfinished_requests():
            engine.step()
        torch.cuda.synchronize()
    print(f"### prefill+compaction of 8 x {args.prompt_len}: {time.perf_counter() - t0:.3f} s (profiled)", flush=True)
    table(prof, "prefill + compaction", out_dir / "profile_compaction.txt")


def timeline(trace_path: Path) -> dict:
    """GPU timeline of a chrome trace: total kernel time, and per `vllm_evict.compact` host range the
    kernels launched inside it: their GPU span, their summed time, the GPU idle time before the first one
    (after the forward), and the median lag from launch to start. A lag near zero with idle time in the
    span means the GPU waited for the host to launch the compaction work."""
    events = json.loads(trace_path.read_text())["traceEvents"]
    kernels = sorted((e for e in events if e.get("cat") == "kernel"), key=lambda e: e["ts"])
    launches = {e["args"]["correlation"]: e["ts"] for e in events  # Triton launches via the driver API
                if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {})}
    ranges = [e for e in events if e.get("name") == "vllm_evict.compact" and e.get("ph") == "X"
              and e.get("cat") == "user_annotation"]
    rows = []
    for r in sorted(ranges, key=lambda e: e["ts"]):
        inside = [k for k in kernels if r["ts"] <= launches.get(k["args"].get("correlation"), -1) <= r["ts"] + r["dur"]]
        if not inside:
            continue
        start, end = inside[0]["ts"], max(k["ts"] + k["dur"] for k in inside)
        before = [k for k in kernels if k["ts"] + k["dur"] <= start]
        lags = sorted(k["ts"] - launches[k["args"]["correlation"]] for k in inside)
        rows.append({"host_us": round(r["dur"]), "span_us": round(end - start),
                     "busy_us": round(sum(k["dur"] for k in inside)), "kernels": len(inside),
                     "idle_before_us": round(start - before[-1]["ts"] - before[-1]["dur"]) if before else None,
                     "median_launch_lag_us": round(lags[len(lags) // 2])})
    busy = sum(k["dur"] for k in kernels)
    wall = (kernels[-1]["ts"] + kernels[-1]["dur"] - kernels[0]["ts"]) if kernels else 0
    return {"kernel_ms": round(busy / 1e3, 1), "gpu_span_ms": round(wall / 1e3, 1), "compaction": rows}


def python_profile(run, title: str, path: Path) -> None:
    """Host time of run() by Python function (cProfile; the device work overlaps unless a call waits on
    it): the top functions by own time and by cumulative time."""
    import cProfile
    import io
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    run()
    torch.cuda.synchronize()
    prof.disable()
    text = io.StringIO()
    text.write(f"== {title}\n")
    stats = pstats.Stats(prof, stream=text).strip_dirs()
    stats.sort_stats("tottime").print_stats(40)
    stats.sort_stats("cumulative").print_stats(60)
    path.write_text(text.getvalue())
    print(text.getvalue()[:8000], flush=True)


def decode_eviction_profile(args, engine, sched, timers, table, out_dir):
    """Decode-time eviction: B requests of --prompt-len tokens with a decode budget of --kv-len
    tokens per head (every --decode-every tokens), against B plain requests whose prompts hold about the
    same KV (--kv-len + half a compaction interval). Per variant: host time per phase and the step-time
    distribution over two compaction intervals, then a profile of one interval (its compaction step,
    the steps recording window queries, the plain steps)."""
    import statistics

    from vllm import SamplingParams

    every = args.decode_every
    gen = torch.Generator().manual_seed(1)
    variants = [("plain", None, args.kv_len + every // 2)] + [
        (f"decode-{policy}-{allocation}", {"policy": policy, "decode_budget": args.kv_len, "decode_every": every,
                                           "allocation": allocation}, args.prompt_len)
        for policy in args.policy.split(",") for allocation in args.allocation.split(",")]
    for label, eviction, n in variants:
        for i in range(args.batch):
            sp = SamplingParams(max_tokens=n + 4 * every, ignore_eos=True, temperature=0,
                                extra_args={"vllm_evict": eviction} if eviction else None)
            engine.add_request(f"{label}-{i}", {"prompt_token_ids": torch.randint(3, 1000, (n,), generator=gen).tolist()},
                               sp)
        while any(r.num_computed_tokens < r.num_prompt_tokens for r in sched.running) or sched.waiting:
            engine.step()
        for _ in range(every + 8):  # past the first decode compaction (its kernels compiled at start)
            engine.step()
        torch.cuda.synchronize()
        for k in timers:
            timers[k] = 0.0
        steps = []
        for _ in range(2 * every):
            t0 = time.perf_counter()
            engine.step()
            steps.append(time.perf_counter() - t0)
        torch.cuda.synchronize()
        ms = sorted(s * 1e3 for s in steps)
        print(json.dumps({"variant": label, "batch": len(sched.running), "steps": len(ms),
                          "mean_ms": round(statistics.mean(ms), 2), "median_ms": round(statistics.median(ms), 2),
                          "p90_ms": round(ms[int(0.9 * len(ms))], 2), "max_ms": round(ms[-1], 2),
                          **{f"{k}_ms_per_step": round(v / len(ms) * 1e3, 2) for k, v in timers.items()}}),
              flush=True)
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(args.profile_steps or every):
                engine.step()
            torch.cuda.synchronize()
        table(prof, f"decode {label}, {args.profile_steps or every} steps", out_dir / f"profile_{label}.txt")
        if args.python_profile:  # host time by Python function over another interval (cProfile)
            python_profile(lambda: [engine.step() for _ in range(args.profile_steps or every)],
                           f"decode {label}", out_dir / f"python_{label}.txt")
        for r in list(sched.running) + list(sched.waiting):
            engine.abort_request([r.request_id])
        while engine.has_unfinished_requests():
            engine.step()


def prefill_profile(args, engine, add, table, ev, out_dir):
    """Prefill-only passes (max_tokens=1) of B prompts, plain then evicting, after one warm-up request of
    each kind at the same length (Triton compiles stay out); wall time and profiles of both."""
    def run(eviction, label, profiled):
        for i in range(args.batch):
            add(i, args.prompt_len, 1, eviction)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        if profiled:
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                while engine.has_unfinished_requests():
                    engine.step()
                torch.cuda.synchronize()
            table(prof, f"prefill {label}", out_dir / f"profile_prefill_{label}.txt")
            trace = out_dir / f"trace_prefill_{label}.json"
            prof.export_chrome_trace(str(trace))
            print(json.dumps({"timeline": label, **timeline(trace)}), flush=True)
        else:
            while engine.has_unfinished_requests():
                engine.step()
            torch.cuda.synchronize()
        return time.perf_counter() - t0

    for eviction in (None, ev):  # warm-up
        add(0, args.prompt_len, 1, eviction)
        while engine.has_unfinished_requests():
            engine.step()
    for label, eviction in (("plain", None), ("evict", ev)):
        wall = run(eviction, label, False)
        print(f"### prefill {label} {args.batch} x {args.prompt_len}: {wall:.3f} s (not profiled)", flush=True)
    for label, eviction in (("plain", None), ("evict", ev)):
        wall = run(eviction, label, True)
        print(f"### prefill {label} {args.batch} x {args.prompt_len}: {wall:.3f} s (profiled)", flush=True)


def mixed_prefill_profile(args, engine, sched, add, table, ev, out_dir):
    """The prefill phase of a serving run: B prompts submitted at once, each generating --max-tokens, so
    that the steps prefilling the later prompts also decode the earlier ones (one row each). Three passes
    until every prompt is prefilled: prefill-only (max_tokens=1, no decode rows: the physical limit's
    pass), mixed plain, mixed evicting; wall time, then a profile of each."""
    passes = (("prefill-only", None, 1), ("mixed-plain", None, args.max_tokens), ("mixed-evict", ev, args.max_tokens))

    def run(eviction, max_tokens):
        for i in range(args.batch):
            add(i, args.prompt_len, max_tokens, eviction)
        torch.cuda.synchronize()
        t0, steps = time.perf_counter(), 0
        while sched.waiting or any(r.num_computed_tokens < r.num_prompt_tokens for r in sched.running):
            engine.step()
            steps += 1
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
        for r in list(sched.running):
            engine.abort_request([r.request_id])
        while engine.has_unfinished_requests():
            engine.step()
        return wall, steps

    for eviction in (None, ev):  # warm-up: Triton compiles stay out
        add(0, args.prompt_len, 2, eviction)
        while engine.has_unfinished_requests():
            engine.step()
    for label, eviction, max_tokens in passes:
        wall, steps = run(eviction, max_tokens)
        print(json.dumps({"pass": label, "batch": args.batch, "prompt_len": args.prompt_len, "steps": steps,
                          "wall_s": round(wall, 3), "profiled": False}), flush=True)
    for label, eviction, max_tokens in passes:
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            wall, steps = run(eviction, max_tokens)
        print(json.dumps({"pass": label, "steps": steps, "wall_s": round(wall, 3), "profiled": True}), flush=True)
        table(prof, f"{label} {args.batch} x {args.prompt_len}", out_dir / f"profile_{label}.txt")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--kv-len", type=int, default=2048)
    ap.add_argument("--prompt-len", type=int, default=8192)
    ap.add_argument("--out-dir", default=".")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--max-model-len", type=int, default=16384)
    ap.add_argument("--config", default="llama-3.1-8b", help="the model: a name of tiny_models.REAL_CONFIGS")
    ap.add_argument("--shared-prefix", action="store_true")
    ap.add_argument("--evicted-only", action="store_true")
    ap.add_argument("--prefill-only", action="store_true", help="profile prefill passes, plain vs evicting")
    ap.add_argument("--mixed-prefill", action="store_true",
                    help="the prefill phase of a serving run (later prompts next to earlier ones' decode rows) "
                         "against a prefill-only pass, plain and evicting")
    ap.add_argument("--policy", default="dropkv", help="--decode-budget: several, joined by commas")
    ap.add_argument("--allocation", default="uniform", help="uniform, adakv, or both joined by a comma (one variant each)")
    ap.add_argument("--decode-budget", action="store_true",
                    help="profile decode-time eviction: a decode budget of --kv-len against plain requests")
    ap.add_argument("--decode-every", type=int, default=128)
    ap.add_argument("--profile-steps", type=int, default=0, help="--decode-budget: steps profiled (0: --decode-every)")
    ap.add_argument("--python-profile", action="store_true",
                    help="--decode-budget: also cProfile the host's Python over as many steps")
    ap.add_argument("--eagle-drafts", type=int, default=0,
                    help="speculative decoding: an EAGLE draft of one layer (dummy weights) proposing this many "
                         "tokens a step, accepted at vLLM's synthetic mean length of 2.5")
    ap.add_argument("--max-cudagraph-capture-size", type=int, default=0,
                    help="vLLM's compilation_config.max_cudagraph_capture_size (0: vLLM's default, 512 tokens)")
    ap.add_argument("--attention-splits", action="store_true",
                    help="only the per-head FlashAttention call, per shape, head spread and num_splits")
    ap.add_argument("--split-shapes", nargs="+", default=None, help="--attention-splits: BATCH:KV_LEN shapes "
                    "(default --batch:--kv-len)")
    ap.add_argument("--spreads", type=float, nargs="+", default=[0.0, 1.5], help="--attention-splits: head spreads")
    ap.add_argument("--num-splits", type=int, nargs="+", default=[0, 1, 2, 4, 8, 16, 32])
    ap.add_argument("--orders", nargs="+", choices=["natural", "longest", "engine"], default=["natural"],
                    help="--attention-splits: orders of the virtual sequences")
    args = ap.parse_args()
    out_dir = Path(args.out_dir)
    if args.attention_splits:
        shapes = [tuple(int(x) for x in shape.split(":")) for shape in args.split_shapes or
                  [f"{args.batch}:{args.kv_len}"]]
        attention_splits(shapes, args.spreads, args.num_splits, tuple(args.orders))
        return
    if not (args.prefill_only or args.decode_budget or args.mixed_prefill):
        print(attention_alone(args.batch, args.kv_len), flush=True)
    engine_profile(args, out_dir)


if __name__ == "__main__":
    main()
