"""benchmarks/serving.py without an engine: every plan parses, every workload the docs name exists, the
decode-budget arithmetic of suite limit follows the engine's CompactionSchedule, and the limit sums a measured step-time curve as documented."""

import importlib.util
import json
import re
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def serving():
    spec = importlib.util.spec_from_file_location("serving_bench", ROOT / "benchmarks" / "serving.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_plan_parses(serving):
    parser = serving.build_parser()
    for name, plan in serving.PLANS.items():
        assert re.fullmatch(r"[a-z0-9]+(-[a-z0-9]+)*", name), name  # descriptive, lower-case words
        assert plan and plan[0][0] == "vanilla", name  # vanilla first
        for engine, suite, extra, seconds in plan:
            args = parser.parse_args(["one", "--engine", engine, "--suite", suite, "--out", "x.json", *extra])
            assert all(s in serving.SUITES for s in args.suite.split(",")), (name, suite)
            assert not (engine == "vanilla" and args.shared_prefix), name
            assert not (engine == "evict" and "limit" in suite.split(",")), name
            assert 60 < seconds <= 480, name  # an engine's budget fits one 600 s device command
        parser.parse_args(["run", "--plan", name, "--out-dir", "x"])


DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "tools" / "device" / "README.md"]


def test_every_documented_workload_exists(serving):
    """Every `--plan NAME` and every workload of `device_calls.sh NAME ...` in the docs names an entry of the
    registry (serving.py's PLANS, or device_calls.sh's own profile runs and needle-kv)."""
    script = (ROOT / "tools" / "device" / "device_calls.sh").read_text()
    profiles = set(re.findall(r"^\s*\[([a-z0-9-]+)\]=", script, re.M))
    assert {"profile-order", "profile-splits", "profile-adakv-decode"} <= profiles
    known = set(serving.PLANS) | profiles | {"needle-kv"}
    named = {}
    for doc in DOCS:
        text = doc.read_text()
        for name in re.findall(r"--plan[ =]([A-Za-z][A-Za-z0-9_.-]*)", text):
            named.setdefault(name, doc.name)
        for line in re.findall(r"device_calls\.sh((?: +[A-Za-z0-9_-]+)+)", text):
            for name in line.split():
                named.setdefault(name, doc.name)
    named.pop("NAME", None), named.pop("PLAN", None)
    assert "e2e-8k-2k-snapkv" in named  # the reference actually cites plans
    missing = {name: doc for name, doc in named.items() if name not in known}
    assert not missing, f"workloads named in the docs but not in the registry: {missing}"


def test_plans_as_documented(serving):
    """What the docs say of a few plans: both engines of a run use one KV-cache dtype; the decode-budget
    plans share the reasoning shape with their vanilla; the end-to-end plans run uniform and Ada-KV."""
    plans = serving.PLANS
    for name in ("capacity-e2e-bf16", "capacity-e2e-fp8", "capacity-32k-bf16", "capacity-32k-fp8"):
        fp8 = name.endswith("fp8")
        for engine, suite, extra, _ in plans[name]:
            assert ("--kv-cache-dtype" in extra) == fp8, (name, engine)
            if "load" in suite:
                assert extra[extra.index("--num-requests") + 1] == "0"  # at capacity
            if "e2e" in suite:
                assert extra[extra.index("--shapes") + 1] == "16384:512:64"
    for budget in (1024, 2048):
        for allocation in ("uniform", "adakv"):
            name = f"reasoning-1k-4k-{budget}" + ("-adakv" if allocation == "adakv" else "")
            (vanilla, suite, vanilla_args, _), *evicts = plans[name]
            assert (vanilla, suite) == ("vanilla", "limit,decode")
            assert vanilla_args[: len(serving.REASONING_ARGS)] == serving.REASONING_ARGS
            configs = []
            for engine, _, evict_args, _ in evicts:
                assert engine == "evict" and evict_args[: len(serving.REASONING_ARGS)] == serving.REASONING_ARGS
                configs += [json.loads(c) for c in evict_args[evict_args.index("--decode-configs") + 1:]]
            assert configs == [{"policy": policy, "decode_budget": budget, "allocation": allocation}
                               for policy in ("dropkv", "snapkv")]
    for name, policy in (("e2e-8k-2k-16k-512", "dropkv"), ("e2e-8k-2k-snapkv", "snapkv")):
        (vanilla, suite, vanilla_args, _), (evict, _, evict_args, _) = plans[name]
        assert (vanilla, evict, suite) == ("vanilla", "evict", "e2e")
        args = serving.build_parser().parse_args(["one", "--engine", "evict", "--suite", "e2e", "--out", "x",
                                                  *evict_args])
        assert args.allocation.split(",") == ["uniform", "adakv"] and args.policy == policy
        assert evict_args[: len(vanilla_args)] == vanilla_args and "8192:2048:86" in vanilla_args
    # speculation: both engines run the same drafter (and graph sizes); the evicting one adds its decode budget and
    # synchronous scheduling
    parser = serving.build_parser()
    parsed = {}  # plan name -> (vanilla's arguments, the evicting engine's), as `one` reads them
    for name in ("ngram", "eagle", "eagle-2", "eagle-by-batch", "eagle-graphs"):
        (_, _, vanilla_args, _), (_, _, evict_args, _) = plans[f"reasoning-1k-4k-1024-{name}"]
        assert evict_args[: len(vanilla_args)] == vanilla_args, name
        vanilla, evict = parsed[name] = tuple(
            parser.parse_args(["one", "--engine", engine, "--suite", "decode", "--out", "x", *extra])
            for engine, extra in (("vanilla", vanilla_args), ("evict", evict_args)))
        assert vanilla.speculative_config == evict.speculative_config is not None, name
        assert vanilla.max_cudagraph_capture_size == evict.max_cudagraph_capture_size, name
        # the engine refuses decode budgets with speculation under asynchronous scheduling; vanilla keeps vLLM's default
        assert (vanilla.no_async_scheduling, evict.no_async_scheduling) == (False, True), name
    graphs, eagle = parsed["eagle-graphs"][0], parsed["eagle"][0]
    assert graphs.speculative_config == eagle.speculative_config  # the EAGLE plan's drafter, with larger graphs
    assert (graphs.max_cudagraph_capture_size, eagle.max_cudagraph_capture_size) == (1024, None)


