"""Render the panel grid of deploy/grafana/dashboards/vllm-evict.json as a PNG *layout diagram*.

This is not a Grafana screenshot: it draws each panel's box (Grafana's 24-column grid) with its title,
type and the metrics its queries use, so the docs can show what the dashboard contains without a running
Grafana.

    python deploy/grafana/render_layout.py [--dashboard PATH] [--out docs/img/grafana-dashboard-layout.png]
"""

from __future__ import annotations

import argparse
import json
import re
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_DASHBOARD = ROOT / "deploy" / "grafana" / "dashboards" / "vllm-evict.json"
DEFAULT_OUT = ROOT / "docs" / "img" / "grafana-dashboard-layout.png"
# our vllm_evict:* families, and vLLM's own vllm:* / http_* ones (same /metrics endpoint)
METRIC_RE = re.compile(r"\b(?:vllm_evict:|vllm:|http_)[A-Za-z0-9_:]+")
COLORS = {"stat": "#dbeafe", "timeseries": "#dcfce7", "gauge": "#fef9c3", "row": "#e5e7eb"}


def _short(name: str) -> str:
    name = name.removeprefix("vllm_evict:")  # vLLM's names keep their vllm: prefix
    return re.sub(r"_(bucket|total|sum|count)$", "", name)


def render(dashboard: Path = DEFAULT_DASHBOARD, out: Path = DEFAULT_OUT) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Rectangle

    dash = json.loads(Path(dashboard).read_text())
    panels = dash["panels"]
    bottom = max(p["gridPos"]["y"] + p["gridPos"]["h"] for p in panels)
    unit = 0.62  # inches per grid row
    fig, ax = plt.subplots(figsize=(16, bottom * unit * 0.55 + 1.0))
    ax.set_xlim(0, 24)
    ax.set_ylim(bottom, 0)
    ax.axis("off")
    for p in panels:
        g = p["gridPos"]
        kind = p["type"]
        ax.add_patch(Rectangle((g["x"] + 0.08, g["y"] + 0.08), g["w"] - 0.16, g["h"] - 0.16,
                               facecolor=COLORS.get(kind, "#f3f4f6"), edgecolor="#374151", linewidth=0.8))
        if kind == "row":
            ax.text(g["x"] + 0.3, g["y"] + g["h"] / 2, p["title"], va="center", ha="left", fontsize=10,
                    fontweight="bold")
            continue
        ax.text(g["x"] + 0.3, g["y"] + 0.45, p["title"], va="top", ha="left", fontsize=9, fontweight="bold")
        metrics = []
        for t in p.get("targets", []):
            for m in METRIC_RE.findall(t.get("expr", "")):
                s = _short(m)
                if s not in metrics:
                    metrics.append(s)
        quantile = any("histogram_quantile" in t.get("expr", "") for t in p.get("targets", []))
        lines = [line for m in metrics for line in textwrap.wrap(m, width=int(g["w"] * 6.5), break_long_words=True)]
        body = f"[{kind}{', quantiles' if quantile else ''}]\n" + "\n".join(lines)
        ax.text(g["x"] + 0.3, g["y"] + 1.25, body, va="top", ha="left", fontsize=7, family="monospace",
                color="#1f2937")
    ax.set_title(f"Grafana dashboard \"{dash['title']}\" - panel layout diagram (not a screenshot)", fontsize=12)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dashboard", type=Path, default=DEFAULT_DASHBOARD)
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = ap.parse_args(argv)
    print(render(args.dashboard, args.out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
