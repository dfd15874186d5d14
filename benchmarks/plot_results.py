"""Draw the benchmark figures in docs/img/ from the recorded results (docs/BENCHMARKS.md table and
docs/results/*.json). Run: python benchmarks/plot_results.py"""

from __future__ import annotations

import json
import re
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
IMG = ROOT / "docs" / "img"


def scoring_rows():
    rows = []
    for line in (ROOT / "docs" / "BENCHMARKS.md").read_text().splitlines():
        m = re.match(r"\|\s*(dropkv|snapkv)\s*\|\s*(ieee|bf16x3)\s*\|\s*(\d+)\s*\|\s*(\d+)\s*\|\s*([\d.]+)\s*\|\s*([\d.]+)\s*\|", line)
        if m:
            rows.append((m[1], m[2], int(m[4]), float(m[5]), float(m[6])))
    return rows


def plot_scoring() -> Path:
    rows = scoring_rows()
    fig, ax = plt.subplots(figsize=(6.4, 4))
    for policy, prec in sorted({(r[0], r[1]) for r in rows}):
        pts = sorted((r[2], r[3] / r[4]) for r in rows if r[0] == policy and r[1] == prec)
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=f"{policy} ({prec}, 2026-11-22)")
    # 2026-11-25: bf16x3 with exact peak-key values became the default (docs/results/scoring-kernels/scoring_T4_fbde278.json)
    t4 = [r for r in _result("scoring-kernels/scoring_T4_fbde278.json")["rows"]
          if r["policy"] == "dropkv" and r["precision"] == "bf16x3" and r.get("naive_ms")]
    ax.plot([r["n"] for r in t4], [r["naive_ms"] / r["triton_ms"] for r in t4], marker="s", color="black",
            label="dropkv (default since 2026-11-25: bf16x3 + exact peak keys)")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("prompt length n (tokens)")
    ax.set_ylabel("speedup over naive torch scorer (x)")
    ax.set_title("Fused Triton scoring vs naive PyTorch, H100, Llama-3.1-8B heads")
    ax.axhline(25, color="grey", ls="--", lw=1)
    ax.text(2 ** 12, 26, "goal 25x at 128K", color="grey", fontsize=8)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    out = IMG / "scoring_speedup.png"
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    return out


def plot_capacity() -> Path:
    runs = [json.loads(p.read_text()) for p in sorted((ROOT / "docs" / "results").glob("capacity/gpu_capacity_*.json"))]
    runs.sort(key=lambda r: r["max_running_before_preemption"])
    labels = ["stock vLLM" if r["budget"] is None else f"{r['policy']} {r['budget']:.0%} {r['allocation']}"
              for r in runs]
    values = [r["max_running_before_preemption"] for r in runs]
    fig, ax = plt.subplots(figsize=(5.5, 3.5))
    bars = ax.bar(labels, values, color=["#999999"] + ["#1f77b4"] * (len(values) - 1))
    for bar, v in zip(bars, values):
        ax.text(bar.get_x() + bar.get_width() / 2, v + 1, str(v), ha="center")
    ax.set_ylabel("concurrent 32K-token requests")
    ax.set_title("Capacity before preemption, Llama-3.1-8B (dummy), H100")
    out = IMG / "capacity_32k.png"
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    return out


MEMORY = "memory-bounded-prefill/blockwise-memory-64k-pool_{}_memory_0f19ecb.json"
CONCURRENT = "memory-bounded-prefill/blockwise-capacity-64k_{}_capacity_0f19ecb.json"


def _result(name: str) -> dict:
    return json.loads((ROOT / "docs" / "results" / name).read_text())


