"""DESIGN.md §5 qualification of the window kernels' precision modes (GPU): error against the fp64 reference.

For each policy with an fp32-operand dot, each n and each input kind (regular: max p ~0.9; peaked: p > 0.99,
the attention-sink case where d^2 = ||a||^2 + ||v||^2 - 2<a,v> cancels), prints the max relative error of
ieee, bf16x3 (the default for bf16 inputs, with the exact d^2 of each row's peak key) and bf16x3 without that
correction, against the fp64 and the fp32 reference, and the worst ratio of the error to the peaked test's
conditioning-scaled bound (tests/kernels/test_window_scores.py). Also which kernel the error comes from:
kernel A (a, LSE) and kernel B run in different precisions.

    python3 benchmarks/precision_check.py [--out precision.json]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
from pathlib import Path

import torch

from vllm_evict.kernels import window_scores as ws
from vllm_evict.policies import reference_raw_window_scores

# the kernel tests' input generator and helpers, loaded by path (vllm_evict stays the installed layout)
_spec = importlib.util.spec_from_file_location(
    "kernel_tests", Path(__file__).resolve().parents[1] / "tests" / "kernels" / "test_window_scores.py")
_tests = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_tests)
DEFAULTS, _max_p, _seed, make_inputs = _tests.DEFAULTS, _tests._max_p, _tests._seed, _tests.make_inputs


def run(policy, q, k, v, *, a_prec: str, b_prec: str, track_peak: bool | None = None):
    """Kernels A+C in a_prec, kernel B in b_prec (and the peak correction forced on or off)."""
    qb, kb, vb = q[None], k[None], v[None]
    plan_a = ws._plan(policy, qb, kb, vb, None, "mean", ws.WindowScoreConfig(precision=a_prec))
    plan_b = ws._plan(policy, qb, kb, vb, None, "mean", ws.WindowScoreConfig(precision=b_prec))
    if track_peak is not None:
        plan_a["track_peak"] = plan_b["track_peak"] = track_peak
    plan_b["track_peak"] = plan_b["track_peak"] and plan_a["track_peak"]
    fwd = ws._forward(plan_a, qb, kb, vb)
    out = torch.full((1, k.shape[1], k.shape[0]), float("nan"), device="cuda")
    ws._score(plan_b, qb, kb, vb, *fwd, out)
    torch.cuda.synchronize()
    return out[0]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="precision.json")
    ap.add_argument("--sizes", type=int, nargs="+", default=[1000, 8192, 32768])
    args = ap.parse_args()
    variants = {
        "ieee": dict(a_prec="ieee", b_prec="ieee"),
        "bf16x3": dict(a_prec="bf16x3", b_prec="bf16x3"),
        "bf16x3-nocorr": dict(a_prec="bf16x3", b_prec="bf16x3", track_peak=False),
        "A-ieee/B-bf16x3-nocorr": dict(a_prec="ieee", b_prec="bf16x3", track_peak=False),
        "A-bf16x3/B-ieee": dict(a_prec="bf16x3", b_prec="ieee", track_peak=False),
    }
    rows = []
    for policy in ("dropkv", "obcache-key", "obcache-joint"):
        w, _ = DEFAULTS[policy]
        for kind, heavy in (("regular", 0.5), ("peaked", 1.5)):
            for n in args.sizes:
                q, k, v = make_inputs(n, w, 32, 8, 128, seed=_seed("precision", policy, kind, n), heavy=heavy)
                ref64 = reference_raw_window_scores(policy, q, k, v, dtype=torch.float64).double()
                ref32 = reference_raw_window_scores(policy, q, k, v).double()
                pmax = _max_p(q, k).double()
                bound = 1e-3 + 2.0 / (1.0 - pmax).clamp_min(1e-6) * 1e-5  # the peaked test's rtol

                def rel(x, ref):
                    return float(((x - ref).abs() / ref.abs().clamp_min(1e-30)).max())

                def worst(x, ref):
                    return float(((x - ref).abs() / (bound * ref.abs() + 1e-30)).max())

                row = dict(policy=policy, kind=kind, n=n, max_p=float(pmax.max()),
                           ref32_vs_64=rel(ref32, ref64), ref32_bound=worst(ref32, ref64))
                for name, kw in variants.items():
                    tri = run(policy, q, k, v, **kw).double()
                    row[name] = dict(vs64=rel(tri, ref64), vs32=rel(tri, ref32), bound64=worst(tri, ref64),
                                     bound32=worst(tri, ref32), nan=bool(torch.isnan(tri).any()))
                rows.append(row)
                cells = "  ".join(f"{name} {c['vs64']:.1e}/{c['bound64']:.2f}/{c['bound32']:.2f}"
                                  for name, c in ((name, row[name]) for name in variants))
                print(f"{policy:13s} {kind:7s} n={n:6d} maxp={row['max_p']:.5f} ref32 {row['ref32_vs_64']:.1e}"
                      f"/{row['ref32_bound']:.2f}  {cells}", flush=True)
    Path(args.out).write_text(json.dumps(dict(device=torch.cuda.get_device_name(0), rows=rows), indent=1))
    print("columns: max rel err vs fp64 / worst err over the peaked bound vs fp64 / same vs fp32 (pass <= 1)")


if __name__ == "__main__":
    main()
