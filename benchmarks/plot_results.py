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
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=f"{policy} ({prec})")
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
    runs = [json.loads(p.read_text()) for p in sorted((ROOT / "docs" / "results").glob("gpu_capacity_*.json"))]
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


if __name__ == "__main__":
    IMG.mkdir(parents=True, exist_ok=True)
    print(plot_scoring(), plot_capacity())
