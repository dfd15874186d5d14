"""Quality evaluation of eviction policies on RULER-style tasks through the real vLLM engine.

For every (variant, policy, allocation, budget) *setting* the same samples (tasks x lengths x n) are sent
in one ``llm.generate`` call, each request carrying
``SamplingParams.extra_args["vllm_evict"] = {"policy", "budget", "allocation"[, "evict_at"]}``:

* budget 1.0 is the full-cache baseline, run once (no eviction parameters at all) and shared by both
  variants (the token sequences are identical);
* ``streaming`` ignores ``adakv`` (DESIGN.md §3.4), so only its uniform setting is run;
* ``aware`` evicts at the end of the prompt; ``agnostic`` asks the engine to evict after the context,
  ``evict_at = n_context`` prompt tokens, and the question is prefilled against the compressed cache.
  If the engine rejects ``evict_at`` (or accepts it without confirming it in the eviction report), the
  agnostic variant is skipped with a message and marked ``skipped`` in the tables.

Outputs (``out_dir``, default docs/quality/): ``<name>.csv`` (one row per task x length x setting),
``<name>_summary.csv`` (mean over tasks and lengths per setting), ``<name>.md`` (tables),
``<name>.json`` (config, exact command, environment, engine probe, all rows), ``<name>.png`` (accuracy vs
budget per policy) and ``<name>_requests.jsonl.gz`` (one line per request; appended per setting, read
back by ``--resume``). This module runs the requests; bench/report.py aggregates and writes the tables and
the plot.
"""

from __future__ import annotations

import datetime as _dt
import gzip
import json
import math
import shlex
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Sequence

from vllm_evict.bench.report import (
    FULL, _environment, _fmt_budget, _mean, _samples_text, _write_csv, aggregate, markdown_tables, plot,
)
from vllm_evict.bench.ruler import DEFAULT_DEPTHS, TASKS, VARIANTS, Sample, generate_samples
from vllm_evict.engine.request_config import EXTRA_ARGS_KEY
from vllm_evict.policies import ALLOCATIONS, POLICIES

BUDGETS = (0.05, 0.1, 0.2, 0.4, 1.0)
# The quality table's default set; "all" is every registered policy.
CORE_POLICIES = ("snapkv", "dropkv", "keydiff", "obcache-value", "obcache-key", "obcache-joint",
                 "caote", "fastcaote", "streaming")
ALL_POLICIES = tuple(POLICIES)
UNIFORM_ONLY = tuple(name for name, policy in POLICIES.items() if not policy.supports_adakv)


def parse_policy(name: str) -> tuple[str, dict[str, Any]]:
    """``"snapkv:window=8,pool_kernel=11"`` -> ``("snapkv", {"window": 8, "pool_kernel": 11})``.

    Options are DESIGN.md §6 request fields (window, pool_kernel, sink, gqa, alpha, caote_base, chunked, and
    the block-wise chunk_size, chunk_policy, chunk_budget: "2x" is twice each setting's budget); values are
    parsed as int, float, true/false, else kept as strings.
    """
    base, _, opts = name.partition(":")
    options: dict[str, Any] = {}
    for item in filter(None, opts.split(",")):
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ValueError(f"bad policy option {item!r} in {name!r} (want key=value)")
        value: Any = raw
        if raw.lower() in ("true", "false"):
            value = raw.lower() == "true"
        else:
            for conv in (int, float):
                try:
                    value = conv(raw)
                    break
                except ValueError:
                    pass
        options[key] = value
    return base, options
DEFAULT_OUT = "docs/quality"


# ----------------------------------------------------------------------------- configuration


