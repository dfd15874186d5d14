"""`vllm-evict eval`: RULER-style quality evaluation of every policy x allocation x budget (see docs/QUALITY.md)."""

from __future__ import annotations

import argparse
from typing import Any

from vllm_evict.bench.eval import (
    ALL_POLICIES, ALLOCATIONS, BUDGETS, CORE_POLICIES, DEFAULT_OUT, EvalConfig, run_eval,
)
from vllm_evict.bench.ruler import DEFAULT_DEPTHS, TASKS, VARIANTS


def _policies(values: list[str]) -> list[str]:
    out: list[str] = []
    for v in values:
        if v == "all":
            out += list(ALL_POLICIES)
        elif v == "core":
            out += list(CORE_POLICIES)
        else:
            out.append(v)
    return list(dict.fromkeys(out))


def _shard(value: str) -> tuple[int, int]:
    try:
        k, n = value.split("/")
        return int(k), int(n)
    except ValueError:
        raise argparse.ArgumentTypeError(f"want k/n (e.g. 0/4), got {value!r}") from None


def config_from_args(args: argparse.Namespace) -> EvalConfig:
    return EvalConfig(
        model=args.model, tasks=list(args.tasks), lengths=list(args.lengths), samples=args.samples,
        variants=list(args.variants), policies=_policies(args.policies), allocations=list(args.allocations),
        budgets=list(args.budgets), depths=list(args.depths), seed=args.seed, out_dir=args.out, name=args.name,
        dtype=args.dtype, max_model_len=args.max_model_len, kv_cache_memory_bytes=args.kv_cache_memory_bytes,
        kv_cache_dtype=args.kv_cache_dtype,
        gpu_memory_utilization=args.gpu_memory_utilization, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens, block_size=args.block_size,
        enable_prefix_caching=not args.no_prefix_caching, chunk_samples=args.chunk_samples,
        enforce_eager=args.enforce_eager,
        save_predictions=not args.no_predictions, resume=args.resume, plot=not args.no_plot,
        stop_after=args.stop_after, report_only=args.report_only, shard=args.shard,
    )


def _cmd_eval(args: argparse.Namespace) -> int:
    cfg = config_from_args(args)
    try:
        cfg.validate()
    except ValueError as exc:
        raise SystemExit(f"vllm-evict eval: error: {exc}")
    result = run_eval(cfg)
    if not result.complete:
        print("incomplete: run the same command with --resume to finish", flush=True)
        return 3
    return 0


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "eval", help="RULER-style quality evaluation through the vLLM engine with eviction",
        description=__doc__ + " Writes CSV/JSON/Markdown/PNG into --out and prints the reproducing command.",
    )
    p.add_argument("--model", default=None, help="HF model directory (default: prepare-model's SmolLM2)")
    p.add_argument("--tasks", nargs="+", default=list(TASKS), choices=list(TASKS), metavar="TASK",
                   help=f"tasks (default: all): {' '.join(TASKS)}")
    p.add_argument("--lengths", nargs="+", type=int, default=[1024, 2048, 4096], metavar="N",
                   help="prompt lengths in tokens (default: 1024 2048 4096; add 8192 on GPU)")
    p.add_argument("--samples", type=int, default=10, help="samples per task x length (default 10)")
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS),
                   help="question-aware and/or question-agnostic (default: both)")
    p.add_argument("--policies", nargs="+", default=list(CORE_POLICIES), metavar="POLICY",
                   help=f"policies, or 'core' / 'all' (default core: {' '.join(CORE_POLICIES)}; "
                        f"all adds {' '.join(p for p in ALL_POLICIES if p not in CORE_POLICIES)}); a policy "
                        f"may carry request overrides, e.g. snapkv:window=8,pool_kernel=11")
    p.add_argument("--allocations", nargs="+", default=list(ALLOCATIONS), choices=list(ALLOCATIONS))
    p.add_argument("--budgets", nargs="+", type=float, default=list(BUDGETS), metavar="B",
                   help="keep ratios in (0,1]; 1.0 = full-cache baseline (default: 0.05 0.1 0.2 0.4 1.0)")
    p.add_argument("--depths", nargs="+", type=float, default=list(DEFAULT_DEPTHS), metavar="D",
                   help="needle depths of passkey / niah_single, cycled over samples")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=DEFAULT_OUT, help=f"output directory (default {DEFAULT_OUT})")
    p.add_argument("--name", default="ruler", help="file name stem of the outputs (default ruler)")
    p.add_argument("--dtype", default=None, help="model dtype (default float32 on CPU, bfloat16 on GPU)")
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--kv-cache-memory-bytes", type=int, default=None, help="default 1 GiB on CPU")
    p.add_argument("--kv-cache-dtype", default=None,
                   help="vLLM's KV cache dtype (default: vLLM's, the model dtype; 'fp8' on CUDA). Give a "
                        "run with another cache dtype its own --name: --resume reuses records by prompt, not by "
                        "engine")
    p.add_argument("--gpu-memory-utilization", type=float, default=None)
    p.add_argument("--max-num-seqs", type=int, default=None)
    p.add_argument("--max-num-batched-tokens", type=int, default=None)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--no-prefix-caching", action="store_true",
                   help="disable vLLM prefix caching (default on: requests are sent sample-major, so every "
                        "setting after the first re-prefills only the last window of each prompt)")
    p.add_argument("--chunk-samples", type=int, default=0,
                   help="samples per generate call, all settings of a sample together "
                        "(default 0: one call per task x length)")
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument("--no-predictions", action="store_true", help="do not store generated texts per request")
    p.add_argument("--resume", action="store_true",
                   help="reuse settings already in <out>/<name>_requests.jsonl.gz (same samples)")
    p.add_argument("--stop-after", type=float, default=None, metavar="SECONDS",
                   help="start no new generate call after this many seconds and write partial outputs; "
                        "finish later with the same command plus --resume (for time-limited machines)")
    p.add_argument("--report-only", action="store_true",
                   help="no engine: rebuild CSV/JSON/Markdown/PNG from <out>/<name>_requests.jsonl.gz "
                        "(keeps the original run's environment, probe and timings)")
    p.add_argument("--shard", type=_shard, default=None, metavar="K/N",
                   help="run only sample indices i with i %% N == K, writing <name>.shardKofN* files; start N "
                        "such engines in parallel on one GPU, then merge with "
                        "the same command without --shard plus --resume or --report-only")
    p.add_argument("--no-plot", action="store_true")
    p.set_defaults(func=_cmd_eval)