def plot_serving() -> Path:
    """Issue-7 serving figures: capacity, decode throughput at capacity, TTFT (H100, one run each)."""
    vanilla, evict = _result("capacity/serving_capacity-decode-32k-512_vanilla_h100.json"), _result(
        "capacity/serving_capacity-decode-32k-512_evict_h100.json")
    caps = [("vanilla", vanilla["capacity"])] + [("dropkv 10% uniform", evict["capacity"])] + [
        (f"dropkv {r['eviction']['budget']:.0%} {r['eviction']['allocation']}", r["capacity"])
        for r in _result("capacity/serving_capacity_evict_h100.json")["runs"]]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    ax = axes[0]
    bars = ax.bar([c[0] for c in caps], [c[1] for c in caps], color=["#999999"] + ["#1f77b4"] * (len(caps) - 1))
    for bar, (_, v) in zip(bars, caps):
        ax.text(bar.get_x() + bar.get_width() / 2, v + 1, str(v), ha="center")
    ax.set_ylabel("concurrent 32K-token requests")
    ax.set_title("Capacity before preemption")
    ax.tick_params(axis="x", labelrotation=20, labelsize=8)
    ax = axes[1]
    pts = [("vanilla", vanilla), ("dropkv 10%", evict)]
    for (label, r), color in zip(pts, ["#999999", "#1f77b4"]):
        ax.scatter(r["decode_mean_batch"], r["decode_tok_s"], s=60, color=color, label=label, zorder=3)
        ax.annotate(f"{r['decode_tok_s']:.0f} tok/s\n{r['decode_step_ms_mean']:.1f} ms/step",
                    (r["decode_mean_batch"], r["decode_tok_s"]), textcoords="offset points", xytext=(8, -12),
                    fontsize=8)
    ax.set_xlabel("concurrent decoding requests (mean over decode steps)")
    ax.set_ylabel("decode throughput (output tokens/s)")
    ax.set_title("Decode throughput at capacity, 32K in / 512 out")
    ax.set_xlim(0, 140)
    ax.set_ylim(0, 4000)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="upper left")
    ax = axes[2]
    ttft = {}
    for name, label in (("decode-step/serving_latency_vanilla_h100.json", "vanilla"), ("decode-step/serving_latency_evict_h100.json",
                                                                           "dropkv 10%")):
        for row in _result(name)["ttft"]:
            if row["repeat"] == 1:
                ttft.setdefault((row["prompt_len"], row["batch"]), {})[label] = row["ttft_ms_mean"]
    keys = sorted(ttft)
    xs = range(len(keys))
    ax.bar([x - 0.2 for x in xs], [ttft[k]["vanilla"] for k in keys], 0.4, color="#999999", label="vanilla")
    ax.bar([x + 0.2 for x in xs], [ttft[k]["dropkv 10%"] for k in keys], 0.4, color="#1f77b4", label="dropkv 10%")
    for x, k in zip(xs, keys):
        over = ttft[k]["dropkv 10%"] / ttft[k]["vanilla"] - 1
        ax.text(x + 0.2, ttft[k]["dropkv 10%"] * 1.1, f"+{over:.0%}", ha="center", fontsize=8)
    ax.set_xticks(list(xs), [f"{k[0] // 1024}K x{k[1]}" for k in keys], fontsize=8)
    ax.set_yscale("log")
    ax.set_ylabel("mean TTFT (ms)")
    ax.set_title("Time to first token (prompt x batch)")
    ax.legend(fontsize=8)
    fig.suptitle("vllm-evict vs vanilla vLLM 0.26.0, Llama-3.1-8B shape (dummy bf16), H100 80GB", fontsize=10)
    out = IMG / "serving_h100.png"
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    return out