@dataclass
class EvalConfig:
    model: str | None = None                 # None: vllm_evict.models.prepare_smollm2()
    tasks: list[str] = field(default_factory=lambda: list(TASKS))
    lengths: list[int] = field(default_factory=lambda: [1024, 2048, 4096])
    samples: int = 10                         # per task x length
    variants: list[str] = field(default_factory=lambda: list(VARIANTS))
    policies: list[str] = field(default_factory=lambda: list(CORE_POLICIES))
    allocations: list[str] = field(default_factory=lambda: list(ALLOCATIONS))
    budgets: list[float] = field(default_factory=lambda: list(BUDGETS))
    depths: list[float] = field(default_factory=lambda: list(DEFAULT_DEPTHS))
    seed: int = 0
    out_dir: str = DEFAULT_OUT
    name: str = "ruler"
    dtype: str | None = None                  # None: float32 on CPU, bfloat16 on GPU
    max_model_len: int | None = None          # None: longest prompt + longest answer, rounded up
    kv_cache_memory_bytes: int | None = None  # None: 1 GiB on CPU, vLLM's default on GPU
    kv_cache_dtype: str | None = None         # None: vLLM's default ("auto": the model dtype); "fp8" on CUDA
    gpu_memory_utilization: float | None = None
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    block_size: int = 16
    enable_prefix_caching: bool = True       # evicting requests re-prefill only from E - w (engine caps hits)
    chunk_samples: int = 0                    # samples per generate call (0: one (task, length) group)
    enforce_eager: bool = False
    save_predictions: bool = True
    resume: bool = False
    plot: bool = True
    stop_after: float | None = None           # seconds: start no new generate call after this (then --resume)
    report_only: bool = False                 # rebuild the tables from <name>_requests.jsonl.gz, no engine
    shard: tuple[int, int] | None = None      # (k, n): run only sample indices i % n == k (parallel engines)

    def validate(self) -> None:
        bad = [t for t in self.tasks if t not in TASKS]
        if bad:
            raise ValueError(f"unknown task(s) {bad}; choose from {list(TASKS)}")
        bad = [v for v in self.variants if v not in VARIANTS]
        if bad:
            raise ValueError(f"unknown variant(s) {bad}; choose from {list(VARIANTS)}")
        bad = [a for a in self.allocations if a not in ALLOCATIONS]
        if bad:
            raise ValueError(f"unknown allocation(s) {bad}; choose from {list(ALLOCATIONS)}")
        bad = [p for p in self.policies if parse_policy(p)[0] not in ALL_POLICIES]
        if bad:
            raise ValueError(f"unknown policy(ies) {bad}; choose from {list(ALL_POLICIES)} "
                             f"(optionally with overrides, e.g. snapkv:window=8,pool_kernel=11)")
        bad = [b for b in self.budgets if not (0.0 < b <= 1.0)]
        if bad:
            raise ValueError(f"budgets must be keep ratios in (0, 1], got {bad}")
        if self.samples < 1 or not self.lengths or not self.tasks or not self.variants:
            raise ValueError("need at least one sample, length, task and variant")
        if self.shard is not None:
            k, n = self.shard
            if not 0 <= k < n:
                raise ValueError(f"shard must be k/n with 0 <= k < n, got {k}/{n}")
            if self.report_only:
                raise ValueError("--report-only merges all shards: do not combine it with --shard")

    def command(self) -> str:
        """The exact `vllm-evict eval` command line that reproduces this run."""
        args = ["vllm-evict", "eval"]
        if self.model:
            args += ["--model", self.model]
        args += ["--tasks", *self.tasks, "--lengths", *map(str, self.lengths), "--samples", str(self.samples),
                 "--variants", *self.variants, "--policies", *self.policies,
                 "--allocations", *self.allocations, "--budgets", *map(_fmt_budget, self.budgets),
                 "--depths", *map(str, self.depths), "--seed", str(self.seed),
                 "--out", self.out_dir, "--name", self.name]
        for opt in ("dtype", "max_model_len", "kv_cache_memory_bytes", "kv_cache_dtype", "gpu_memory_utilization",
                    "max_num_seqs", "max_num_batched_tokens"):
            value = getattr(self, opt)
            if value is not None:
                args += ["--" + opt.replace("_", "-"), str(value)]
        if self.block_size != 16:
            args += ["--block-size", str(self.block_size)]
        if not self.enable_prefix_caching:
            args.append("--no-prefix-caching")
        if self.chunk_samples:
            args += ["--chunk-samples", str(self.chunk_samples)]
        if self.enforce_eager:
            args.append("--enforce-eager")
        if not self.save_predictions:
            args.append("--no-predictions")
        if not self.plot:
            args.append("--no-plot")
        if self.shard is not None:
            args += ["--shard", "/".join(map(str, self.shard))]
        return shlex.join(args)