CASES = [  # prompt, max_tokens, decode_budget, decode_every
    (1024, 4096, 1024, None), (1024, 4096, 2048, None), (1024, 600, 512, 128), (64, 200, 32, 16),
    (100, 300, 48, 40), (1024, 4096, 8192, None),
]


@pytest.mark.parametrize("prompt,max_tokens,budget,every", CASES)
def test_decode_held_tokens_follow_the_schedule(serving, prompt, max_tokens, budget, every):
    from vllm_evict.engine.request_config import CompactionSchedule, parse_request

    spec = {"policy": "dropkv", "decode_budget": budget, **({"decode_every": every} if every else {})}
    schedule = CompactionSchedule(parse_request({"vllm_evict": spec}), prompt, 16)
    points, index = [], 0
    while (point := schedule.point(index)) is not None and point.at < prompt + max_tokens:
        points.append(point)
        index += 1
    # step j attends over the prompt + j written tokens less what the points before it evicted
    expected = [prompt + j - sum(p.held - p.kept for p in points if p.at < prompt + j) for j in range(1, max_tokens)]
    held = serving.decode_held_tokens(prompt, max_tokens, budget, every, 16)
    assert held == expected
    assert serving.peak_blocks_of(held, 16) == schedule.peak_blocks(prompt + max_tokens, 0)


def test_reasoning_shape_held_tokens(serving):
    """The figures the docs quote: K_d 1024 holds 1,025..1,152 (mean ~K_d + C_d/2), K_d 2048 1,025..2,176."""
    held = serving.decode_held_tokens(1024, 4096, 1024)
    assert (min(held), max(held), round(statistics.mean(held), 1)) == (1025, 1152, 1088.5)
    held = serving.decode_held_tokens(1024, 4096, 2048)
    assert (min(held), max(held), round(statistics.mean(held), 1)) == (1025, 2176, 1968.4)


def test_decode_limit_sums_the_curve(serving):
    # a linear curve (a + b * kv ms) gives exactly steps * (a + b * mean held) per wave
    curve = {"bins": [{"kv": 1000.0, "step_ms": 20.0}, {"kv": 3000.0, "step_ms": 40.0}]}
    held = serving.decode_held_tokens(1024, 4096, 2048)
    one = serving.decode_limit(256, 4096, held, 136, 100_000, 512, {256: curve})
    assert one["batch"] == 256 and one["waves"] == [256]
    assert one["decode_s"] == pytest.approx(len(held) * (20 + 0.01 * (statistics.mean(held) - 1000)) / 1e3, abs=0.01)
    # a pool of 202 peaks: a wave of 202 and one of 54, each timed on its own batch's curve
    slow = {"bins": [{"kv": 1000.0, "step_ms": 10.0}, {"kv": 3000.0, "step_ms": 10.0}]}
    two = serving.decode_limit(256, 4096, held, 136, 202 * 136 + 100, 512, {202: curve, 54: slow})
    assert two["waves"] == [202, 54]
    assert two["decode_s"] == pytest.approx(one["decode_s"] + len(held) * 10 / 1e3, abs=0.01)
    assert serving.interp(500, [1000, 3000], [20, 40]) == 20 and serving.interp(2000, [1000, 3000], [20, 40]) == 30