def plot_memory_bounded() -> Path:
    """Issue-17 figure: peak KV blocks and prefill time per prompt length on a 64K-token pool, and concurrent
    64K requests (H100, 2026-11-23: docs/results/memory-bounded-prefill/)."""
    runs = {r["engine"]: r["rows"] for r in (_result(MEMORY.format("0_vanilla")),
                                             _result(MEMORY.format("1_evict")))}
    pool = _result(MEMORY.format("0_vanilla"))["kv_pool_tokens"] // 16

    def mode(row):
        ev = row["eviction"]
        return "no eviction" if ev is None else "block-wise KeyDiff" if ev.get("chunked") else "one-shot KeyDiff"

    series = {"vanilla": [r for r in runs["vanilla"]]}
    for row in runs["evict"]:
        if row["eviction"] is not None:
            series.setdefault(mode(row), []).append(row)
    colors = {"vanilla": "#999999", "one-shot KeyDiff": "#ff7f0e", "block-wise KeyDiff": "#1f77b4"}
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    for ax, key, label in ((axes[0], "peak_blocks", "most KV blocks held"), (axes[1], "prefill_s", "prefill (s)")):
        for name, rows in series.items():
            done = [r for r in rows if r["ended"] == "length"]
            ax.plot([r["prompt_len"] // 1000 for r in done], [r[key] for r in done], "o-", color=colors[name],
                    label=name)
        ax.set_xlabel("prompt (thousand tokens)")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    axes[0].axhline(pool, color="black", linestyle="--", linewidth=1)
    axes[0].text(75, pool * 0.95, f"KV pool: {pool} blocks (64K tokens)", fontsize=8)
    axes[0].set_ylim(0, pool * 1.1)
    axes[0].set_title("Peak KV per request (served requests only)")
    axes[0].legend(fontsize=8, loc="center right")
    axes[1].set_title("Prefill time, one request at a time")
    caps = [("vanilla", _result(CONCURRENT.format("0_vanilla"))["runs"][0]["capacity"]),
            ("block-wise KeyDiff 25%", _result(CONCURRENT.format("1_evict"))["runs"][0]["capacity"])]
    bars = axes[2].bar([c[0] for c in caps], [c[1] for c in caps], color=["#999999", "#1f77b4"])
    for bar, (_, v) in zip(bars, caps):
        axes[2].text(bar.get_x() + bar.get_width() / 2, v + 0.3, str(v), ha="center")
    axes[2].set_ylabel("concurrent 64K-token requests")
    axes[2].set_title("Capacity, whole GPU")
    fig.suptitle("Memory-bounded prefill, Llama-3.1-8B shape (dummy bf16), H100 80GB, vLLM 0.26.0", fontsize=10)
    out = IMG / "memory_bounded_prefill.png"
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    return out


def plot_soak() -> Path:
    """Issue-18 figure: the 10-minute GPU soak, requests running and KV usage over time for vllm-evict and vanilla
    on the same 131,072-token pool (H100, 2026-11-25: docs/results/soak/load_*.json)."""
    runs = {"vllm-evict, mixed eviction": (_result("soak/load_evict_15c583b.json"), "#1f77b4"),
            "vanilla vLLM": (_result("soak/load_vanilla_15c583b.json"), "#999999")}
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    for name, (run, color) in runs.items():
        samples = [x for x in run["samples"] if "running" in x]
        t = [x["t"] / 60 for x in samples]
        axes[0].plot(t, [x["running"] for x in samples], color=color, label=name)
        axes[1].plot(t, [100 * x["kv_usage"] for x in samples], color=color, label=name)
    for ax, label in ((axes[0], "requests running"), (axes[1], "KV cache in use (%)")):
        ax.axvline(run["seconds"] / 60, color="black", linestyle=":", linewidth=1)
        ax.set_xlabel("minutes (load stops at the dotted line, then drains)")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    axes[0].set_title("Requests running at once, 200 clients")
    axes[1].set_title("KV usage (0% after the drain on both)")
    names = list(runs)
    outcomes = ("done", "disconnected", "failed", "lost")
    bottom = [0, 0]
    for outcome, color in zip(outcomes, ("#2ca02c", "#bcbd22", "#d62728", "#000000")):
        values = [runs[n][0][outcome] for n in names]
        axes[2].bar(["vllm-evict", "vanilla"], values, bottom=bottom, color=color, label=outcome)
        bottom = [b + v for b, v in zip(bottom, values)]
    axes[2].set_ylabel("requests in 10 minutes")
    axes[2].set_title("Outcomes (failed and lost: 0 on both)")
    axes[2].legend(fontsize=8)
    fig.suptitle("GPU soak: both engines at once on one H100, 16 GiB KV each, Llama-3.1-8B shape (dummy bf16), "
                 "4K-token prompts, 256 output tokens", fontsize=10)
    out = IMG / "gpu_soak.png"
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    return out


if __name__ == "__main__":
    IMG.mkdir(parents=True, exist_ok=True)
    print(plot_scoring(), plot_capacity(), plot_serving(), plot_memory_bounded(), plot_soak())