@dataclass(frozen=True)
class Setting:
    variant: str
    policy: str
    allocation: str
    budget: float

    @property
    def key(self) -> str:
        return f"{self.variant}|{self.policy}|{self.allocation}|{_fmt_budget(self.budget)}"

    @property
    def is_full(self) -> bool:
        return self.policy == FULL

    def eviction(self, sample: Sample) -> dict[str, Any] | None:
        if self.is_full:
            return None
        base, options = parse_policy(self.policy)
        spec: dict[str, Any] = {"policy": base, "budget": float(self.budget), "allocation": self.allocation}
        spec.update(options)
        chunk_budget = spec.get("chunk_budget")
        if isinstance(chunk_budget, str) and chunk_budget.endswith("x"):  # a multiple of the setting's budget
            spec["chunk_budget"] = min(1.0, float(chunk_budget[:-1]) * float(self.budget))
        if self.variant == "agnostic":
            spec["evict_at"] = sample.n_context
        return spec


def make_settings(cfg: EvalConfig) -> list[Setting]:
    """Full-cache baseline first (once, variant "both"), then every variant x policy x allocation x budget<1."""
    settings: list[Setting] = []
    if any(b >= 1.0 for b in cfg.budgets):
        settings.append(Setting("both", FULL, "-", 1.0))
    for variant in cfg.variants:
        for policy in cfg.policies:
            for allocation in cfg.allocations:
                if parse_policy(policy)[0] in UNIFORM_ONLY and allocation != "uniform":
                    if "uniform" in cfg.allocations:
                        continue
                    allocation = "uniform"
                for budget in cfg.budgets:
                    if budget < 1.0:
                        settings.append(Setting(variant, policy, allocation, float(budget)))
    return list(dict.fromkeys(settings))


# ----------------------------------------------------------------------------- engine


def _on_gpu() -> bool:
    try:
        import torch

        return bool(torch.cuda.is_available())
    except Exception:  # pragma: no cover
        return False


def engine_arguments(cfg: EvalConfig, model_dir: str, samples: Sequence[Sample]) -> dict[str, Any]:
    gpu = _on_gpu()
    longest = max(s.n_prompt + s.max_tokens for s in samples)
    max_len = cfg.max_model_len or int(math.ceil((longest + 16) / 256) * 256)
    kwargs: dict[str, Any] = dict(
        model=model_dir,
        dtype=cfg.dtype or ("bfloat16" if gpu else "float32"),
        block_size=cfg.block_size,
        max_model_len=max_len,
        enable_prefix_caching=cfg.enable_prefix_caching,
        seed=cfg.seed,
    )
    kv = cfg.kv_cache_memory_bytes if cfg.kv_cache_memory_bytes is not None else (None if gpu else 1 << 30)
    if kv is not None:
        kwargs["kv_cache_memory_bytes"] = int(kv)
    for opt in ("kv_cache_dtype", "gpu_memory_utilization", "max_num_seqs", "max_num_batched_tokens"):
        if getattr(cfg, opt) is not None:
            kwargs[opt] = getattr(cfg, opt)
    if cfg.enforce_eager:
        kwargs["enforce_eager"] = True
    return kwargs


def _report(output: Any) -> dict[str, Any] | None:
    try:
        from vllm_evict.engine import eviction_report
    except ImportError:  # pragma: no cover
        return None
    return eviction_report(output)


def _validate_spec(spec: dict[str, Any]) -> str | None:
    """None if the plugin's own request parser accepts ``spec``, else its error (best effort)."""
    try:
        from vllm_evict.engine.request_config import parse_request
    except Exception:
        try:
            from vllm_evict.policies import EvictionConfig
        except Exception:
            return None
        try:
            EvictionConfig.from_dict(spec)
        except ValueError as exc:
            return str(exc)
        return None
    try:
        parse_request({EXTRA_ARGS_KEY: spec})
    except ValueError as exc:
        return str(exc)
    return None


