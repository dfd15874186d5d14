"""The serving benchmark script (benchmarks/serving.py) end to end on CPU with a tiny model: vanilla vs
vllm-evict under a KV-bound load, and the latency suite. Checks what the GPU tables are built from."""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.engine, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
# tiny Llama: 3 layers x 2 KV heads x 64 dims x K,V x fp32 = 3,072 bytes per token -> an 8,192-token cache
KV_BYTES = 3072 * 8192
COMMON = ["--max-model-len", "1024", "--max-num-batched-tokens", "512", "--max-num-seqs", "32",
          "--kv-cache-memory-bytes", str(KV_BYTES), "--time-limit", "240"]


def run_one(tmp_path, name, *args) -> dict:
    out = tmp_path / f"{name}.json"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "serving.py"), "one", "--out", str(out), *args, *COMMON]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def load_runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("serving")
    load = ["--suite", "load", "--prompt-len", "768", "--max-tokens", "16", "--num-requests", "40"]
    return (run_one(tmp, "vanilla", "--engine", "vanilla", *load),
            run_one(tmp, "evict", "--engine", "evict", *load, "--shared-prefix", "--budget", "0.1"))


def test_every_request_completes(load_runs):
    for run in load_runs:
        assert run["stop_reason"] == "all requests finished"
        assert run["output_tokens"] == 40 * 16
        assert run["decode_tok_s"] > 0 and run["decode_steps"] > 0


def test_eviction_raises_kv_bound_capacity(load_runs):
    vanilla, evict = load_runs
    # 8,192 cache tokens hold ~10 plain 784-token requests; at 10% a request keeps 5 pages + its tail.
    assert vanilla["eviction"] is None and vanilla["capacity"] <= 11
    assert evict["eviction"] == {"policy": "dropkv", "budget": 0.1, "allocation": "uniform"}
    assert evict["capacity"] >= 2 * vanilla["capacity"]
    assert evict["evict_ms_mean"] > 0  # every finished request carried the engine's eviction report


def test_latency_suite_rows(tmp_path):
    run = run_one(tmp_path, "latency", "--engine", "evict", "--suite", "latency", "--ttft-cases", "512x1", "512x2",
                  "--repeats", "1", "--decode-batches", "2", "--kv-len", "128", "--decode-budget", "0.25",
                  "--decode-steps", "8", "--decode-allocations", "uniform", "adakv")
    assert [(r["prompt_len"], r["batch"]) for r in run["ttft"]] == [(512, 1), (512, 2)]
    assert all(r["ttft_ms_mean"] > 0 and r["evict_ms_mean"] > 0 for r in run["ttft"])
    variants = [r["variant"] for r in run["decode"]]
    assert variants == ["evict engine, no eviction", "evict engine, dropkv 0.25 uniform (512 -> 128)",
                        "evict engine, dropkv 0.25 adakv (512 -> 128)"]
    assert all(r["steps"] >= 4 and r["step_ms_median"] > 0 for r in run["decode"])


def test_memory_suite_rows(tmp_path):
    """Suite memory (memory-bounded prefill) on a 48-block pool with --max-model-len beyond it: peak blocks per mode, and a
    1500-token prompt that only block-wise eviction serves (one budget for every cut: the bound is P and a chunk)."""
    out = tmp_path / "memory.json"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "serving.py"), "one", "--out", str(out), "--engine", "evict",
           "--suite", "memory", "--kv-cache-memory-bytes", str(3072 * 768), "--max-model-len", "2048",
           "--allow-long-prompts", "--memory-lengths", "512", "1500", "--memory-budget", "128", "--chunk-size", "64",
           "--max-num-batched-tokens", "512", "--time-limit", "240", "--eviction-options", '{"chunk_budget": 128}']
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    run = json.loads(out.read_text())
    assert run["kv_pool_tokens"] == 768
    rows = {(r["prompt_len"], "none" if r["eviction"] is None else
             "chunked" if r["eviction"].get("chunked") else "one-shot"): r for r in run["rows"]}
    assert [rows[(512, m)]["ended"] for m in ("none", "one-shot", "chunked")] == ["length"] * 3
    assert rows[(512, "none")]["peak_blocks"] == 32                # the prompt (max_tokens=1 needs no slot)
    assert rows[(512, "one-shot")]["peak_blocks"] == 32 + 8        # the prompt and P fresh blocks
    assert rows[(512, "chunked")]["peak_blocks"] == 8 + 64 // 16   # P and one chunk
    for mode in ("none", "one-shot"):  # refused at arrival, naming the blocks it needs and the cache's
        assert rows[(1500, mode)]["ended"].startswith("rejected: the request can never fit the KV cache"), mode
    assert rows[(1500, "chunked")]["ended"] == "length" and rows[(1500, "chunked")]["peak_blocks"] == 12
    assert rows[(1500, "chunked")]["compactions"] == len(range(192, 1500, 64)) + 1


