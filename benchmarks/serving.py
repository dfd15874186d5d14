"""Serving benchmarks: vllm-evict against vanilla vLLM 0.26.0 on a GPU machine. Not a unit test.

    python benchmarks/serving.py run --plan NAME --out-dir DIR     (the plans: PLANS below, docs/BENCHMARKS.md)

Every engine runs in its own subprocess (a clean GPU for each); `run` starts them one after another
in one run, so the vanilla baseline always comes from the same run. The engine is stepped
in-process (VLLM_ENABLE_V1_MULTIPROCESSING=0): step times are what the engine loop takes, scheduling
and output processing included.

Suites (`--suite`):
  latency   TTFT (max_tokens=1) at batch 1 and 8 for 8K/32K/64K prompts, with the engine's own
            scoring + compaction time; then decode step latency at equal batch and equal KV length
            (vanilla prompt K; vllm-evict prompt K/budget evicted to K per head, and prompt K not evicted).
  load      N requests of L in / O out, all submitted at t=0, ignore_eos: end-to-end output tokens/s,
            decode-phase tokens/s (steps in which no request prefilled), concurrency, and capacity
            (most requests running before the first preemption). --num-requests 0: as many requests as the
            KV pool holds at once at this shape (decode tok/s at capacity).
  capacity  capacity alone (max_tokens large, stop once admission stalls or a request is preempted).

  prefill   prefill-only passes and TTFT at batch 1 per policy, with the reported eviction latency.
  e2e       the end-to-end shapes (--shapes LEN:OUT:N); vanilla also measures eviction's physical limit
            (prefill-only time + decode time at the evicted KV length) on the same engine.
  decode    decode-heavy load: the load suite once per eviction object of --decode-configs
            (decode-time eviction; vanilla runs it once without eviction).
  limit     vanilla only: the physical limit of decode-time eviction for that decode-heavy shape,
            per decode budget of --decode-configs: prefill-only time + vanilla decode steps over the KV a
            decode-budget request holds at each step (suite_limit says how).
  memory    prefill time and peak KV blocks of one request per length (--memory-lengths), with no eviction,
            one-shot and block-wise KeyDiff (--memory-budget, --chunk-size), and which lengths the KV pool
            serves at all (the evict engine with --allow-long-prompts may exceed the pool).

Engines (`--engine`): `vanilla` (stock vLLM, VLLM_PLUGINS=none, FLASH_ATTN (TRITON_ATTN for a per-token-head
cache, vLLM's choice per layer for a TurboQuant cache), vLLM's default CUDA graph mode) or `evict` (vllm-evict's engine kwargs: the same backend, vLLM's
default CUDA graph mode, eviction
scheduler).

Shared-prefix prompts (`--shared-prefix`, load/capacity on the evict engine only): every prompt is one
common prefix plus a distinct 64-token tail. With prefix caching the prefix is prefilled once; each
request still scores its own window and compacts its own copy, so from compaction on it holds exactly
the blocks a distinct prompt would. This makes 32K capacity runs cost one prefill instead of hundreds.
It is never used for vanilla, where shared blocks would inflate capacity.

  python benchmarks/serving.py run --plan latency --out-dir $OUT   # vanilla then evict, one call
  python benchmarks/serving.py one --engine evict --suite load --prompt-len 8192 ... --out x.json
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import itertools
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


# ----------------------------------------------------------------------------------------------- engine
def make_engine(args):
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    import torch
    from vllm import LLM

    on_gpu = torch.cuda.is_available()
    if on_gpu:
        if args.model:  # written by `run` (a vanilla run cannot import this package)
            model = Path(args.model)
        else:
            from vllm_evict.testing.tiny_models import write_real_config

            model = write_real_config("llama-3.1-8b", Path(args.workdir))
        # vLLM's Triton backend alone reads its per-token-head caches; a TurboQuant cache names none (vLLM
        # picks per layer): as vllm_evict.engine.attention_backend
        backend = ("TRITON_ATTN" if args.kv_cache_dtype.endswith("per_token_head")
                   else None if args.kv_cache_dtype.startswith("turboquant_") else "FLASH_ATTN")
        kwargs = dict(model=str(model), load_format="dummy", dtype="bfloat16", gpu_memory_utilization=0.9,
                      attention_backend=backend)
        if importlib.util.find_spec("flashinfer") is None:  # as testing.engines.gpu_defaults (vanilla: no package)
            kwargs["gdn_prefill_backend"] = "triton"
        if args.kv_cache_memory_bytes is not None:  # a capped KV pool
            kwargs["kv_cache_memory_bytes"] = args.kv_cache_memory_bytes
        kwargs["kv_cache_dtype"] = args.kv_cache_dtype
        if args.max_cudagraph_capture_size is not None:
            kwargs["compilation_config"] = {"max_cudagraph_capture_size": args.max_cudagraph_capture_size}
    else:  # CPU smoke run of the script itself (tests/bench): tiny random Llama, fp32
        from vllm_evict.testing.tiny_models import ensure_tiny_model

        model = ensure_tiny_model("llama")
        kwargs = dict(model=str(model), dtype="float32", kv_cache_memory_bytes=args.kv_cache_memory_bytes or 1 << 28)
    # Token ids in, token ids out: no detokenizer. Dummy weights emit ids outside the stand-in
    # tokenizer's vocabulary, and detokenizing them cost O(prompt length) per request per step.
    kwargs.update(block_size=16, max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
                  max_num_batched_tokens=args.max_num_batched_tokens, enable_prefix_caching=args.prefix_caching, seed=0,
                  skip_tokenizer_init=True, enforce_eager=args.enforce_eager)
    if args.speculative_config:
        kwargs["speculative_config"] = args.speculative_config
    if args.no_async_scheduling:
        kwargs["async_scheduling"] = False
    workers = args.tensor_parallel_size * args.pipeline_parallel_size
    if workers > 1:  # worker processes (or Ray actors); the engine core stays here (its scheduler is read)
        kwargs.update(tensor_parallel_size=args.tensor_parallel_size,
                      pipeline_parallel_size=args.pipeline_parallel_size,
                      distributed_executor_backend=args.distributed_executor_backend)
        if not on_gpu:  # vLLM binds each CPU worker to a NUMA node of its own unless given cores
            os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "|".join(
                str(i % os.cpu_count()) for i in range(workers)))
    if args.engine == "evict":
        from vllm_evict.engine import engine_kwargs
        from vllm_evict.engine.request_config import LONG_PROMPTS_ENV

        kwargs = engine_kwargs(**kwargs)
        if args.allow_long_prompts:
            os.environ[LONG_PROMPTS_ENV] = "1"
    t0 = time.time()
    llm = LLM(**kwargs)
    return llm.llm_engine, round(time.time() - t0, 1)


class Driver:
    """Adds requests to an in-process LLMEngine and steps it, timing every step."""

    def __init__(self, engine, seed: int, trace: bool = False):
        import torch

        self.engine = engine
        core = engine.engine_core.engine_core
        self.scheduler = core.scheduler
        self.gen = torch.Generator().manual_seed(seed)
        self.counter = 0
        self.vocab = 1000
        self.scheduled = (0, 0)  # the last step's (tokens, requests), read off the scheduler's output
        self.preemptions = 0  # requests preempted so far, read off the scheduler's outputs
        # --step-trace: the last step's host time in schedule, execute_model, update_from_output, and (vllm-evict,
        # in process) the requests it compacted and its attention
        self.host_ms = [0.0, 0.0, 0.0]
        self.plan = [0, 0]
        # end of the last step, and the time from the end of the step before it: the step plus the driver's
        # loop between the two (which every engine driven by this loop pays, at its batch)
        self.step_end: float | None = None
        self.period: float | None = None
        # --step-trace: ms in this process's garbage collector over the last period (the engine runs in it), and
        # what has accumulated since
        self.gc_ms, self._gc_pending_ms, self._gc_started = 0.0, 0.0, 0.0
        if trace:
            gc.callbacks.append(self._time_gc)
        schedule = self.scheduler.schedule

        def timed(slot, fn):
            if not trace:
                return fn

            def call(*a, **kw):
                t0 = time.perf_counter()
                try:
                    return fn(*a, **kw)
                finally:
                    self.host_ms[slot] += 1e3 * (time.perf_counter() - t0)
            return call

        def counted_schedule(*a, **kw):
            output = timed_schedule(*a, **kw)
            self.scheduled = (output.total_num_scheduled_tokens, len(output.num_scheduled_tokens))
            self.preemptions += len(output.preempted_req_ids or ())
            return output

        timed_schedule = timed(0, schedule)
        self.scheduler.schedule = counted_schedule
        core.model_executor.execute_model = timed(1, core.model_executor.execute_model)
        self.scheduler.update_from_output = timed(2, self.scheduler.update_from_output)
        if trace and os.environ.get("VLLM_PLUGINS") != "none":  # the worker runs in this process (uniproc executor)
            from vllm_evict.engine.worker import STATE

            build_plan = STATE.build_plan

            def traced_plan(*a, **kw):
                build_plan(*a, **kw)
                if STATE.plan is not None:
                    self.plan[0] += len(STATE.plan.compacting)
                    self.plan[1] = max(self.plan[1], 2 if STATE.plan.per_head else int(STATE.plan.stages_queries))
            STATE.build_plan = traced_plan

    def prompt(self, n: int, prefix: list[int] | None = None) -> list[int]:
        import torch

        if prefix is not None:
            return prefix + torch.randint(3, self.vocab, (n - len(prefix),), generator=self.gen).tolist()
        return torch.randint(3, self.vocab, (n,), generator=self.gen).tolist()

    def add(self, prompt: list[int], max_tokens: int, eviction: dict | None) -> str:
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        rid = f"q{self.counter}"
        self.counter += 1
        extra = {"vllm_evict": eviction} if eviction else None
        sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0, detokenize=False,
                            output_kind=RequestOutputKind.DELTA, extra_args=extra)
        self.engine.add_request(rid, {"prompt_token_ids": prompt}, sp)
        return rid

    def prefilling(self) -> int:
        return sum(1 for r in self.scheduler.running if r.num_computed_tokens < r.num_prompt_tokens)

    def step(self):
        """One engine step: (outputs, seconds, new tokens, decode_only). decode_only: no request was
        prefilling before or after the step and none was admitted (queued requests may be waiting)."""
        running = len(self.scheduler.running)
        decode_only = self.prefilling() == 0
        self.host_ms, self.plan = [0.0, 0.0, 0.0], [0, 0]
        t0 = time.perf_counter()
        outs = self.engine.step()
        end = time.perf_counter()
        dt = end - t0
        self.period = None if self.step_end is None else end - self.step_end
        self.step_end = end
        self.gc_ms, self._gc_pending_ms = self._gc_pending_ms, 0.0
        new = sum(len(o.outputs[0].token_ids) for o in outs if o.outputs)
        decode_only = decode_only and self.prefilling() == 0 and len(self.scheduler.running) <= running
        return outs, dt, new, decode_only

    def _time_gc(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._gc_started = time.perf_counter()
        else:
            self._gc_pending_ms += 1e3 * (time.perf_counter() - self._gc_started)

    def drain(self, ids: list[str]) -> None:
        self.engine.abort_request(ids)
        while self.engine.has_unfinished_requests():
            self.engine.step()


def eviction_of(args, budget: float | None = None, allocation: str | None = None) -> dict | None:
    """The eviction object of a run; --budget 0: no prompt eviction (a decode budget alone)."""
    if args.engine != "evict" or args.policy == "none":
        return None
    budget = budget if budget is not None else args.budget
    return {"policy": args.policy, **({"budget": budget} if budget > 0 else {}),
            "allocation": allocation or args.allocation.split(",")[0], **args.eviction_options}


def report_of(out) -> dict | None:
    if os.environ.get("VLLM_PLUGINS") == "none":  # vanilla: no plugin, no reports (and no vllm_evict on the path)
        return None
    from vllm_evict.engine import eviction_report

    return eviction_report(out)


# ---------------------------------------------------------------------------------------------- suites
def suite_latency(args, drv: Driver, deadline: float) -> dict:
    result: dict = {"ttft": [], "decode": []}
    drv.add(drv.prompt(min(4096, args.max_model_len // 2)), 1, eviction_of(args))  # warm-up: Triton kernels
    while drv.engine.has_unfinished_requests():
        drv.step()
    for length, batch in args.ttft_cases:
        for rep in range(args.repeats):
            if time.time() > deadline:
                result["incomplete"] = True
                return result
            t0 = time.perf_counter()
            ids = {drv.add(drv.prompt(length), 1, eviction_of(args)): None for _ in range(batch)}
            ttft, latency = {}, {}
            while len(ttft) < len(ids):
                outs, _, _, _ = drv.step()
                for o in outs:
                    if o.finished and o.request_id in ids:
                        ttft[o.request_id] = time.perf_counter() - t0
                        rep_ = report_of(o)
                        if rep_ is not None:
                            latency[o.request_id] = rep_.get("latency_ms")
            row = {"prompt_len": length, "batch": batch, "repeat": rep,
                   "ttft_ms_mean": round(1e3 * statistics.mean(ttft.values()), 2),
                   "ttft_ms_max": round(1e3 * max(ttft.values()), 2)}
            if latency:
                row["evict_ms_mean"] = round(statistics.mean(v for v in latency.values() if v is not None), 2)
            result["ttft"].append(row)
            print(json.dumps(row), flush=True)
    for batch in args.decode_batches:
        for label, prompt_len, eviction in decode_variants(args):
            if time.time() > deadline:
                result["incomplete"] = True
                return result
            ids = [drv.add(drv.prompt(prompt_len), args.decode_steps + 8, eviction) for _ in range(batch)]
            times = []
            while drv.engine.has_unfinished_requests():
                _, dt, new, decode_only = drv.step()
                if decode_only and new == batch and len(drv.scheduler.running) == batch:
                    times.append(dt)
            times = times[2:]  # the first decode steps after a prefill still settle
            row = {"variant": label, "batch": batch, "prompt_len": prompt_len, "kv_len": args.kv_len,
                   "steps": len(times), "step_ms_median": round(1e3 * statistics.median(times), 3) if times else None,
                   "step_ms_p90": round(1e3 * sorted(times)[int(0.9 * (len(times) - 1))], 3) if times else None}
            result["decode"].append(row)
            print(json.dumps(row), flush=True)
            del ids
    return result


def decode_variants(args):
    """(label, prompt length, eviction) with KV length args.kv_len per head after prefill."""
    if args.engine == "vanilla":
        return [("vanilla", args.kv_len, None)]
    evicted_prompt = int(round(args.kv_len / args.decode_budget))
    return [("evict engine, no eviction", args.kv_len, None)] + [
        (f"evict engine, {args.policy} {args.decode_budget} {allocation} ({evicted_prompt} -> {args.kv_len})",
         evicted_prompt, {"policy": args.policy, "budget": args.decode_budget, "allocation": allocation})
        for allocation in args.decode_allocations]


def run_load(args, drv: Driver, deadline: float, num_requests: int, max_tokens: int, eviction: dict | None,
             stop_at_capacity: bool, shared_prefix: bool | None = None) -> dict:
    """shared_prefix: None follows --shared-prefix (suite e2e passes False: its prompts are always distinct)."""
    shared = args.shared_prefix if shared_prefix is None else shared_prefix
    prefix = drv.prompt(args.prompt_len - args.shared_tail) if shared else None
    t0 = time.perf_counter()
    ids = [drv.add(drv.prompt(args.prompt_len, prefix), max_tokens, eviction) for _ in range(num_requests)]
    steps = tokens = decode_tokens = 0
    decode_s = 0.0
    decode_batch = []
    decode_requests = 0  # requests of the decode-only steps (with speculation: tokens per request and step)
    max_running = 0
    capacity = None
    preempted = False
    preemptions = drv.preemptions  # a request of this run preempted: the count has grown
    last_admission = 0
    stop_reason = "all requests finished"
    latency = []
    trace = []  # --step-trace: every step (its fields: --step-trace's help)
    while drv.engine.has_unfinished_requests():
        if time.time() > deadline:
            stop_reason = "deadline"
            break
        before = len(drv.scheduler.running)
        outs, dt, new, decode_only = drv.step()
        steps += 1
        if args.step_trace:
            trace.append([round(1e3 * dt, 3), *drv.scheduled, int(decode_only),
                          *(round(ms, 3) for ms in drv.host_ms), *drv.plan, round(drv.gc_ms, 3)])
        tokens += new
        for o in outs:
            if o.finished and (r := report_of(o)) is not None and r.get("latency_ms") is not None:
                latency.append(r["latency_ms"])
        if decode_only and new:
            decode_tokens += new
            decode_s += dt
            decode_batch.append(new)
            decode_requests += drv.scheduled[1]
        running = len(drv.scheduler.running)
        if running > before:
            last_admission = steps
        if not preempted:
            preempted = drv.preemptions > preemptions
            if preempted:
                capacity = max_running
            else:
                max_running = max(max_running, running)
        if stop_at_capacity:
            if preempted:
                stop_reason = "first preemption"
                break
            if drv.scheduler.waiting and steps - last_admission > args.stall_steps:
                stop_reason = f"no admission for {args.stall_steps} steps with requests waiting"
                break
    wall = time.perf_counter() - t0
    if drv.engine.has_unfinished_requests():
        drv.drain(ids)
    out = {"num_requests": num_requests, "prompt_len": args.prompt_len, "max_tokens": max_tokens,
           "eviction": eviction, "shared_prefix": bool(prefix), "stop_reason": stop_reason, "steps": steps,
           "wall_s": round(wall, 2), "capacity": capacity if capacity is not None else max_running,
           "capacity_bound": "first preemption" if capacity is not None else stop_reason}
    if not stop_at_capacity:
        out.update(output_tokens=tokens, output_tok_s=round(tokens / wall, 1),
                   decode_steps=len(decode_batch), decode_tokens=decode_tokens,
                   decode_tok_s=round(decode_tokens / decode_s, 1) if decode_s else None,
                   decode_mean_batch=round(statistics.mean(decode_batch), 1) if decode_batch else None,
                   decode_s=round(decode_s, 3),
                   decode_step_ms_mean=round(1e3 * decode_s / len(decode_batch), 2) if decode_batch else None)
        if args.speculative_config and decode_requests:
            out["decode_tokens_per_request_step"] = round(decode_tokens / decode_requests, 2)
    if latency:
        out["evict_ms_mean"] = round(statistics.mean(latency), 2)
    print(json.dumps(out), flush=True)
    if trace:
        out["step_trace"] = trace
    return out


def suite_load(args, drv: Driver, deadline: float) -> dict:
    """--num-requests 0: as many requests as the KV pool holds at once at this shape (fit_requests), so that
    the decode-phase figures are those at capacity (decode tok/s at capacity)."""
    eviction = eviction_of(args)
    fit = fit_requests(args, drv, eviction, args.max_tokens) if args.num_requests == 0 else None
    out = run_load(args, drv, deadline, fit["num_requests"] if fit else args.num_requests, args.max_tokens,
                   eviction, False)
    if fit:
        out["fit"] = fit
    return out


def held_blocks_at_end(schedule, num_tokens: int, fresh_blocks: int) -> int:
    """Blocks a request of `num_tokens` (prompt + max_tokens) holds at its end: the last term of
    CompactionSchedule.peak_blocks (its steady state once compacted, not the transient of a one-shot point)."""
    bs, at, physical, index = schedule.page_size, 0, 0, 0
    while (point := schedule.point(index)) is not None and point.at < num_tokens:
        at, physical = point.at, point.kept if point.in_place else fresh_blocks * bs
        index += 1
    return -(-(physical + num_tokens - at) // bs)


def fit_requests(args, drv: Driver, eviction: dict | None, max_tokens: int) -> dict:
    """How many requests of --prompt-len + max_tokens the KV pool holds at once without a preemption:
    (usable blocks - reserve) // blocks per request. Vanilla: a request holds its whole sequence. Evict: it
    holds what its compaction schedule leaves at the end (vllm_evict's own schedule); the reserve is the
    prompt blocks that requests still being prefilled hold before their compaction (the shared prefix once
    with --shared-prefix, else two prompts: at most two 32K prompts prefill in one 16K-token step)."""
    bs = drv.scheduler.block_size
    usable = drv.scheduler.kv_cache_manager.block_pool.num_gpu_blocks - 1  # less vLLM's null block
    total = args.prompt_len + max_tokens
    if eviction is None:
        per, reserve = -(-total // bs), 0
    else:
        from vllm_evict.engine.request_config import parse_request
        from vllm_evict.engine.scheduler import plan_eviction

        ev = plan_eviction(parse_request({"vllm_evict": eviction}), args.prompt_len, bs, max_tokens=max_tokens)
        per = -(-total // bs) if ev is None else held_blocks_at_end(ev.schedule, total, ev.blocks)
        reserve = -(-args.prompt_len // bs) * (1 if args.shared_prefix else 2)
    num = max(1, min(args.max_num_seqs, (usable - reserve) // per))
    fit = {"num_requests": num, "blocks_per_request": per, "reserve_blocks": reserve, "usable_blocks": usable}
    print(json.dumps({"fit": fit}), flush=True)
    return fit


def suite_decode(args, drv: Driver, deadline: float) -> dict:
    """Decode-heavy load: --num-requests of --prompt-len in / --max-tokens out, all at t=0, once
    per eviction object of --decode-configs on one engine (vanilla: once, without eviction)."""
    configs = [None] if args.engine == "vanilla" else args.decode_configs
    runs = []
    for config in configs:
        if time.time() > deadline:
            break
        try:  # a config the engine refuses (e.g. not implemented yet) costs its row, not the others
            runs.append(run_load(args, drv, deadline, args.num_requests, args.max_tokens, config, False))
        except Exception as exc:  # noqa: BLE001
            runs.append({"eviction": config, "error": f"{type(exc).__name__}: {exc}"[:500]})
            print(json.dumps(runs[-1]), flush=True)
            if drv.engine.has_unfinished_requests():
                drv.drain([f"q{i}" for i in range(drv.counter)])
    return {"runs": runs}


def suite_capacity(args, drv: Driver, deadline: float) -> dict:
    runs = []
    for budget, allocation in args.capacity_configs:
        if time.time() > deadline:
            break
        eviction = eviction_of(args, budget, allocation)
        # Enough requests to outgrow the cache: ~1.3x what it holds at budget * prompt tokens each.
        cache_tokens = drv.scheduler.kv_cache_manager.block_pool.num_gpu_blocks * tokens_per_block(drv.scheduler)
        num = args.num_requests if eviction is None else int(1.3 * cache_tokens / (budget * args.prompt_len)) + 16
        runs.append(run_load(args, drv, deadline, num, args.max_tokens, eviction, True))
    return {"runs": runs}


def suite_e2e(args, drv: Driver, deadline: float) -> dict:
    """The three end-to-end shapes (--shapes LEN:OUT:N), all requests submitted at t=0.

    Vanilla also measures the physical limit of eviction on the same engine: a prefill-only pass over
    fresh prompts of the same shape (max_tokens=1), plus the decode-phase time of N requests whose
    prompts are budget*LEN tokens long (the KV an evicted request decodes over).
    limit = prefill-only wall time + that decode-phase time."""
    shapes = []
    prompt_len = args.prompt_len  # restored for the suites after this one on the same engine
    allocations = args.allocation.split(",")  # the evict engine runs every shape once per allocation
    for (length, out_tokens, num), allocation in itertools.product(args.shapes, allocations):
        args.prompt_len = length
        eviction = eviction_of(args, allocation=allocation)
        row = {"shape": f"{length} in / {out_tokens} out x {num}"}
        if args.warm_up_load:  # the same load untimed first: vLLM JIT-compiles some Triton kernels (fused MoE)
            # for the batch shapes it first meets, once per engine, and the limit's passes run after them
            row["warm_up_wall_s"] = run_load(args, drv, deadline, num, out_tokens, eviction, False,
                                             shared_prefix=False)["wall_s"]
        # distinct prompts whatever --shared-prefix says (it is for a load/capacity suite on the same engine)
        row |= {"load": run_load(args, drv, deadline, num, out_tokens, eviction, False, shared_prefix=False)}
        if args.engine == "evict":
            row["allocation"] = allocation
        else:
            row["prefill_only"] = run_load(args, drv, deadline, num, 1, None, False, shared_prefix=False)
            args.prompt_len = int(round(length * args.budget))
            row["decode_at_evicted_kv"] = run_load(args, drv, deadline, num, out_tokens, None, False,
                                                   shared_prefix=False)
            row["limit_s"] = round(row["prefill_only"]["wall_s"] + row["decode_at_evicted_kv"]["decode_s"], 2)
        shapes.append(row)
        print(json.dumps({"wall_s": row["load"].get("wall_s"), "decode_s": row["load"].get("decode_s"),
                          **{k: v for k, v in row.items() if k in ("shape", "allocation", "limit_s")}}), flush=True)
    args.prompt_len = prompt_len
    return {"shapes": shapes}


# ------------------------------------------------------------------ physical limit of decode-time eviction
def decode_held_tokens(prompt_len: int, max_tokens: int, decode_budget: int, decode_every: int | None = None,
                       page_size: int = 16, protected: int = 0) -> list[int]:
    """KV tokens per head that a request with a decode budget attends over at each of its decode steps
    j = 1 .. max_tokens-1 (the prefill step samples the first token), under CompactionSchedule's rule (DESIGN.md
    §4.8) for a request without prompt eviction and without protect_prompt, uniform allocation (Ada-KV holds
    the same number of pages per head on average). Pure arithmetic: the vanilla engine cannot import vllm_evict;
    tests/bench checks it against CompactionSchedule.

    Step j writes token prompt+j-1, so s = prompt + j tokens are written and attended over, less the evicted
    ones. Decode point k runs at at_k = prompt + k*C_d tokens written (right after the step that writes token
    at_k - 1): the request then holds held = at_k - evicted tokens; if held needs more than P_d =
    ceil(max(K_d, protected)/page) pages it keeps P_d pages (P_d*page tokens), else it keeps all.
    `protected`: the policy's sink + window (P_d is at least those pages; irrelevant for K_d >= 1024)."""
    every = -(-(decode_every or 128) // page_size) * page_size
    pages = max(-(-decode_budget // page_size), -(-max(protected, 1) // page_size))
    held_tokens, evicted, next_at = [], 0, prompt_len + every
    for j in range(1, max_tokens):
        written = prompt_len + j
        while next_at < written:  # the points that ran before step j
            held = next_at - evicted
            if -(-held // page_size) > pages:
                evicted += held - pages * page_size
            next_at += every
        held_tokens.append(written - evicted)
    return held_tokens


def peak_blocks_of(held_tokens: list[int], page_size: int = 16) -> int:
    """CompactionSchedule.peak_blocks for the schedule of decode_held_tokens: the most held before a
    compaction, or the held tokens at the end plus the last sampled token (whose KV is never written)."""
    return -(-max(max(held_tokens), held_tokens[-1] + 1) // page_size)


def interp(x: float, xs: list[float], ys: list[float]) -> float:
    """Piecewise-linear through (xs, ys), xs ascending; constant beyond the ends."""
    if x <= xs[0]:
        return ys[0]
    for (x0, y0), (x1, y1) in zip(zip(xs, ys), zip(xs[1:], ys[1:])):
        if x <= x1:
            return y0 + (y1 - y0) * (x - x0) / (x1 - x0) if x1 > x0 else y1
    return ys[-1]


def decode_curve(args, drv: Driver, deadline: float, batch: int, kv_from: int, kv_to: int) -> dict:
    """Vanilla decode step time at `batch` over KV lengths kv_from .. kv_to: `batch` fresh prompts of kv_from
    tokens decoded for kv_to - kv_from + 16 tokens. Each decode-only step in which every request decoded is
    timed against its mean KV length (prompt + tokens generated before the step / batch: attention reads grow
    with the total). A step's time is its period (Driver.period: the step and the driver's loop before it), as
    in every wall time this benchmark measures, the prefill-only pass of the limit included. Steps are binned
    by --limit-bin KV tokens; a bin keeps its median step (robust to a host hiccup) and its mean KV."""
    ids = [drv.add(drv.prompt(kv_from), kv_to - kv_from + 16, None) for _ in range(batch)]
    generated, points = 0, []
    while drv.engine.has_unfinished_requests():
        if time.time() > deadline:
            drv.drain(ids)
            break
        kv = kv_from + generated / batch
        _, _, new, decode_only = drv.step()
        generated += new
        if decode_only and new == batch and len(drv.scheduler.running) == batch and drv.period is not None:
            points.append((kv, drv.period))
    points = points[2:]  # the first decode steps after a prefill still settle
    bins: dict[int, list[tuple[float, float]]] = {}
    for kv, dt in points:
        bins.setdefault(int(kv // args.limit_bin), []).append((kv, dt))
    rows = [{"kv": round(statistics.mean(kv for kv, _ in b), 1), "step_ms": round(1e3 * statistics.median(
        dt for _, dt in b), 3), "steps": len(b)} for _, b in sorted(bins.items())]
    fit = None
    if len(points) > 2:  # least squares step_ms = a + b * kv, for the record (the limit interpolates the bins)
        mx = statistics.mean(kv for kv, _ in points)
        my = statistics.mean(1e3 * dt for _, dt in points)
        sxx = sum((kv - mx) ** 2 for kv, _ in points)
        slope = sum((kv - mx) * (1e3 * dt - my) for kv, dt in points) / sxx if sxx else 0.0
        fit = {"ms_at_0": round(my - slope * mx, 3), "ms_per_1k_kv": round(1e3 * slope, 4)}
    out = {"batch": batch, "kv_from": kv_from, "kv_to": kv_to, "timed_steps": len(points), "bins": rows,
           "linear_fit": fit, "complete": bool(rows) and rows[-1]["kv"] >= kv_to - 2 * args.limit_bin}
    print(json.dumps({k: v for k, v in out.items() if k != "bins"}), flush=True)
    return out


def decode_limit(num_requests: int, max_tokens: int, held_tokens: list[int], peak_blocks: int, usable_blocks: int,
                 max_num_seqs: int, curves: dict[int, dict]) -> dict:
    """The decode-phase time of an ideal evicting engine: B = min(N, max_num_seqs, usable blocks // peak
    blocks) requests decode together, so N requests run in N // B waves of B and one of N % B (an engine that
    admits on each request's peak never preempts; on the H200 all 256 requests fit: one wave). A wave takes
    sum over its decode steps j of step_ms(batch, held_tokens[j]), with step_ms interpolated in the vanilla
    curve measured at that batch, i.e. a vanilla decode step over exactly the KV the evicting request holds.
    Compaction time is left out: it is what the evicting engine must add over the limit."""
    batch = max(1, min(num_requests, max_num_seqs, usable_blocks // peak_blocks))
    waves = [batch] * (num_requests // batch) + ([num_requests % batch] if num_requests % batch else [])
    decode_s = 0.0
    for b in waves:
        bins = curves[b]["bins"]
        xs, ys = [r["kv"] for r in bins], [r["step_ms"] for r in bins]
        decode_s += sum(interp(kv, xs, ys) for kv in held_tokens) / 1e3
    tokens = num_requests * (max_tokens - 1)
    return {"batch": batch, "waves": waves, "decode_s": round(decode_s, 2),
            "decode_tok_s": round(tokens / decode_s, 1) if decode_s else None}


def suite_limit(args, drv: Driver, deadline: float) -> dict:
    """Vanilla only: the physical limit of decode-time eviction for --num-requests x --prompt-len
    in / --max-tokens out, one row per distinct (decode_budget, decode_every) of --decode-configs.

        limit = prefill-only time + decode time at the KV length an evicting request holds, step by step.

    Prefill-only: the N prompts once with max_tokens=1 (what the first token costs; as in suite e2e). Decode:
    decode_held_tokens gives the KV held at each of the max_tokens-1 decode steps (from prompt to P_d*16 + C_d
    and then a saw-tooth between P_d*16 and P_d*16 + C_d: for K_d=1024 and C_d=128 the mean is about K_d +
    C_d/2); the vanilla step time at the batch the evicting engine runs (decode_limit) is measured over that
    KV range on this engine (decode_curve) and summed over the steps (the time-weighted average, exactly:
    no assumption that the step is linear in KV). Compaction costs nothing in the limit."""
    prefill = run_load(args, drv, deadline, args.num_requests, 1, None, False, shared_prefix=False)
    bs = drv.scheduler.block_size
    usable = drv.scheduler.kv_cache_manager.block_pool.num_gpu_blocks - 1
    configs = {}
    for config in args.decode_configs:
        key = (config["decode_budget"], config.get("decode_every"))
        configs.setdefault(key, config)
    schedules = {}
    needed: dict[int, list[int]] = {}  # batch -> KV range to measure
    for (budget, every), config in configs.items():
        held = decode_held_tokens(args.prompt_len, args.max_tokens, budget, every, bs)
        peak = peak_blocks_of(held, bs)
        batch = max(1, min(args.num_requests, args.max_num_seqs, usable // peak))
        schedules[(budget, every)] = (held, peak)
        for b in {batch, args.num_requests % batch} - {0}:
            lo, hi = needed.get(b, [min(held), max(held)])
            needed[b] = [min(lo, min(held) - 1), max(hi, max(held))]
    curves = {b: decode_curve(args, drv, deadline, b, lo, hi) for b, (lo, hi) in sorted(needed.items(), reverse=True)}
    rows = []
    for (budget, every), (held, peak) in schedules.items():
        dec = decode_limit(args.num_requests, args.max_tokens, held, peak, usable, args.max_num_seqs, curves)
        row = {"decode_budget": budget, "decode_every": every or 128, "held_tokens_mean": round(statistics.mean(held), 1),
               "held_tokens_min": min(held), "held_tokens_max": max(held), "peak_blocks": peak,
               "prefill_only_s": prefill["wall_s"], **dec, "limit_s": round(prefill["wall_s"] + dec["decode_s"], 2),
               "complete": finished(prefill)
               and all(curves[b]["complete"] for b in set(dec["waves"]))}
        rows.append(row)
        print(json.dumps(row), flush=True)
    return {"limit": {"prefill_only": prefill, "curves": list(curves.values()), "rows": rows,
                      "shape": f"{args.num_requests} x {args.prompt_len} in / {args.max_tokens} out"}}


def suite_prefill(args, drv: Driver, deadline: float) -> dict:
    """Prefill-phase time (--prefill-shapes LEN:N, max_tokens=1, all submitted at t=0) and TTFT at batch 1
    (--ttft-lengths, median of --repeats) per policy (--prefill-policies NAME:ALLOCATION at --budget;
    vanilla runs none), with the engine's reported eviction latency per request next to it."""
    policies = [None] if args.engine == "vanilla" else [
        {"policy": p.split(":")[0], "budget": args.budget, "allocation": p.split(":")[1]}
        for p in args.prefill_policies]
    rows = []
    for eviction in policies:
        for length, num in args.prefill_shapes:
            args.prompt_len = length
            run = run_load(args, drv, deadline, num, 1, eviction, False)
            rows.append({"kind": "prefill", "prompt_len": length, "requests": num, "eviction": eviction,
                         "wall_s": run["wall_s"], "evict_ms_mean": run.get("evict_ms_mean"),
                         "complete": finished(run)})
        for length in args.ttft_lengths:
            ttft, reported = [], []
            for _ in range(args.repeats):
                t0 = time.perf_counter()
                rid = drv.add(drv.prompt(length), 1, eviction)
                while drv.engine.has_unfinished_requests():
                    outs, _, _, _ = drv.step()
                    for o in outs:
                        if o.finished and o.request_id == rid:
                            ttft.append(time.perf_counter() - t0)
                            if (r := report_of(o)) is not None and r.get("latency_ms") is not None:
                                reported.append(r["latency_ms"])
            rows.append({"kind": "ttft", "prompt_len": length, "eviction": eviction,
                         "ttft_ms_median": round(1e3 * statistics.median(ttft), 2),
                         "ttft_ms_all": [round(1e3 * t, 2) for t in ttft],
                         "evict_ms_median": round(statistics.median(reported), 2) if reported else None})
        print(json.dumps(rows[-1]), flush=True)
    return {"rows": rows}


def suite_memory(args, drv: Driver, deadline: float) -> dict:
    """Memory-bounded prefill: one request at a time per prompt length (--memory-lengths,
    max_tokens=1), for no eviction, one-shot and block-wise (--chunk-size, more fields from
    --eviction-options) --memory-policy at --memory-budget tokens per head (vanilla: no eviction only). Each row has the prefill time, the most KV
    blocks the request held (read after every block allocation of the manager, so a compaction step's
    peak counts) and how it ended: a prompt the engine cannot serve is rejected or ends with an error,
    which gives the longest prompt servable on the engine's KV pool."""
    manager = drv.scheduler.kv_cache_manager
    held = manager.coordinator.single_type_managers[0].req_to_blocks
    peaks: list[int] = []
    allocate = manager.allocate_slots

    def allocate_and_record(request, *a, **kw):
        blocks = allocate(request, *a, **kw)
        peaks.append(len(held.get(request.request_id, ())))
        return blocks

    manager.allocate_slots = allocate_and_record  # this engine's manager only
    modes = [None]
    if args.engine == "evict":
        one_shot = {"policy": args.memory_policy, "budget": args.memory_budget}
        modes += [one_shot, {**one_shot, "chunked": True, "chunk_size": args.chunk_size, **args.eviction_options}]
    rows = []
    for length in args.memory_lengths:
        for eviction in modes:
            if time.time() > deadline:
                break
            peaks.clear()
            row = {"prompt_len": length, "eviction": eviction}
            t0 = time.perf_counter()
            try:
                rid = drv.add(drv.prompt(length), 1, eviction)
            except ValueError as exc:  # longer than --max-model-len: the API refuses it
                rows.append({**row, "ended": f"rejected: {exc}"[:200]})
                print(json.dumps(rows[-1]), flush=True)
                continue
            ended = report = None
            while drv.engine.has_unfinished_requests():
                outs, _, _, _ = drv.step()
                for o in outs:
                    if o.finished and o.request_id == rid:
                        ended = o.outputs[0].finish_reason
                        report = report_of(o)
            rows.append({**row, "ended": ended, "prefill_s": round(time.perf_counter() - t0, 3),
                         "peak_blocks": max(peaks, default=0), "prompt_blocks": -(-length // 16),
                         "compactions": (report or {}).get("compactions")})
            print(json.dumps(rows[-1]), flush=True)
    manager.allocate_slots = allocate
    pool = drv.scheduler.kv_cache_manager.block_pool.num_gpu_blocks
    return {"rows": rows, "kv_pool_tokens": pool * 16}


def kv_cache_groups(scheduler) -> list[dict]:
    """The engine's KV cache groups (one block pool for all): the arithmetic of a hybrid model's capacity."""
    groups = []
    for group in scheduler.kv_cache_config.kv_cache_groups:
        spec = group.kv_cache_spec
        groups.append({"spec": type(spec).__name__, "layers": len(group.layer_names), "block_size": spec.block_size,
                       "sliding_window": getattr(spec, "sliding_window", None),
                       "page_bytes": spec.page_size_bytes})
    return groups


def tokens_per_block(scheduler) -> int:
    """Tokens a block of the pool holds in the full-attention group (16, unless a linear-attention hybrid's
    state pages set a larger attention block)."""
    return max((g.kv_cache_spec.block_size for g in scheduler.kv_cache_config.kv_cache_groups
                if type(g.kv_cache_spec).__name__ == "FullAttentionSpec"), default=16)


SUITES = {"latency": suite_latency, "load": suite_load, "capacity": suite_capacity, "e2e": suite_e2e,
          "prefill": suite_prefill, "memory": suite_memory, "decode": suite_decode, "limit": suite_limit}


def run_one(args) -> dict:
    if args.engine == "vanilla":
        os.environ["VLLM_PLUGINS"] = "none"  # load no general plugins at all: stock vLLM
        if args.kv_cache_dtype.startswith("turboquant_"):  # vLLM's V1 runner cannot shape a TurboQuant cache:
            os.environ.pop("VLLM_USE_V2_MODEL_RUNNER", None)  # vLLM's own choice of runner
    engine, start_s = make_engine(args)
    # for the measurements: a slow engine start cuts none short, unless the plan's budget (--stop-by) ends first
    deadline = min(time.time() + args.time_limit, args.stop_by or float("inf"))
    import torch

    sched = engine.engine_core.engine_core.scheduler
    blocks = sched.kv_cache_manager.block_pool.num_gpu_blocks
    drv = Driver(engine, args.seed, args.step_trace)
    result: dict = {}
    for suite in args.suite.split(","):  # several suites share one engine start
        if suite == "limit" and args.engine != "vanilla":
            raise SystemExit("suite limit runs on the vanilla engine (the limit is vanilla's step time)")
        result.update(SUITES[suite](args, drv, deadline))
    if "limit" in result and result.get("runs"):  # vanilla's own run of the same shape on the same engine
        vanilla = result["runs"][0]
        for row in result["limit"]["rows"]:
            row["vanilla_wall_s"] = vanilla.get("wall_s")
            row["limit_vs_vanilla"] = round(vanilla["wall_s"] / row["limit_s"], 2) if vanilla.get("wall_s") else None
        print(json.dumps({"limit": [{k: r[k] for k in ("decode_budget", "limit_s", "vanilla_wall_s",
                                                         "limit_vs_vanilla")} for r in result["limit"]["rows"]]}),
              flush=True)
    result.update(engine=args.engine, suite=args.suite, policy=None if args.engine == "vanilla" else args.policy,
                  engine_start_s=start_s, kv_tokens_total=blocks * tokens_per_block(sched),
                  cudagraph_mode=str(engine.vllm_config.compilation_config.cudagraph_mode),
                  kv_cache_groups=kv_cache_groups(sched),
                  device=torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
                  date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), argv=sys.argv[1:])
    return result


# ------------------------------------------------------------------------------------------ plans
# The workloads behind the figures of docs/BENCHMARKS.md. A plan is the engines of one run, one after another,
# vanilla vLLM first so that every ratio compares two engines of the same machine: (engine, suite, extra
# arguments, seconds of budget). `python benchmarks/serving.py run --plan NAME --out-dir DIR` runs one.
# Llama-3.1-8B config with dummy bf16 weights, all requests submitted at t = 0; the evict engine runs the `one`
# defaults (DropKV at a 10% budget, uniform) unless a plan says otherwise.
PREFILL_TTFT = ["--ttft-lengths", "8192", "32768", "--repeats", "3", "--max-model-len", "33280"]
PREFILL_8K_32K = ["--prefill-shapes", "8192:64", "32768:32", *PREFILL_TTFT]
PREFILL_8K_16K = ["--prefill-shapes", "8192:64", "16384:64", "--ttft-lengths", "8192", "--repeats", "3",
                  "--max-model-len", "33280"]
DECODE_STEP = ["--ttft-cases", "--kv-len", "1024", "--max-model-len", "8192", "--decode-steps", "40"]
E2E_8K_16K = ["--shapes", "8192:2048:86", "16384:512:64", "--max-model-len", "16896"]
E2E_8K = E2E_8K_16K[:2] + E2E_8K_16K[3:]  # 86 x 8K in / 2K out only
TP2_E2E = ["--tensor-parallel-size", "2", "--shapes", "16384:512:96", "--max-model-len", "16896"]
PP2_E2E = ["--pipeline-parallel-size", "2", "--shapes", "16384:512:96", "--max-model-len", "16896"]
RAY = ["--distributed-executor-backend", "ray"]
# decode-time eviction: 64 x 1K in / 2K out on a pool capped at 64K tokens (8 GiB of Llama-3.1-8B KV), so that
# the pool, not the batch limit, bounds vanilla; and the reasoning shape, 256 x 1K in / 4K out on the whole GPU
DECODE_BUDGET_64K_POOL = ["--prompt-len", "1024", "--max-tokens", "2048", "--num-requests", "64",
                          "--kv-cache-memory-bytes", str(8 << 30), "--max-model-len", "4096"]
# every step traced: where a run's time over the limit goes (compaction steps, plain steps, the loop)
REASONING_ARGS = ["--prompt-len", "1024", "--max-tokens", "4096", "--num-requests", "256", "--max-model-len", "5376",
                  "--step-trace"]
# suite limit: the reasoning shape's physical limit at decode budgets 1024 and 2048 (vanilla's own step times)
REASONING_LIMIT = ["--decode-configs", *[json.dumps({"policy": "dropkv", "decode_budget": b}) for b in (1024, 2048)]]
CAPACITY_32K = ["--prompt-len", "32768", "--max-tokens", "4096", "--max-model-len", "36864", "--max-num-seqs", "1024"]
# decode tok/s at capacity (32K in / 256 out, --num-requests 0: as many as the pool holds at once) and
# 64 x 16K in / 512 out end to end with eviction's physical limit, per KV-cache dtype
AT_CAPACITY_32K = ["--prompt-len", "32768", "--max-tokens", "256", "--num-requests", "0", "--max-model-len", "33280",
                   "--max-num-seqs", "1024"]
E2E_16K = ["--shapes", "16384:512:64"]
FP8 = ["--kv-cache-dtype", "fp8"]
# vLLM's per-token-head caches (TRITON_ATTN): a scale per token and head beside int8 / fp8 / int4 data
PER_TOKEN_HEAD = {bits: ["--kv-cache-dtype", f"{bits}_per_token_head"] for bits in ("int8", "fp8", "int4")}
# vLLM's TurboQuant caches (TURBOQUANT; a dense model's first and last two layers stay in the model dtype).
# Shared-prefix prompts end in 256 distinct tokens: vLLM's TurboQuant prefill runs a continuation of up to
# 128 tokens as that many decode queries, each reading the whole cached prefix (with 64, an untraced DropKV
# capacity run on an H100 took 289 s for 6 steps); a longer one dequantizes the prefix once
# (_CONTINUATION_DECODE_THRESHOLD in its turboquant_attn.py)
TURBOQUANT = {preset: ["--kv-cache-dtype", f"turboquant_{preset}", "--shared-tail", "256", "--step-trace"]
              for preset in ("k8v4", "4bit_nc", "k3v4_nc", "3bit_nc")}
# vLLM's n-gram drafter, 4 draft tokens (no draft model; vLLM turns asynchronous scheduling off with it, in
# both engines). Dummy weights repeat their tokens, so its drafts are nearly all accepted: the speculation's
# mechanics under eviction, not a trained model's acceptance
NGRAM = ["--speculative-config", json.dumps({"method": "ngram", "num_speculative_tokens": 4,
                                             "prompt_lookup_max": 4, "prompt_lookup_min": 2})]
# vLLM's EAGLE drafter with a one-layer draft of the target's shape (dummy weights; its KV cache is compacted with
# the target's), 3 draft tokens. A dummy draft's tokens are almost never the target's, so vLLM's synthetic rejection
# sampling (CUDA only) accepts drafts at a mean acceptance length of 2.5 tokens a step in both engines: the cost
# of a draft model and its cache beside eviction, not a trained draft's acceptance. run_plan writes the draft's
# config beside the target's and puts its path where EAGLE_DRAFT stands.
EAGLE_DRAFT = "eagle-draft-of-the-target"
EAGLE = ["--speculative-config", json.dumps({"method": "eagle", "model": EAGLE_DRAFT, "num_speculative_tokens": 3,
                                             "draft_load_config": {"load_format": "dummy"},
                                             "rejection_sample_method": "synthetic",
                                             "synthetic_acceptance_length": 2.5})]
# the same acceptance with 2 drafts: vLLM resolves a mean length of 2.5 to the rates [1, 0.5] (and 0 for a third
# draft, which EAGLE's 3 drafts verify in vain), so a step verifies 3 tokens a request instead of 4
EAGLE_TWO = ["--speculative-config", json.dumps({**json.loads(EAGLE[1]), "num_speculative_tokens": 2})]
# 3 drafts a step at up to 128 requests and none at more (vLLM's dynamic speculation), where a step of 4 tokens a
# request through an 8B model costs more than the 2.5 it accepts gain (docs/BENCHMARKS.md)
EAGLE_BY_BATCH = ["--speculative-config", json.dumps({**json.loads(EAGLE[1]), "num_speculative_tokens_per_batch_size":
                                                      [[1, 128, 3], [129, 1024, 0]]})]
# decode budgets with speculative decoding run under synchronous scheduling (the engine refuses them under vLLM's
# asynchronous scheduling, which plans a step before the last one's drafts are verified: DESIGN.md §4.8 g);
# vanilla keeps vLLM's default
SYNCHRONOUS = ["--no-async-scheduling"]
# CUDA graphs up to 1,024 tokens (vLLM's default stops at 512): a step of 256 requests with 3 drafts each
# verifies 1,024 tokens, beyond the default, and runs without graphs in both engines
GRAPHS_1024 = ["--max-cudagraph-capture-size", "1024"]
BLOCKWISE_POOL = ["--kv-cache-memory-bytes", str(8 << 30), "--memory-lengths", "32768", "65000", "131000"]


# hybrid models (sliding-window layers beside full attention; eviction compacts the full-attention KV cache
# group only): concurrent 32K requests until the first preemption (vanilla; DropKV 10% uniform with a shared
# prefix), then LEN x N end to end with the physical limit, on one engine start each
HYBRID_32K = ["--prompt-len", "32768", "--max-tokens", "4096", "--max-model-len", "36864", "--max-num-seqs", "1024"]


def _no_eviction_plan(num_requests: int, extra: tuple[str, ...] = (), seconds: int = 300) -> list[tuple]:
    """The no-eviction tax: N x 16K in / 512 out without eviction, vanilla against the plugin's engine."""
    load = ["--prompt-len", "16384", "--max-tokens", "512", "--num-requests", str(num_requests),
            "--max-model-len", "16896", *extra]
    return [("vanilla", "load", load, seconds), ("evict", "load", load + ["--policy", "none"], seconds)]


def _hybrid_plan(vanilla_requests: int, shape: str, seconds: int) -> list[tuple]:
    e2e = ["--shapes", shape]
    return [("vanilla", "capacity,e2e", HYBRID_32K + ["--num-requests", str(vanilla_requests)] + e2e, seconds),
            ("evict", "capacity,e2e", HYBRID_32K + ["--shared-prefix", "--capacity-configs", "0.1:uniform"] + e2e,
             seconds)]


def _hybrid_e2e_plan(shape: str, seconds: int) -> list[tuple]:
    """End to end only, vanilla then DropKV 10%: the two engines one after the other on one GPU, each after an
    untimed run of the same load (vLLM compiles its fused-MoE Triton kernels for new batch sizes in the first)."""
    e2e = HYBRID_32K + ["--shapes", shape, "--warm-up-load"]
    return [("vanilla", "e2e", e2e, seconds), ("evict", "e2e", e2e, seconds)]


def _decode_configs(*configs: dict) -> list[str]:
    return ["--decode-configs", *[json.dumps(c) for c in configs]]


def _reasoning_plan(budget: int, allocation: str) -> list[tuple]:
    """vanilla's run of the reasoning shape and its physical limit at decode budgets 1024 and 2048, then DropKV
    and SnapKV at `budget` with `allocation`, an engine each (a cut run loses only its own figures)."""
    seconds = 240 if budget == 1024 else 330  # the engine's start, then the load (about 100-200 s on an H100)
    return [("vanilla", "limit,decode", REASONING_ARGS + REASONING_LIMIT, 400)] + [
        ("evict", "decode", REASONING_ARGS + _decode_configs(
            {"policy": policy, "decode_budget": budget, "allocation": allocation}), seconds)
        for policy in ("dropkv", "snapkv")]


PLANS = {
    # capacity: concurrent 32K-token requests until the first preemption (H100: vanilla's load at 32K / 512,
    # then DropKV shared-prefix load and capacity at 0.1 / 0.2, uniform / Ada-KV)
    "capacity-decode-32k-512": [
        ("vanilla", "load", ["--prompt-len", "32768", "--max-tokens", "512", "--num-requests", "26"], 210),
        ("evict", "load", ["--prompt-len", "32768", "--max-tokens", "512", "--num-requests", "192", "--shared-prefix"],
         200),
        ("evict", "capacity", ["--prompt-len", "32768", "--max-tokens", "4096", "--shared-prefix",
                               "--capacity-configs", "0.2:uniform", "0.1:adakv", "0.2:adakv"], 240)],
    # the same count with 4,096 tokens out, per KV-cache dtype
    "capacity-32k-bf16": [("vanilla", "capacity", CAPACITY_32K + ["--num-requests", "72"], 240),
                          ("evict", "capacity", CAPACITY_32K + ["--shared-prefix", "--capacity-configs", "0.1:uniform"],
                           300)],
    "capacity-32k-fp8": [("vanilla", "capacity", CAPACITY_32K + ["--num-requests", "144"] + FP8, 300),
                         ("evict", "capacity", CAPACITY_32K + ["--shared-prefix", "--capacity-configs", "0.1:uniform"]
                          + FP8, 300)],
    # vanilla on the per-token-head cache (about 1.9x / 3.8x bf16's tokens), DropKV 10% on it (up to 2,048
    # requests at once: int4 holds about 1,000)
    **{f"capacity-32k-{bits}-per-token-head": [
        ("vanilla", "capacity", CAPACITY_32K + ["--num-requests", str(requests)] + PER_TOKEN_HEAD[bits], 300),
        ("evict", "capacity", CAPACITY_32K + ["--max-num-seqs", "2048", "--shared-prefix",
                                              "--capacity-configs", "0.1:uniform"] + PER_TOKEN_HEAD[bits], 300)]
       for bits, requests in (("int8", 72), ("fp8", 72), ("int4", 144))},
    # TurboQuant caches: vanilla bf16, then vanilla and DropKV 10% on each preset (on a dense model vLLM keeps the
    # first and last two layers in bf16: 2.8x-3.3x bf16's tokens). Capacity is a count, so every engine of the
    # plan runs eagerly: TurboQuant's Triton kernels compile during CUDA graph capture (150-200 s of an engine's
    # start on an H200), which would leave a device call no time for the load
    "capacity-32k-turboquant": [
        ("vanilla", "capacity", CAPACITY_32K + ["--num-requests", "72", "--enforce-eager"], 150),
        *[(engine, "capacity", CAPACITY_32K + TURBOQUANT[preset] + ["--enforce-eager"] + extra, 300)
          for preset in TURBOQUANT
          for engine, extra in (("vanilla", ["--num-requests", "120"]),
                                ("evict", ["--max-num-seqs", "2048", "--shared-prefix", "--capacity-configs",
                                           "0.1:uniform"]))]],
    # decode throughput at capacity and end to end at 16K, bf16 against fp8 cache (--shared-prefix: load only)
    "capacity-e2e-bf16": [("vanilla", "load,e2e", AT_CAPACITY_32K + E2E_16K, 280),
                          ("evict", "load,e2e", AT_CAPACITY_32K + E2E_16K + ["--shared-prefix"], 220)],
    "capacity-e2e-fp8": [("vanilla", "load,e2e", AT_CAPACITY_32K + E2E_16K + FP8, 290),
                         ("evict", "load,e2e", AT_CAPACITY_32K + E2E_16K + ["--shared-prefix"] + FP8, 230)],
    "capacity-e2e-int4-per-token-head": [
        ("vanilla", "load,e2e", AT_CAPACITY_32K + E2E_16K + PER_TOKEN_HEAD["int4"], 290),
        ("evict", "load,e2e", AT_CAPACITY_32K + ["--max-num-seqs", "2048"] + E2E_16K + ["--shared-prefix"]
         + PER_TOKEN_HEAD["int4"], 290)],
    "capacity-e2e-turboquant-4bit-nc": [
        ("vanilla", "load,e2e", AT_CAPACITY_32K + E2E_16K + TURBOQUANT["4bit_nc"], 290),
        ("evict", "load,e2e", AT_CAPACITY_32K + ["--max-num-seqs", "2048"] + E2E_16K + ["--shared-prefix"]
         + TURBOQUANT["4bit_nc"], 290)],
    # end to end against the physical limit (vanilla measures it): DropKV uniform and Ada-KV on one engine
    "e2e-8k-2k-16k-512": [("vanilla", "e2e", E2E_8K_16K, 320),
                          ("evict", "e2e", E2E_8K_16K + ["--allocation", "uniform,adakv"], 300)],
    "e2e-8k-2k-snapkv": [("vanilla", "e2e", E2E_8K, 240),
                         ("evict", "e2e", E2E_8K + ["--policy", "snapkv", "--allocation", "uniform,adakv"], 240)],
    # tensor parallelism on two GPUs (FULL graphs, async scheduling, Ada-KV's all-gather over NCCL)
    "tp2-e2e-16k-512": [("vanilla", "e2e", TP2_E2E, 250),
                        ("evict", "e2e", TP2_E2E + ["--allocation", "uniform,adakv"], 290)],
    # the same on Ray's executor, and pipeline parallelism (two stages) on it (GPUS_PER_JOB=2 in side_by_side.sh)
    "tp2-ray-e2e-16k-512": [("vanilla", "e2e", TP2_E2E + RAY, 250),
                            ("evict", "e2e", TP2_E2E + RAY + ["--allocation", "uniform,adakv"], 290)],
    "pp2-ray-e2e-16k-512": [("vanilla", "e2e", PP2_E2E + RAY, 250),
                            ("evict", "e2e", PP2_E2E + RAY + ["--allocation", "uniform,adakv"], 290)],
    # prefill-phase time (max_tokens=1) and TTFT at batch 1
    "prefill-8k-32k-dropkv": [("vanilla", "prefill", PREFILL_8K_32K, 150),
                              ("evict", "prefill", PREFILL_8K_32K + ["--prefill-policies", "dropkv:uniform",
                                                                     "dropkv:adakv"], 300)],
    "prefill-8k-32k-keydiff-snapkv": [("vanilla", "prefill", PREFILL_8K_32K, 150),
                                      ("evict", "prefill", PREFILL_8K_32K + ["--prefill-policies", "dropkv:adakv",
                                                                             "keydiff:uniform", "snapkv:uniform"], 330)],
    "prefill-8k-16k": [("vanilla", "prefill", PREFILL_8K_16K, 180),
                       ("evict", "prefill", PREFILL_8K_16K + ["--prefill-policies", "snapkv:uniform", "dropkv:uniform",
                                                              "dropkv:adakv"], 300)],
    # decode step at 1,024 KV tokens per head: vanilla, the plugin without eviction, 2,048-token prompts
    # evicted to 1,024 (DropKV 0.5) with uniform and Ada-KV allocation
    "decode-step-batches-1-256": [
        ("vanilla", "latency", DECODE_STEP + ["--decode-batches", "1", "8", "64", "256"], 200),
        ("evict", "latency", DECODE_STEP + ["--decode-batches", "1", "8", "64", "256", "--decode-budget", "0.5",
                                            "--decode-allocations", "uniform", "adakv"], 260)],
    "decode-step-batches-64-256": [
        ("vanilla", "latency", DECODE_STEP + ["--decode-batches", "64", "256"], 150),
        ("evict", "latency", DECODE_STEP + ["--decode-batches", "64", "256", "--decode-budget", "0.5",
                                            "--decode-allocations", "uniform", "adakv"], 180)],
    # decode-time eviction: decode budgets every 128 generated tokens, no prompt eviction
    "decode-budget-1k-2k-64k-pool": [
        ("vanilla", "decode", DECODE_BUDGET_64K_POOL, 200),
        ("evict", "decode", DECODE_BUDGET_64K_POOL + _decode_configs(*[
            {"policy": policy, "decode_budget": budget} for budget in (512, 1024) for policy in ("dropkv", "snapkv")]),
         330)],
    # decode-time eviction at the reasoning shape against its physical limit (vanilla's run measures it): DropKV
    # and SnapKV at one decode budget and allocation, an engine each
    **{f"reasoning-1k-4k-{budget}{'-adakv' if allocation == 'adakv' else ''}": _reasoning_plan(budget, allocation)
       for budget in (1024, 2048) for allocation in ("uniform", "adakv")},
    # the reasoning shape's physical limits alone (vanilla's step times, without vanilla's own 4K-token run):
    # the reference of a lease too short for both (H100 ~130 s)
    "reasoning-1k-4k-limit": [("vanilla", "limit", REASONING_ARGS + REASONING_LIMIT, 240)],
    # the same with speculation in both engines, DropKV at K_d 1024 only: vLLM's n-gram drafter, and an EAGLE draft
    # model with synthetic acceptance (GPU only) of 3 drafts, 2 drafts, 3 by batch size, or 3 with CUDA graphs up
    # to 1,024 tokens
    **{f"reasoning-1k-4k-1024-{name}": [
        ("vanilla", "decode", REASONING_ARGS + speculation, 300),
        ("evict", "decode", REASONING_ARGS + speculation + SYNCHRONOUS
         + _decode_configs({"policy": "dropkv", "decode_budget": 1024}), 240)]
       for name, speculation in (("ngram", NGRAM), ("eagle", EAGLE), ("eagle-2", EAGLE_TWO),
                                 ("eagle-by-batch", EAGLE_BY_BATCH), ("eagle-graphs", EAGLE + GRAPHS_1024))},
    # memory-bounded prefill on a pool capped at 64K tokens: vanilla against no / one-shot / block-wise KeyDiff
    # at 16K tokens per head, one request at a time (peak blocks, prefill time, longest servable prompt)
    "blockwise-memory-64k-pool": [
        ("vanilla", "memory", BLOCKWISE_POOL + ["--max-model-len", "65536"], 150),
        ("evict", "memory", BLOCKWISE_POOL + ["--max-model-len", "131072", "--allow-long-prompts",
                                              "--memory-budget", "16384", "--chunk-size", "512",
                                              "--eviction-options", '{"chunk_budget": 16384}'], 380)],
    # block-wise SnapKV at 10% of 32K with its default cuts (expected attention at 4x the budget) against one-shot
    # SnapKV and vanilla: prefill time and peak blocks, one request at a time
    "blockwise-two-stage-32k": [
        ("vanilla", "memory", ["--max-model-len", "33024", "--memory-lengths", "32768"], 150),
        ("evict", "memory", ["--max-model-len", "33024", "--memory-lengths", "32768", "--memory-policy", "snapkv",
                             "--memory-budget", "3277", "--chunk-size", "512"], 240)],
    # the most concurrent 64K requests on the whole GPU, block-wise KeyDiff at 0.25 in 512-token chunks
    "blockwise-capacity-64k": [
        ("vanilla", "capacity", ["--prompt-len", "65536", "--max-tokens", "4096", "--num-requests", "12",
                                 "--max-model-len", "69632"], 200),
        ("evict", "capacity", ["--prompt-len", "65536", "--max-tokens", "4096", "--max-model-len", "69632",
                               "--policy", "keydiff", "--capacity-configs", "0.25:uniform",
                               "--eviction-options", '{"chunked": true, "chunk_size": 512, "chunk_budget": 0.25}'],
         330)],
    "hybrid-gpt-oss-20b": _hybrid_plan(36, "16384:512:64", 420),
    "hybrid-gemma-3-12b": _hybrid_plan(24, "16384:512:32", 420),
    # Qwen3-Next without prefix caching, vLLM's default on linear-attention hybrids (an evicting request takes
    # no prefix hits there: every request computes its whole prompt). End to end and capacity are two plans,
    # each engine on a GPU of its own; capacity (some 10M prompt tokens for vllm-evict) is a count, measured
    # eager: without compilation and graph capture the engine starts in time to compute them
    "hybrid-qwen3-next": [(engine, "e2e", HYBRID_32K + ["--shapes", "16384:512:64", "--no-prefix-caching",
                                                         "--warm-up-load"], 480)
                          for engine in ("vanilla", "evict")],
    "hybrid-capacity-qwen3-next": [
        (engine, "capacity", HYBRID_32K + extra + ["--no-prefix-caching", "--enforce-eager"], 480)
        for engine, extra in (("vanilla", ["--num-requests", "72"]), ("evict", ["--capacity-configs", "0.1:uniform"]))],
    "hybrid-e2e-gpt-oss-20b": _hybrid_e2e_plan("16384:512:64", 270),
    # the same capacity with distinct prompts: a sliding-window group's blocks are then each request's own
    "hybrid-capacity-distinct-gpt-oss-20b": [("vanilla", "capacity", HYBRID_32K + ["--num-requests", "36"], 300),
                                             ("evict", "capacity", HYBRID_32K + ["--capacity-configs", "0.1:uniform"],
                                              480)],
    "hybrid-capacity-distinct-gemma-3-12b": [("vanilla", "capacity", HYBRID_32K + ["--num-requests", "24"], 300),
                                             ("evict", "capacity", HYBRID_32K + ["--capacity-configs", "0.1:uniform"],
                                              480)],
    "no-eviction-gpt-oss-20b": _no_eviction_plan(64),
    "no-eviction-gemma-3-12b": _no_eviction_plan(32),
    "no-eviction-qwen3-next": _no_eviction_plan(64, ("--no-prefix-caching",), 420),  # the evict engine starts in ~300 s
}
# the model config a plan runs (vllm_evict.testing.tiny_models.REAL_CONFIGS; default Llama-3.1-8B)
PLAN_MODELS = {"hybrid-gpt-oss-20b": "gpt-oss-20b", "hybrid-gemma-3-12b": "gemma-3-12b",
               "no-eviction-gpt-oss-20b": "gpt-oss-20b", "no-eviction-gemma-3-12b": "gemma-3-12b",
               "hybrid-capacity-distinct-gpt-oss-20b": "gpt-oss-20b",
               "hybrid-capacity-distinct-gemma-3-12b": "gemma-3-12b",
               "hybrid-qwen3-next": "qwen3-next-80b-a3b-64e", "hybrid-capacity-qwen3-next": "qwen3-next-80b-a3b-64e",
               "hybrid-e2e-gpt-oss-20b": "gpt-oss-20b", "no-eviction-qwen3-next": "qwen3-next-80b-a3b-64e"}


def vanilla_path() -> str:
    """PYTHONPATH of a vanilla run: only the staged vLLM bundle (/tmp/vsite on the device; empty on CPU,
    where vLLM comes from the venv and VLLM_PLUGINS=none keeps the installed plugin from loading)."""
    return os.pathsep.join(p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep)
                           if p and Path(p).name == "vsite")


def run_plan(args) -> int:
    passed = args.extra[1:] if args.extra[:1] == ["--"] else args.extra  # run --plan P ... -- --step-trace
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    combined = []
    import torch

    from vllm_evict.testing.tiny_models import tiny_eagle_draft, write_real_config

    config = PLAN_MODELS.get(args.plan, "llama-3.1-8b")
    target = write_real_config(config, Path(args.workdir)) if torch.cuda.is_available() else None
    model = ["--model", str(target)] if target else []
    for i, (engine, suite, extra, seconds) in enumerate(PLANS[args.plan]):
        if (args.engines and engine not in args.engines) or (args.entries and i not in args.entries):
            continue
        if target and any(EAGLE_DRAFT in arg for arg in extra):  # the draft's config, beside the target's
            draft = json.dumps(str(tiny_eagle_draft(target)))
            extra = [arg.replace(json.dumps(EAGLE_DRAFT), draft) for arg in extra]
        out = out_dir / f"{args.plan}_{i}_{engine}_{suite.replace(',', '-')}.json"
        # the engine's measurements end by its budget or the plan's (--stop-by), whichever comes first, and it
        # is killed only 30 s after that (time to write its result)
        stop_by = min(time.time() + seconds + 30, args.stop_by or float("inf"))
        if stop_by - time.time() < 60:
            print(f"-> {engine} skipped: {stop_by - time.time():.0f} s of the plan's budget left", flush=True)
            combined.append({"engine": engine, "suite": suite, "failed": "skipped: the plan's budget ran out"})
            continue
        cmd = [sys.executable, __file__, "one", "--engine", engine, "--suite", suite, "--out", str(out),
               "--time-limit", str(seconds - 60), "--stop-by", str(round(stop_by)), *model, *extra, *passed]
        print("$", f"PYTHONPATH={vanilla_path()} " * (engine == "vanilla") + " ".join(cmd), flush=True)
        t0 = time.time()
        env = dict(os.environ)
        if engine == "vanilla":  # stock vLLM: the vLLM bundle only, neither the plugin's dist-info nor this checkout
            env["PYTHONPATH"] = vanilla_path()
        try:
            rc = subprocess.run(cmd, timeout=stop_by + 30 - time.time(), env=env).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
        print(f"-> rc {rc} in {time.time() - t0:.0f} s", flush=True)
        combined.append(json.loads(out.read_text()) if out.exists() else {"engine": engine, "suite": suite,
                                                                             "failed": rc})
    (out_dir / f"{args.plan}.json").write_text(json.dumps(combined, indent=1))
    rows = against_limits(combined)
    if rows:
        (out_dir / f"{args.plan}_against_limits.json").write_text(json.dumps(rows, indent=1))
    print_against_limits(rows)
    return 0


def against_limits(results: list[dict]) -> list[dict]:
    """Each vllm-evict measurement of a plan next to the physical limit its vanilla engine measured: suite
    e2e (per shape and allocation) and suite decode against suite limit (per decode budget and interval).
    Only runs whose every request finished count: the wall time of a run cut at its deadline covers part of its load."""
    rows = []
    vanilla = [r for r in results if r.get("engine") == "vanilla"]
    evict = [r for r in results if r.get("engine") == "evict"]
    limits = {s["shape"]: s for r in vanilla for s in r.get("shapes", []) if s.get("limit_s")}
    for r in evict:
        for shape in r.get("shapes", []):
            base = limits.get(shape["shape"])
            if base is not None and finished(base["load"]) and finished(shape["load"]):
                rows.append(_against("e2e " + shape["shape"], shape.get("allocation"), base["load"]["wall_s"],
                                     base["limit_s"], shape["load"]["wall_s"]))
                # the limit with vanilla's own prefill phase of the run, whose prefill steps also decode the
                # requests admitted first (the prefill-only pass has no such rows; BENCHMARKS.md)
                mixed = round(base["load"]["wall_s"] - base["load"]["decode_s"]
                              + base["decode_at_evicted_kv"]["decode_s"], 2)
                rows[-1].update(limit_mixed_s=mixed, of_limit_mixed=round(mixed / shape["load"]["wall_s"], 3))
    decode_limits = {(row["decode_budget"], row["decode_every"]): (r["limit"]["shape"], row)
                     for r in vanilla if "limit" in r for row in r["limit"]["rows"] if row.get("complete")}
    for r in evict:
        for run in r.get("runs", []) if "decode" in r.get("suite", "").split(",") else []:
            config = run.get("eviction") or {}
            found = decode_limits.get((config.get("decode_budget"), config.get("decode_every", 128)))
            if found is not None and finished(run):
                shape, row = found
                rows.append(_against(f"decode {shape}, decode_budget {row['decode_budget']} every "
                                     f"{row['decode_every']}", config.get("allocation", "uniform"),
                                     row.get("vanilla_wall_s"), row["limit_s"], run["wall_s"]))
    return rows


def finished(load: dict) -> bool:
    return load.get("stop_reason") == "all requests finished"


def _against(what: str, allocation: str | None, vanilla_s: float | None, limit_s: float, evict_s: float) -> dict:
    return {"what": what, "allocation": allocation or "uniform", "vanilla_s": vanilla_s, "limit_s": limit_s,
            "evict_s": evict_s, "speedup": round(vanilla_s / evict_s, 2) if vanilla_s else None,
            "of_limit": round(limit_s / evict_s, 3)}


def print_against_limits(rows: list[dict]) -> None:
    if rows:
        print("\nvllm-evict against the physical limit (wall seconds):")
        for row in rows:
            print(f"  {row['what']} [{row['allocation']}]: vanilla {row['vanilla_s']}  limit {row['limit_s']}  "
                  f"vllm-evict {row['evict_s']}  ({row['of_limit']:.1%} of the limit"
                  + (f"; {row['of_limit_mixed']:.1%} with vanilla's own prefill phase, {row['limit_mixed_s']}"
                     if "of_limit_mixed" in row else "")
                  + (f"; {row['speedup']}x vanilla)" if row["speedup"] else ")"), flush=True)


def parse_capacity(values: list[str]) -> list[tuple[float, str]]:
    return [(float(v.split(":")[0]), v.split(":")[1]) for v in values]


def parse_ttft(values: list[str]) -> list[tuple[int, int]]:
    return [(int(v.split("x")[0]), int(v.split("x")[1])) for v in values]


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="run a plan: its engines one after another, vanilla first")
    r.add_argument("--plan", choices=sorted(PLANS), required=True)
    r.add_argument("--out-dir", required=True)
    r.add_argument("--workdir", default="/tmp/vllm-evict-bench", help="where the GPU model config is written")
    r.add_argument("--engines", nargs="+", choices=["vanilla", "evict"], default=None,
                   help="run only these engines of the plan (e.g. one per GPU, side by side)")
    r.add_argument("--entries", nargs="+", type=int, default=None,
                   help="run only these entries of the plan, by position (0: the first engine run)")
    r.add_argument("--stop-by", type=float, default=None,
                   help="epoch seconds by which every engine of the plan has ended its measurements")
    r.add_argument("extra", nargs=argparse.REMAINDER, help="passed to every engine run")
    o = sub.add_parser("one", help="one engine, one suite")
    o.add_argument("--engine", choices=["vanilla", "evict"], required=True)
    o.add_argument("--suite", required=True, help=f"one of {sorted(SUITES)}, or several joined by commas")
    o.add_argument("--out", required=True)
    o.add_argument("--workdir", default="/tmp/vllm-evict-bench")
    o.add_argument("--model", default=None, help="GPU: the model config directory (default: written to --workdir)")
    o.add_argument("--policy", default="dropkv")
    o.add_argument("--budget", type=float, default=0.1)
    o.add_argument("--allocation", default="uniform", help="suite e2e: several joined by commas (a run each)")
    o.add_argument("--eviction-options", type=json.loads, default={},
                   help='more fields of the eviction object, as JSON: \'{"chunked": true, "chunk_size": 512}\'')
    o.add_argument("--decode-configs", nargs="+", type=json.loads, default=[],
                   help="suite decode: eviction objects as JSON, one run each; suite limit (vanilla): one limit "
                        "per distinct decode_budget / decode_every among them")
    o.add_argument("--limit-bin", type=int, default=32, help="suite limit: KV tokens per bin of the step-time curve")
    o.add_argument("--prompt-len", type=int, default=32768)
    o.add_argument("--max-tokens", type=int, default=512)
    o.add_argument("--num-requests", type=int, default=64,
                   help="suite load: 0 = as many as the KV pool holds at once at this shape (fit_requests)")
    o.add_argument("--shared-prefix", action="store_true")
    o.add_argument("--shared-tail", type=int, default=64, help="distinct tokens at the end of a shared-prefix prompt")
    o.add_argument("--no-prefix-caching", dest="prefix_caching", action="store_false",
                   help="vLLM's --no-enable-prefix-caching (its default on linear-attention hybrids)")
    o.add_argument("--enforce-eager", action="store_true",
                   help="vLLM's --enforce-eager: no compilation or CUDA graphs, for counts (capacity) not times")
    o.add_argument("--stall-steps", type=int, default=20)
    o.add_argument("--capacity-configs", nargs="+", type=str, default=["0.1:uniform"])
    o.add_argument("--ttft-cases", nargs="*", default=["8192x1", "32768x1", "65536x1", "8192x8", "32768x8"],
                   help="LENxBATCH")
    o.add_argument("--repeats", type=int, default=2)
    o.add_argument("--decode-batches", nargs="+", type=int, default=[8, 64])
    o.add_argument("--kv-len", type=int, default=2048)
    o.add_argument("--decode-budget", type=float, default=0.25)
    o.add_argument("--decode-steps", type=int, default=64)
    o.add_argument("--decode-allocations", nargs="+", default=["uniform"])
    o.add_argument("--shapes", nargs="+", default=["32768:256:8"], help="LEN:OUT:N (suite e2e)")
    o.add_argument("--prefill-shapes", nargs="+", default=["8192:32"], help="LEN:N (suite prefill)")
    o.add_argument("--prefill-policies", nargs="+", default=["dropkv:uniform"], help="NAME:ALLOCATION")
    o.add_argument("--ttft-lengths", nargs="*", type=int, default=[8192, 32768])
    o.add_argument("--max-model-len", type=int, default=66048)
    o.add_argument("--max-num-seqs", type=int, default=512)
    o.add_argument("--max-num-batched-tokens", type=int, default=16384)
    o.add_argument("--tensor-parallel-size", type=int, default=1, help="GPUs (CPU: worker processes) per stage")
    o.add_argument("--pipeline-parallel-size", type=int, default=1, help="pipeline stages (GPUs of their own)")
    o.add_argument("--distributed-executor-backend", choices=["mp", "ray"], default="mp",
                   help="vLLM's executor of the workers when there are several (ray: GPU only)")
    o.add_argument("--speculative-config", type=json.loads, default=None,
                   help="vLLM's speculative_config as JSON, e.g. '{\"method\": \"ngram\", ...}'")
    o.add_argument("--no-async-scheduling", action="store_true",
                   help="vLLM's --no-async-scheduling (decode budgets with speculative decoding need it: the engine "
                        "refuses them under asynchronous scheduling)")
    o.add_argument("--max-cudagraph-capture-size", type=int, default=None,
                   help="GPU: vLLM's compilation_config.max_cudagraph_capture_size (tokens; vLLM's default 512), "
                        "so that speculative steps of many requests (requests x (drafts + 1) tokens) replay graphs")
    o.add_argument("--kv-cache-dtype", default="auto",
                   help="GPU: vLLM's --kv-cache-dtype (auto, fp8, int8_per_token_head, ...)")
    o.add_argument("--kv-cache-memory-bytes", type=int, default=None,
                   help="KV pool size (CPU default 256 MiB; GPU default: vLLM's, from --gpu-memory-utilization 0.9)")
    o.add_argument("--allow-long-prompts", action="store_true", help="evict engine: --max-model-len may exceed the pool")
    o.add_argument("--memory-lengths", nargs="+", type=int, default=[32768, 65536, 131072])
    o.add_argument("--memory-budget", type=int, default=16384, help="tokens per head (suite memory)")
    o.add_argument("--memory-policy", default="keydiff", help="suite memory: the policy, one-shot and block-wise")
    o.add_argument("--chunk-size", type=int, default=512, help="block-wise chunk (suite memory)")
    o.add_argument("--time-limit", type=float, default=540)
    o.add_argument("--stop-by", type=float, default=None,
                   help="epoch seconds by which the measurements end, however long the engine took to start (run: "
                        "the plan's budget less the time to write the result, before its engine is killed)")
    o.add_argument("--seed", type=int, default=0)
    o.add_argument("--warm-up-load", action="store_true",
                   help="suite e2e: run each shape's load once untimed before the measured one")
    o.add_argument("--step-trace", action="store_true",
                   help="record every step of a load as [ms, scheduled tokens, scheduled requests, decode-only, "
                        "host ms in schedule, execute_model and update_from_output, requests compacted, "
                        "attention (0: stock, 1: stock staging the queries, 2: per head) (these two: vllm-evict "
                        "only), ms in this process's Python garbage collector since the step before]")
    return ap


def main() -> int:
    ap = build_parser()
    args = ap.parse_args()
    if args.cmd == "run":
        return run_plan(args)
    args.capacity_configs = parse_capacity(args.capacity_configs)
    args.ttft_cases = parse_ttft(args.ttft_cases)
    args.shapes = [tuple(int(x) for x in v.split(":")) for v in args.shapes]
    args.prefill_shapes = [tuple(int(x) for x in v.split(":")) for v in args.prefill_shapes]
    if args.shared_prefix and args.engine == "vanilla":
        ap.error("--shared-prefix is for the evict engine only (shared blocks would inflate vanilla capacity)")
    if args.shared_prefix and not 0 < args.shared_tail < args.prompt_len:
        ap.error(f"--shared-tail must be within the prompt (1 to {args.prompt_len - 1} tokens)")
    if args.allow_long_prompts and args.engine == "vanilla":
        ap.error("--allow-long-prompts is for the evict engine only (stock vLLM refuses it)")
    result = run_one(args)
    Path(args.out).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