@dataclass
class EngineProbe:
    eviction_active: bool = False
    evict_at_supported: bool = False
    messages: list[str] = field(default_factory=list)


def probe_engine(llm: Any, probe: Sample, log) -> EngineProbe:
    """Does the engine evict, and does it honour ``evict_at`` (the question-agnostic protocol)?"""
    from vllm import SamplingParams

    result = EngineProbe()
    prompt = {"prompt_token_ids": probe.prompt_ids}
    spec = {"policy": "snapkv", "budget": 0.25, "allocation": "uniform"}
    try:
        out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=2, extra_args={EXTRA_ARGS_KEY: spec}),
                           use_tqdm=False)[0]
        report = _report(out)
    except Exception as exc:  # noqa: BLE001
        report = None
        result.messages.append(f"eviction request failed: {type(exc).__name__}: {exc}")
    result.eviction_active = report is not None
    if not result.eviction_active:
        result.messages.append(
            "the engine returned no eviction report for a request that must evict (snapkv, budget 0.25): "
            "eviction is NOT active, every setting runs with the full cache (status 'no-eviction')"
        )
    spec_at = dict(spec, evict_at=probe.n_context)
    error = _validate_spec(spec_at)
    if error:
        result.messages.append(f"the engine rejects evict_at ({error}): question-agnostic variant skipped")
        return result
    try:
        out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=2,
                                                    extra_args={EXTRA_ARGS_KEY: spec_at}), use_tqdm=False)[0]
        report = _report(out)
    except Exception as exc:  # noqa: BLE001
        result.messages.append(
            f"the engine rejects evict_at ({type(exc).__name__}: {exc}): question-agnostic variant skipped")
        return result
    if not result.eviction_active:
        result.evict_at_supported = True  # nothing evicts anyway: agnostic == aware == full cache
        return result
    confirmed = report is not None and (
        report.get("evicted_prefix_tokens") == probe.n_context or report.get("evict_at") == probe.n_context)
    if not confirmed:
        result.messages.append(
            f"the engine accepted evict_at={probe.n_context} but its eviction report does not confirm it "
            f"({report}): question-agnostic variant skipped")
        return result
    result.evict_at_supported = True
    return result


# ----------------------------------------------------------------------------- running


def _kept_fraction(report: dict[str, Any] | None) -> float | None:
    if not report:
        return None
    kept = report.get("kept_tokens_per_head")
    base = report.get("evicted_prefix_tokens") or report.get("prompt_tokens")
    if kept is None or not base:
        return None
    return float(kept) / float(base)


def run_requests(llm: Any, pairs: Sequence[tuple[Setting, Sample]], save_predictions: bool) -> list[dict[str, Any]]:
    """One ``llm.generate`` call for all (setting, sample) pairs; one record per request."""
    from vllm import SamplingParams

    prompts, params = [], []
    for setting, s in pairs:
        spec = setting.eviction(s)
        extra = {EXTRA_ARGS_KEY: spec} if spec is not None else None
        prompts.append({"prompt_token_ids": s.prompt_ids})
        params.append(SamplingParams(temperature=0, max_tokens=s.max_tokens, extra_args=extra))
    outputs = llm.generate(prompts, params, use_tqdm=False)
    records = []
    for (setting, s), out in zip(pairs, outputs):
        text = out.outputs[0].text
        report = _report(out)
        rec = {
            "setting": setting.key, "variant": setting.variant, "policy": setting.policy,
            "allocation": setting.allocation, "budget": setting.budget, "uid": s.uid, "task": s.task,
            "length": s.length, "index": s.index, "n_prompt": s.n_prompt, "n_context": s.n_context,
            "depth": s.depth, "prompt_sha": _fingerprint(s), "score": s.score(text), "evicted": report is not None,
            "kept_fraction": _kept_fraction(report),
            "blocks_freed": (report or {}).get("blocks_freed"),
        }
        if save_predictions:
            rec["prediction"] = text
            rec["answers"] = s.answers
        records.append(rec)
    return records