def test_held_blocks_at_end_one_shot(serving):
    from vllm_evict.engine.request_config import parse_request
    from vllm_evict.engine.scheduler import plan_eviction

    ev = plan_eviction(parse_request({"vllm_evict": {"policy": "dropkv", "budget": 0.1}}), 32768, 16, max_tokens=256)
    # P fresh pages after the compaction at the end of the prompt, then the generated tokens
    assert serving.held_blocks_at_end(ev.schedule, 32768 + 256, ev.blocks) == ev.blocks + 256 // 16


def test_eval_kv_cache_dtype():
    """`vllm-evict eval --kv-cache-dtype fp8` reaches the engine and the reproducing command."""
    import argparse

    from vllm_evict.bench.eval import EvalConfig, engine_arguments
    from vllm_evict.bench.eval_cli import config_from_args, register

    class _Sample:
        n_prompt, max_tokens = 1000, 16

    cfg = EvalConfig(kv_cache_dtype="fp8", name="needle_kv_fp8")
    assert "--kv-cache-dtype fp8" in cfg.command()
    assert engine_arguments(cfg, "m", [_Sample()])["kv_cache_dtype"] == "fp8"
    assert "kv_cache_dtype" not in engine_arguments(EvalConfig(), "m", [_Sample()])
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers(dest="command"))
    assert config_from_args(parser.parse_args(shlex.split(cfg.command())[1:])) == cfg


def test_end_to_end_runs_set_next_to_their_limit(serving):
    """`run --plan` prints each vllm-evict e2e run next to the limit its vanilla engine measured: here the
    GPT-OSS-20B runs recorded in docs/results (H100, both engines on one GPU, each after a warm-up run)."""
    results = [json.loads((ROOT / "docs/results/hybrid" / f"hybrid-e2e-gpt-oss-20b_{name}_e2e.json").read_text())
               for name in ("0_vanilla", "1_evict")]
    (row,) = serving.against_limits(results)
    assert (row["what"], row["allocation"]) == ("e2e 16384 in / 512 out x 64", "uniform")
    assert (row["vanilla_s"], row["limit_s"], row["evict_s"]) == (26.47, 22.31, 22.74)
    assert (row["of_limit"], row["speedup"]) == (0.981, 1.16)
    assert (row["limit_mixed_s"], row["of_limit_mixed"]) == (22.77, 1.001)  # vanilla's prefill phase: 19.35 s


def test_decode_runs_set_next_to_their_limit_unless_cut(serving):
    """suite decode against vanilla's suite limit: the reasoning shape's runs recorded in docs/results (H100,
    one warm machine). The DropKV run cut by its call's deadline (63.76 s for 2,664 of 4,113 steps) is no
    measurement against the limit; the same engine's full run is."""
    recorded = ROOT / "docs/results/decode-time-eviction"
    vanilla, cut, full = (json.loads((recorded / f"reasoning-1k-4k-1024_h100_ca80bfa_{name}.json").read_text())
                          for name in ("vanilla", "dropkv-cut", "dropkv"))
    assert cut["runs"][0]["stop_reason"] == "deadline"
    assert serving.against_limits([vanilla, cut]) == []
    (row,) = serving.against_limits([vanilla, cut, full])
    assert (row["vanilla_s"], row["limit_s"], row["evict_s"]) == (225.41, 90.32, 95.6)
    assert (row["of_limit"], row["speedup"]) == (0.945, 2.36)


@pytest.mark.parametrize("tail", ["0", "1024"])
def test_a_shared_tail_outside_the_prompt_is_refused(tail, tmp_path):
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "serving.py"), "one", "--engine", "evict",
                           "--suite", "capacity", "--out", str(tmp_path / "x.json"), "--prompt-len", "1024",
                           "--shared-prefix", "--shared-tail", tail], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "--shared-tail must be within the prompt (1 to 1023 tokens)" in proc.stderr


def test_a_plan_past_its_budget_starts_no_engine(tmp_path):
    """`run --stop-by` (the end of a device call's budget): an engine that could not measure before it is not
    started, and the plan's JSON says so for each, so a cut call still returns what ran."""
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "serving.py"), "run", "--plan",
                           "capacity-32k-bf16", "--out-dir", str(tmp_path), "--stop-by", str(time.time() + 30)],
                          capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = json.loads((tmp_path / "capacity-32k-bf16.json").read_text())
    assert rows == [{"engine": engine, "suite": "capacity", "failed": "skipped: the plan's budget ran out"}
                    for engine in ("vanilla", "evict")]