def test_capacity_suite_at_tensor_parallel_2(tmp_path):
    """--tensor-parallel-size 2 (the plans for 2 GPUs) on two CPU worker processes: each rank holds one
    of the two KV heads, so the same KV bytes hold twice the tokens, and eviction still raises the capacity
    above what plain requests could reach."""
    run = run_one(tmp_path, "tp2", "--engine", "evict", "--suite", "capacity", "--tensor-parallel-size", "2",
                  "--prompt-len", "768", "--max-tokens", "64", "--capacity-configs", "0.25:uniform")
    assert run["kv_tokens_total"] >= 2 * 8192 - 16
    row = run["runs"][0]
    assert row["eviction"] == {"policy": "dropkv", "budget": 0.25, "allocation": "uniform"}
    assert row["capacity"] > run["kv_tokens_total"] // (768 + 64)


def test_e2e_suite_at_pipeline_parallel_2(tmp_path):
    """--pipeline-parallel-size 2 (the PP plans for 2 GPUs) on two CPU worker processes: the stage of two of
    the tiny Llama's three layers bounds the pool (so it holds 3/2 of one worker's tokens), and every request
    of both allocations finishes evicted."""
    run = run_one(tmp_path, "pp2", "--engine", "evict", "--suite", "e2e", "--pipeline-parallel-size", "2",
                  "--shapes", "512:8:4", "--allocation", "uniform,adakv")
    assert run["kv_tokens_total"] == 8192 * 3 // 2
    assert [shape["allocation"] for shape in run["shapes"]] == ["uniform", "adakv"]
    for shape in run["shapes"]:
        load = shape["load"]
        assert load["stop_reason"] == "all requests finished" and load["output_tokens"] == 4 * 8
        assert load["evict_ms_mean"] > 0


def test_limit_suite_on_vanilla(tmp_path):
    """Suite limit after vanilla's own decode run on one engine: the prefill-only pass, a step-time
    curve over the KV range a decode-budget request holds, and the limit per decode budget next to vanilla's
    wall time."""
    config = '{"policy": "dropkv", "decode_budget": 32, "decode_every": 16}'
    run = run_one(tmp_path, "limit", "--engine", "vanilla", "--suite", "limit,decode", "--prompt-len", "64",
                  "--max-tokens", "100", "--num-requests", "8", "--decode-configs", config, "--limit-bin", "8")
    limit = run["limit"]
    assert limit["prefill_only"]["stop_reason"] == "all requests finished"
    (curve,) = limit["curves"]
    assert (curve["batch"], curve["kv_from"], curve["kv_to"]) == (8, 32, 80) and curve["complete"]
    assert all(b["step_ms"] > 0 for b in curve["bins"])
    (row,) = limit["rows"]
    assert (row["decode_budget"], row["decode_every"], row["held_tokens_min"], row["held_tokens_max"]) == (32, 16, 33, 80)
    assert row["waves"] == [8] and row["complete"]
    assert row["limit_s"] == pytest.approx(row["prefill_only_s"] + row["decode_s"], abs=0.02)
    assert row["vanilla_wall_s"] == run["runs"][0]["wall_s"] and row["limit_vs_vanilla"] > 0
    # the evict engine's run of the same decode budget, set next to that limit as `run --plan` prints it
    evict = run_one(tmp_path, "evict", "--engine", "evict", "--suite", "decode", "--prompt-len", "64",
                    "--max-tokens", "100", "--num-requests", "8", "--decode-configs", config)
    spec = importlib.util.spec_from_file_location("serving_bench", ROOT / "benchmarks" / "serving.py")
    serving = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(serving)
    (against,) = serving.against_limits([run, evict])
    assert against["what"] == "decode 8 x 64 in / 100 out, decode_budget 32 every 16", against
    assert (against["limit_s"], against["evict_s"], against["vanilla_s"]) == (
        row["limit_s"], evict["runs"][0]["wall_s"], row["vanilla_wall_s"])
    assert against["of_limit"] == pytest.approx(row["limit_s"] / evict["runs"][0]["wall_s"], abs=1e-3)