def _fingerprint(sample: Sample) -> str:
    import hashlib

    return hashlib.sha1(json.dumps([sample.uid, sample.prompt_ids, sample.answers]).encode()).hexdigest()[:16]


def _chunks(samples: Sequence[Sample], size: int, stride: int = 1) -> list[list[Sample]]:
    """Samples per generate call.

    ``size`` 0: one call per (task, length). ``size`` k > 0: k sample indices of EVERY task and length per
    call ([0, k), [k, 2k), ...; a shard that holds every ``stride``-th index takes k of its own), so a run
    stopped early (``stop_after``) still has every cell, with fewer samples.
    """
    if size <= 0:
        groups: dict[tuple[str, int], list[Sample]] = {}
        for s in samples:
            groups.setdefault((s.task, s.length), []).append(s)
        return list(groups.values())
    blocks: dict[int, list[Sample]] = {}
    for s in samples:
        blocks.setdefault(s.index // (size * stride), []).append(s)
    return [blocks[k] for k in sorted(blocks)]


def _where(chunk: Sequence[Sample]) -> str:
    tasks = sorted({s.task for s in chunk})
    lengths = sorted({s.length for s in chunk})
    idx = sorted({s.index for s in chunk})
    what = tasks[0] if len(tasks) == 1 else f"{len(tasks)} tasks"
    return f"{what}@{','.join(map(str, lengths))}#{idx[0]}-{idx[-1]}"


def _read_records(path: Path) -> list[dict[str, Any]]:
    records: list[dict[str, Any]] = []
    if not path.exists():
        return records
    with gzip.open(path, "rt") as f:
        try:
            for line in f:
                records.append(json.loads(line))
        except (ValueError, EOFError):
            pass  # truncated tail of an interrupted run
    return records


def _load_done(*paths: Path) -> dict[str, list[dict[str, Any]]]:
    done: dict[str, list[dict[str, Any]]] = {}
    seen: set[tuple[str, str]] = set()
    for path in paths:
        for rec in _read_records(path):
            if (rec["setting"], rec["uid"]) not in seen:
                seen.add((rec["setting"], rec["uid"]))
                done.setdefault(rec["setting"], []).append(rec)
    return done


def _shard_stem(name: str, shard: tuple[int, int]) -> str:
    return f"{name}.shard{shard[0]}of{shard[1]}"


def _requests_path(out_dir: Path, name: str, shard: tuple[int, int] | None) -> Path:
    return out_dir / f"{_shard_stem(name, shard) if shard else name}_requests.jsonl.gz"


def _merge_probes(probes: Sequence[dict[str, Any]]) -> dict[str, Any]:
    return {"eviction_active": all(p["eviction_active"] for p in probes),
            "evict_at_supported": all(p["evict_at_supported"] for p in probes),
            "messages": list(dict.fromkeys(m for p in probes for m in p["messages"]))}


def merge_shards(out_dir: Path, name: str, log) -> int:
    """Fold the files of shard runs (``--shard k/n``) into ``<name>_requests.jsonl.gz`` / ``<name>.json``
    and delete them. Shards ran in parallel: their wall time counts once (the longest). Returns the
    number of records added."""
    metas = sorted(out_dir.glob(f"{name}.shard*of*.json"))
    shard_reqs = sorted(out_dir.glob(f"{name}.shard*of*_requests.jsonl.gz"))
    if not metas and not shard_reqs:
        return 0
    main = _requests_path(out_dir, name, None)
    have = {(r["setting"], r["uid"]) for r in _read_records(main)}
    added = 0
    with gzip.open(main, "at") as f:
        for path in shard_reqs:
            for rec in _read_records(path):
                if (rec["setting"], rec["uid"]) not in have:
                    have.add((rec["setting"], rec["uid"]))
                    f.write(json.dumps(rec) + "\n")
                    added += 1
    if metas:
        main_json = out_dir / f"{name}.json"
        base = json.loads(main_json.read_text()) if main_json.exists() else {}
        shards = [json.loads(p.read_text()) for p in metas]
        for key in ("environment", "engine_args", "model_dir", "date"):
            base.setdefault(key, shards[0][key])
        base["probe"] = _merge_probes(([base["probe"]] if "probe" in base else []) + [m["probe"] for m in shards])
        base["generate_calls"] = base.get("generate_calls", []) + [c for m in shards for c in m["generate_calls"]]
        base["wall_seconds"] = base.get("wall_seconds", 0) + max(m["wall_seconds"] for m in shards)
        main_json.write_text(json.dumps(base, indent=1, default=str) + "\n")
    for path in metas + shard_reqs:
        path.unlink()
    log(f"merged {len(shard_reqs)} shard request file(s): {added} new records")
    return added


# ----------------------------------------------------------------------------- main entry


@dataclass
class EvalResult:
    rows: list[dict[str, Any]]
    summary: list[dict[str, Any]]
    probe: EngineProbe
    files: dict[str, str]
    command: str
    skipped: dict[str, str]
    complete: bool = True


def _finish_shard(cfg: EvalConfig, out_dir: Path, command: str, probe: EngineProbe, engine_args: dict[str, Any],
                  model_dir: str, timings: list[dict[str, Any]], skipped: dict[str, str], wall: float,
                  complete: bool, log) -> EvalResult:
    """A shard writes its requests and the fields of `<name>.json` that `merge_shards` folds in; tables come
    from the merging run."""
    meta = {"probe": asdict(probe), "engine_args": engine_args, "model_dir": model_dir,
            "environment": _environment(model_dir), "generate_calls": timings, "wall_seconds": round(wall, 1),
            "date": _dt.datetime.now(_dt.timezone.utc).isoformat()}
    meta_path = out_dir / f"{_shard_stem(cfg.name, cfg.shard)}.json"
    meta_path.write_text(json.dumps(meta, indent=1, default=str) + "\n")
    log(f"shard {cfg.shard[0]}/{cfg.shard[1]} wrote {meta_path}; merge with the same command, "
        f"without --shard, plus --resume or --report-only")
    files = {"json": str(meta_path), "requests": str(_requests_path(out_dir, cfg.name, cfg.shard))}
    return EvalResult(rows=[], summary=[], probe=probe, files=files, command=command, skipped=skipped,
                      complete=complete)


def run_eval(cfg: EvalConfig, llm: Any = None, log=None) -> EvalResult:
    """Run the evaluation described by ``cfg`` (starts one engine unless ``llm`` is given)."""
    from tqdm.auto import tqdm
    from transformers import AutoTokenizer

    def _log(msg: str) -> None:
        (log or (lambda m: print(m, file=sys.stderr, flush=True)))(f"[eval] {msg}")

    cfg.validate()
    t_start = time.time()
    command = cfg.command()
    _log(f"reproduce with: {command}")
    if cfg.model and (Path(cfg.model).is_dir() or not cfg.report_only):
        model_dir = cfg.model
    else:  # report-only of a run made elsewhere: the same tokenizer from the local copy
        from vllm_evict.models import prepare_smollm2

        model_dir = str(prepare_smollm2())
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    samples = generate_samples(cfg.tasks, cfg.lengths, cfg.samples, tokenizer, seed=cfg.seed, depths=cfg.depths)
    probe_sample = generate_samples(["passkey"], [256], 1, tokenizer, seed=cfg.seed + 1)[0]
    settings = make_settings(cfg)
    _log(f"{len(samples)} samples x {len(settings)} settings = {len(samples) * len(settings)} requests")

    out_dir = Path(cfg.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    main_req_path = _requests_path(out_dir, cfg.name, None)
    req_path = _requests_path(out_dir, cfg.name, cfg.shard)
    if cfg.shard is None and (cfg.resume or cfg.report_only):
        merge_shards(out_dir, cfg.name, _log)
    previous: dict[str, Any] = {}
    if cfg.report_only:
        if not req_path.exists():
            raise FileNotFoundError(f"--report-only needs {req_path}")
        prev_json = out_dir / f"{cfg.name}.json"
        previous = json.loads(prev_json.read_text()) if prev_json.exists() else {}
    # a shard also reuses what earlier merged runs left in the main file
    done = _load_done(*dict.fromkeys([main_req_path, req_path])) if (cfg.resume or cfg.report_only) else {}
    if not (cfg.resume or cfg.report_only) and req_path.exists():
        req_path.unlink()
    # reuse only records of the very same prompts (same task/length/index and token ids)
    fingerprints = {s.uid: _fingerprint(s) for s in samples}
    done = {k: [r for r in v if fingerprints.get(r["uid"]) == r.get("prompt_sha")] for k, v in done.items()}
    done = {k: v for k, v in done.items() if v}

    engine_args = engine_arguments(cfg, model_dir, samples + [probe_sample])
    own_llm = llm is None and not cfg.report_only
    if cfg.report_only:
        probe = EngineProbe(**previous["probe"]) if "probe" in previous else EngineProbe(True, True, [])
        engine_args = previous.get("engine_args", engine_args)
    elif own_llm:
        _log(f"starting vLLM: {engine_args}")
        t0 = time.time()
        from vllm import LLM

        from vllm_evict.engine import engine_kwargs

        llm = LLM(**engine_kwargs(**engine_args))  # exactly the recorded arguments (no test defaults)
        _log(f"engine up in {time.time() - t0:.0f} s")
    if not cfg.report_only:
        probe = probe_engine(llm, probe_sample, _log)
    for m in probe.messages:
        _log(m)

    skipped: dict[str, str] = {}
    active: list[Setting] = []
    for setting in settings:
        if setting.variant == "agnostic" and not probe.evict_at_supported:
            skipped[setting.key] = "engine does not support evict_at (question-agnostic)"
            continue
        error = None if setting.is_full else _validate_spec(setting.eviction(samples[0]))
        if error:
            skipped[setting.key] = f"rejected: {error}"
            _log(f"{setting.key}: rejected by the plugin ({error}); skipped")
            continue
        active.append(setting)
    if any(k.startswith("agnostic|") for k in skipped):
        _log("question-agnostic settings skipped: the engine must accept extra_args['vllm_evict']['evict_at'] "
             "= number of prompt tokens to compress (see docs/QUALITY.md)")

    records: dict[str, list[dict[str, Any]]] = {}
    for key, recs in done.items():
        records.setdefault(key, []).extend(recs)
    done_pairs = {(r["setting"], r["uid"]) for recs in done.values() for r in recs}
    timings: list[dict[str, Any]] = []
    own = [s for s in samples if cfg.shard is None or s.index % cfg.shard[1] == cfg.shard[0]]
    chunks = _chunks(own, cfg.chunk_samples, stride=cfg.shard[1] if cfg.shard else 1)
    total = sum(1 for chunk in chunks for s in chunk for st in active if (st.key, s.uid) not in done_pairs)
    _log(f"{total} requests to run ({len(done_pairs)} reused) in {len(chunks)} generate calls, "
         f"sample-major so that prefix caching shares each prompt across settings")
    bar = tqdm(total=total, desc="requests", unit="req", file=sys.stderr, dynamic_ncols=True)
    stopped = False
    for chunk in chunks:
        if cfg.report_only:
            break
        if cfg.stop_after is not None and time.time() - t_start > cfg.stop_after:
            stopped = True
            _log(f"--stop-after {cfg.stop_after:g} s reached: stopping; continue with the same command + --resume")
            break
        pairs = [(st, s) for s in chunk for st in active
                 if st.key not in skipped and (st.key, s.uid) not in done_pairs]
        if not pairs:
            continue
        where = _where(chunk)
        bar.set_postfix_str(where)
        t0 = time.time()
        try:
            recs = run_requests(llm, pairs, cfg.save_predictions)
        except Exception as exc:  # noqa: BLE001 - isolate the failing setting(s), keep the others
            _log(f"generate failed for {where} ({type(exc).__name__}: {exc}); "
                 f"retrying setting by setting")
            recs = []
            for st in dict.fromkeys(p[0] for p in pairs):
                try:
                    recs += run_requests(llm, [p for p in pairs if p[0] == st], cfg.save_predictions)
                except Exception as exc2:  # noqa: BLE001
                    skipped[st.key] = f"error: {type(exc2).__name__}: {str(exc2)[:200]}"
                    _log(f"{st.key}: {skipped[st.key]}")
        dt = time.time() - t0
        timings.append({"chunk": where, "requests": len(recs), "seconds": round(dt, 2)})
        with gzip.open(req_path, "at") as f:
            for r in recs:
                f.write(json.dumps(r) + "\n")
        for r in recs:
            records.setdefault(r["setting"], []).append(r)
        bar.update(len(pairs))
        full_recs = [r for r in recs if r["policy"] == FULL]
        bar.write(f"[eval] {where}: {len(recs)} requests in {dt:.0f} s ({len(recs) / max(dt, 1e-9):.1f} req/s)"
                  + (f", full-cache accuracy {100 * _mean(r['score'] for r in full_recs):.1f}%" if full_recs else ""),
                  file=sys.stderr)
    bar.close()
    for key in list(records):
        if key in skipped:
            del records[key]
    if cfg.shard is not None:
        return _finish_shard(cfg, out_dir, command, probe, engine_args, model_dir, timings, skipped,
                             time.time() - t_start, complete=not stopped, log=_log)

    rows, summary = aggregate(cfg, settings, records, skipped, probe)
    complete = not stopped and not any(r["status"] == "missing" or r["status"].startswith("incomplete")
                                       for r in rows)
    files = {
        "csv": str(out_dir / f"{cfg.name}.csv"), "summary_csv": str(out_dir / f"{cfg.name}_summary.csv"),
        "json": str(out_dir / f"{cfg.name}.json"), "markdown": str(out_dir / f"{cfg.name}.md"),
        "requests": str(req_path),
    }
    _write_csv(Path(files["csv"]), rows)
    _write_csv(Path(files["summary_csv"]), summary)
    env = previous.get("environment") or _environment(model_dir)
    title = (f"{env.get('model') or Path(model_dir).name}, RULER-style {','.join(cfg.tasks)} at {','.join(map(str, cfg.lengths))} "
             f"tokens, {_samples_text(cfg, rows)}, {env.get('device')}")
    tables = markdown_tables(cfg, summary)
    Path(files["markdown"]).write_text(
        f"# {cfg.name}\n\n{title}\n\nCommand: `{command}`\n\n"
        + "".join(f"- {m}\n" for m in probe.messages) + "\n" + tables)
    if cfg.plot:
        files["png"] = str(out_dir / f"{cfg.name}.png")
        plot(cfg, summary, Path(files["png"]), title)
    wall = time.time() - t_start
    now = _dt.datetime.now(_dt.timezone.utc).isoformat()
    if cfg.resume and previous == {} and (out_dir / f"{cfg.name}.json").exists():
        previous = json.loads((out_dir / f"{cfg.name}.json").read_text())
    payload = {
        "command": command, "config": asdict(cfg), "date": previous.get("date", now) if cfg.report_only else now,
        "environment": env, "engine_args": {k: v for k, v in engine_args.items()},
        "model_dir": previous.get("model_dir", model_dir) if cfg.report_only else model_dir,
        "probe": asdict(probe), "skipped": skipped,
        "generate_calls": previous.get("generate_calls", []) + timings,
        "wall_seconds": previous.get("wall_seconds", 0) + (0 if cfg.report_only else round(wall, 1)),
        "n_samples_total": len(samples), "complete": complete, "summary": summary, "rows": rows,
    }
    if cfg.report_only:
        payload["tables_rebuilt"] = now
    Path(files["json"]).write_text(json.dumps(payload, indent=1, default=str) + "\n")
    _log(f"wrote {', '.join(files.values())} in {wall:.0f} s")
    print(tables)
    print(f"reproduce with: {command}")
    if own_llm:
        del llm
    return EvalResult(rows=rows, summary=summary, probe=probe, files=files, command=command, skipped=skipped,
                      complete=complete)