def test_load_at_capacity_and_e2e_on_one_engine(tmp_path):
    """--num-requests 0 (decode tok/s at capacity) sizes the load from the pool and the request's
    compacted blocks; suite e2e after it on the same engine sends distinct prompts despite --shared-prefix,
    once per allocation of --allocation (the load suite takes the first)."""
    run = run_one(tmp_path, "fit", "--engine", "evict", "--suite", "load,e2e", "--prompt-len", "768",
                  "--max-tokens", "16", "--num-requests", "0", "--shared-prefix", "--shapes", "512:8:4",
                  "--allocation", "uniform,adakv", "--step-trace", "--warm-up-load")
    fit = run["fit"]
    assert fit["num_requests"] == run["num_requests"] == 32  # COMMON's --max-num-seqs bounds it on this pool
    assert fit["reserve_blocks"] == 768 // 16 and fit["blocks_per_request"] < 768 // 16
    assert run["stop_reason"] == "all requests finished" and run["shared_prefix"]
    assert [(shape["allocation"], shape["load"]["eviction"]["allocation"]) for shape in run["shapes"]] == [
        ("uniform", "uniform"), ("adakv", "adakv")]
    for shape in run["shapes"]:
        assert shape["load"]["shared_prefix"] is False and shape["load"]["stop_reason"] == "all requests finished"
        assert shape["load"]["prompt_len"] == 512 and shape["warm_up_wall_s"] > 0
        # --step-trace: every step, and each token computed once (distinct prompts, no preemption)
        trace = shape["load"]["step_trace"]
        assert len(trace) == shape["load"]["steps"]
        assert sum(row[1] for row in trace) == 4 * 512 + 4 * (8 - 1)
        assert sum(row[3] for row in trace) == shape["load"]["decode_steps"]
        # host time inside the step (each figure rounded to a microsecond on its own)
        assert all(row[0] + 0.01 >= row[4] + row[5] + row[6] > 0 for row in trace)
        assert sum(row[7] for row in trace) == 4  # each request compacted once (one-shot, 10%)
        # the garbage collector's time since the step before (the engine runs in the benchmark's process)
        assert all(len(row) == 10 and row[9] >= 0 for row in trace)


def test_decode_suite_with_ngram_speculation(tmp_path):
    """--speculative-config reaches both engines: a decode-budget load with vLLM's n-gram drafter finishes
    every request with its decode points, and reports the tokens each request gained per decode step
    (above 1 once drafts are accepted: a greedy random model falls into repeats the drafter finds)."""
    ngram = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}'
    config = '{"policy": "dropkv", "decode_budget": 32, "decode_every": 16}'
    load = ["--suite", "decode", "--prompt-len", "64", "--max-tokens", "120", "--num-requests", "8",
            "--speculative-config", ngram]
    for engine, extra in (("vanilla", []), ("evict", ["--decode-configs", config])):
        (run,) = run_one(tmp_path, engine, "--engine", engine, *load, *extra)["runs"]
        assert run["stop_reason"] == "all requests finished" and run["output_tokens"] == 8 * 120, run
        assert run["decode_tokens_per_request_step"] > 1, run
