"""Benchmark of the window-scoring kernels (not a test).

Times, for Llama-3.1-8B head shapes (H_q 32, H_kv 8, d 128, batch 1, bf16), dropkv (w 8) and
snapkv (w 32) at n = 4K..128K:
  * naive   : kernels.window_scores_naive.naive_torch_scores (bf16 torch, materialises the
              w x n attention matrix and, for dropkv, the w x n x d residual)
  * triton  : kernels.window_scores.window_scores (kernels A + C + B)
  * B only  : kernel B (the scoring pass) alone, on precomputed a / LSE
  * ref32   : vllm_evict.policies.reference_raw_window_scores (fp32, TF32 off)
with triton.testing.do_bench (median, warm-up, inputs rotated across several buffers so that
repeated calls do not hit L2), peak extra memory per call (torch.cuda.max_memory_allocated),
plus the device's measured copy bandwidth (D2D copy, bytes read + written) and FP32/BF16 matmul
rates, and the roofline of the scoring pass: bytes that must move = K (+ V) once + raw out.

usage: python benchmarks/scoring.py [--out scoring.json] [--quick] [--sweep]

--decode-point: instead, the shape of a decode-point compaction batch (6 requests x 32 layers x 8 KV heads
folded into 1,536 heads, 1,152 held tokens each, as the engine scores them at decode budget 1024), with the
held K/V token-major ([n, heads, D] contiguous) and head-major (each head's tokens contiguous), over a
launch grid of kernels A and B.

--adakv-allocation: Ada-KV's page allocation at decode-point shapes (1, 6 and 15 requests x 32 layers of 8 KV
heads, 64 pages of 16 tokens a head, held sets as at a second decode point: 32 to 96 pages a head and 128 tokens
since, padded to the fullest head; DropKV's defaults): the one-launch kernel (kernels.adakv_pages) against the
torch reference it replaces (policies.budget.adakv_pages, ~70 launches), both on the sorted scores the engine
passes, with their outputs compared.

--slot-tables: a decode-point compaction's slot tables at the same shapes (1, 6 and 15 requests x 32 layers x 8
KV heads, 1,152 held tokens a head): the kept tokens' destinations (kernels.compaction_slots against the torch
form engine.compaction.compaction_slots_torch; uniform, 1,024 kept a head over 64 fresh blocks) and the slots of
what each head of an Ada-KV request holds (kernels.held_slots against engine.per_head.held_slots_torch; 32 to 96
pages a head, 128 tokens since), outputs compared.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import math
import os
import sys
import time

import torch

sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the installed layout first

from vllm_evict.kernels import window_scores as ws  # noqa: E402
from vllm_evict.kernels.window_scores_naive import naive_torch_scores  # noqa: E402
from vllm_evict.policies import reference_raw_window_scores as window_scores_reference  # noqa: E402


def _bench(fn, *, warmup=25, rep=100):
    import triton.testing

    return triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median")


def _peak_extra_bytes(fn) -> int:
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = fn()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    del out
    return int(peak)


def measure_copy_bandwidth(nbytes=4 << 30):
    x = torch.empty(nbytes // 2, dtype=torch.bfloat16, device="cuda").normal_()
    y = torch.empty_like(x)
    t = _bench(lambda: y.copy_(x), warmup=50, rep=300)
    del x, y
    torch.cuda.empty_cache()
    return dict(bytes=nbytes, ms=t, tb_s=2 * nbytes / (t * 1e-3) / 1e12)


def measure_matmul(dtype, size=8192):
    a = torch.randn(size, size, device="cuda", dtype=dtype)
    b = torch.randn(size, size, device="cuda", dtype=dtype)
    prev = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        t = _bench(lambda: a @ b, warmup=50, rep=300)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = prev
    del a, b
    torch.cuda.empty_cache()
    return dict(size=size, ms=t, tflop_s=2 * size ** 3 / (t * 1e-3) / 1e12)


def make_sets(n, w, H_q, H_kv, D, count, seed, head_major=False):
    """head_major: keys/values [n, H_kv, D] views of [H_kv, n, D] memory (each head's tokens contiguous)."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    shape = (H_kv, n, D) if head_major else (n, H_kv, D)

    def held():
        x = torch.randn(shape, device="cuda", generator=gen, dtype=torch.float32).to(torch.bfloat16)
        return x.transpose(0, 1) if head_major else x

    sets = []
    for _ in range(count):
        q = torch.randn(w, H_q, D, device="cuda", generator=gen, dtype=torch.float32).to(torch.bfloat16)
        sets.append((q, held(), held()))
    return sets


class Rotor:
    def __init__(self, sets):
        self.sets, self.i = sets, 0

    def next(self):
        s = self.sets[self.i % len(self.sets)]
        self.i += 1
        return s


def bench_case(policy, n, w, *, H_q=32, H_kv=8, D=128, config=None, do_naive=True, do_ref=True, seed=0,
               head_major=False, check=True):
    kv_bytes = n * H_kv * D * 2
    count = max(2, min(8, math.ceil(4 * 50e6 / (2 * kv_bytes))))  # >= 4x L2 across the rotation
    sets = make_sets(n, w, H_q, H_kv, D, count, seed, head_major)
    rot = Rotor(sets)
    res = dict(policy=policy, n=n, w=w, H_q=H_q, H_kv=H_kv, D=D, rotate=count, head_major=head_major)

    def tri():
        q, k, v = rot.next()
        return ws.window_scores(policy, q, k, v, config=config)

    res["triton_ms"] = _bench(tri)
    res["triton_peak_bytes"] = _peak_extra_bytes(tri)

    # kernel B alone, and A (+C) alone
    preps = []
    for q, k, v in sets:
        qb, kb, vb = q[None], k[None], v[None]
        plan = ws._plan(policy, qb, kb, vb, None, "mean", config, None)
        fwd = ws._forward(plan, qb, kb, vb)  # (a, LSE, peak, peak_d2, peak_vd)
        out = torch.empty((1, H_kv, n), device="cuda", dtype=torch.float32)
        preps.append((plan, qb, kb, vb, fwd, out))
    prot = Rotor(preps)

    def score_only():
        plan, qb, kb, vb, fwd, out = prot.next()
        return ws._score(plan, qb, kb, vb, *fwd, out)

    def fwd_only():
        plan, qb, kb, vb, _, _ = prot.next()
        return ws._forward(plan, qb, kb, vb)

    res["score_ms"] = _bench(score_only)
    res["fwd_ms"] = _bench(fwd_only)
    plan = preps[0][0]
    res["precision"] = plan["precision"]
    res["splits"] = plan["splits"]
    res["num_sub_b"] = plan.get("num_sub")
    res["launch"] = plan["lp"]
    need_v = plan["need_v"]
    need_a = plan["need_a"]
    # roofline of kernel B: K (+V) once + the raw output (q, a, LSE are tiny and L2-resident)
    b_bytes = kv_bytes * (2 if need_v else 1) + H_kv * n * 4
    res["score_bytes"] = b_bytes
    res["score_tb_s"] = b_bytes / (res["score_ms"] * 1e-3) / 1e12
    fwd_bytes = kv_bytes * (2 if need_a else 1)
    res["fwd_bytes"] = fwd_bytes
    res["total_bytes"] = b_bytes + fwd_bytes
    res["triton_tb_s"] = res["total_bytes"] / (res["triton_ms"] * 1e-3) / 1e12
    M = H_q * w  # stacked rows over all KV heads
    res["score_flop_qk_bf16"] = 2 * M * n * D
    res["score_flop_av_fp32"] = 2 * M * n * D if need_a else 0
    del preps, prot

    for enabled, name, scorer in ((do_naive, "naive", naive_torch_scores), (do_ref, "ref32", window_scores_reference)):
        if not enabled:
            continue

        def call(scorer=scorer):
            q, k, v = rot.next()
            return scorer(policy, q, k, v)

        try:  # None where the scorer does not fit in memory
            res[f"{name}_ms"] = _bench(call, warmup=10, rep=50)
            res[f"{name}_peak_bytes"] = _peak_extra_bytes(call)
        except torch.OutOfMemoryError:
            res[f"{name}_ms"] = res[f"{name}_peak_bytes"] = None
        torch.cuda.empty_cache()
    # sanity: kernel vs fp32 reference on this set (max relative error), on its first 8 heads under check=False
    q, k, v = sets[0]
    if not check:
        q, k, v = q[:, : 8 * (H_q // H_kv)], k[:, :8], v[:, :8]
    tri_out = ws.window_scores(policy, q, k, v, config=config)
    ref_out = window_scores_reference(policy, q, k, v)
    res["max_rel_err_vs_ref32"] = float(((tri_out - ref_out).abs() / ref_out.abs().clamp_min(1e-30)).max())
    res["nan"] = bool(torch.isnan(tri_out).any())
    del sets, rot
    torch.cuda.empty_cache()
    return res


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="scoring.json")
    ap.add_argument("--quick", action="store_true", help="fewer sizes (smoke run)")
    ap.add_argument("--sweep", action="store_true", help="kernel B / A launch-parameter sweep at 128K")
    ap.add_argument("--decode-point", action="store_true",
                    help="a decode-point batch's shape, token-major against head-major K/V, kernels A/B launch grid")
    ap.add_argument("--adakv-allocation", action="store_true",
                    help="Ada-KV's allocation kernel against its torch reference at decode-point shapes")
    ap.add_argument("--slot-tables", action="store_true",
                    help="a compaction's slot-table kernels against their torch forms at decode-point shapes")
    ap.add_argument("--sweep-b", action="store_true",
                    help="kernel B launch sweep of the default (bf16x3) dropkv at 32K and 128K only")
    args = ap.parse_args()
    import triton

    assert torch.cuda.is_available(), "needs a CUDA GPU"
    props = torch.cuda.get_device_properties(0)
    meta = dict(
        date=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        device=props.name, sms=props.multi_processor_count,
        l2_bytes=getattr(props, "L2_cache_size", None), total_mem=props.total_memory,
        torch=torch.__version__, triton=triton.__version__, cuda=torch.version.cuda,
        command=" ".join([os.path.basename(sys.executable)] + sys.argv),
    )
    t0 = time.time()
    ceil = dict(copy=measure_copy_bandwidth(), fp32_matmul=measure_matmul(torch.float32),
                bf16_matmul=measure_matmul(torch.bfloat16))
    print(f"# {meta['device']} ({meta['sms']} SMs) torch {meta['torch']} triton {meta['triton']}", flush=True)
    print(f"# copy bandwidth {ceil['copy']['tb_s']:.3f} TB/s (read+write); fp32 matmul "
          f"{ceil['fp32_matmul']['tflop_s']:.1f} TFLOP/s; bf16 matmul {ceil['bf16_matmul']['tflop_s']:.1f} TFLOP/s",
          flush=True)

    if args.decode_point:
        return decode_point(args, meta, ceil)
    if args.adakv_allocation:
        return adakv_allocation(args, meta, ceil)
    if args.slot_tables:
        return slot_tables(args, meta, ceil)
    sizes = [4096, 16384, 131072] if args.quick else [4096, 8192, 16384, 32768, 65536, 131072]
    cases = [("dropkv", 8, None), ("snapkv", 32, None),
             ("dropkv", 8, ws.WindowScoreConfig(precision="ieee"))]
    rows = []
    for policy, w, cfg in cases:
        for n in sizes:
            is_alt = cfg is not None
            r = bench_case(policy, n, w, config=cfg, do_naive=not is_alt, do_ref=not is_alt)
            rows.append(r)
            sp = (r["naive_ms"] / r["triton_ms"]) if r.get("naive_ms") else float("nan")
            print(f"{policy:7s} {r['precision']:6s} w={w:2d} n={n:6d} sub={r['num_sub_b']} triton {r['triton_ms']:.4f} ms "
                  f"(A+C {r['fwd_ms']:.4f}, B {r['score_ms']:.4f} = {r['score_tb_s']:.2f} TB/s)  "
                  f"naive {r.get('naive_ms') or float('nan'):.4f} ms  x{sp:.1f}  ref32 "
                  f"{r.get('ref32_ms') or float('nan'):.4f} ms  err {r['max_rel_err_vs_ref32']:.1e}", flush=True)

    C = ws.WindowScoreConfig
    grid = []  # (policy, w, n, label, config)
    if args.sweep_b:
        for n in (32768, 131072):
            for sub, nw, st, mx in ((64, 4, 3, 8), (64, 4, 3, 16), (64, 8, 3, 8), (64, 8, 3, 16), (128, 8, 3, 4),
                                    (128, 8, 3, 8), (64, 4, 4, 16), (32, 4, 3, 16)):
                grid.append(("dropkv", 8, n, f"B sub={sub} warps={nw} stages={st} max_sub={mx}",
                             C(sub_n_b=sub, num_warps_b=nw, num_stages_b=st, max_sub_b=mx)))
    if args.sweep:
        n = 131072
        for prec, bs, As in (
            ("bf16x3", [(64, 4, 3, 8), (64, 4, 4, 8), (64, 2, 3, 8), (128, 4, 3, 4), (64, 4, 3, 16), (64, 4, 3, 32)],
             [(64, 4, 3), (64, 4, 4)]),
            ("ieee", [(64, 4, 2, 8), (64, 4, 3, 8), (32, 2, 2, 16), (64, 2, 2, 8)],
             [(16, 4, 3), (16, 2, 3), (16, 4, 4), (32, 2, 3)]),
        ):
            for sub, nw, st, mx in bs:
                grid.append(("dropkv", 8, n, f"B sub={sub} warps={nw} stages={st} max_sub={mx}",
                             C(precision=prec, sub_n_b=sub, num_warps_b=nw, num_stages_b=st, max_sub_b=mx)))
            for bn, nw, st in As:
                grid.append(("dropkv", 8, n, f"A bn={bn} warps={nw} stages={st}",
                             C(precision=prec, block_n_a=bn, num_warps_a=nw, num_stages_a=st)))
        for sub, nw, st, mx in ((128, 4, 2, 4), (128, 4, 3, 4), (64, 4, 3, 8), (128, 4, 2, 8)):
            grid.append(("snapkv", 32, n, f"B sub={sub} warps={nw} stages={st} max_sub={mx}",
                         C(sub_n_b=sub, num_warps_b=nw, num_stages_b=st, max_sub_b=mx)))
        for bn, nw, st in ((128, 4, 2), (128, 4, 3), (64, 8, 3)):
            grid.append(("snapkv", 32, n, f"A bn={bn} warps={nw} stages={st}",
                         C(block_n_a=bn, num_warps_a=nw, num_stages_a=st)))
        for prec in ("ieee", "bf16x3"):
            grid.append(("obcache-joint", 32, n, "defaults", C(precision=prec)))
    sweep = []
    for policy, w, n, label, cfg in grid:
        r = launch_case(f"sweep {policy} n={n} {cfg.precision} {label}", policy, n, w, config=cfg)
        if r is None:
            continue
        r["label"] = label
        sweep.append(r)
        print(f"sweep {policy:7s} n={n:6d} {r['precision']:6s} {label:38s} B {r['score_ms']:.4f} ms = "
              f"{r['score_tb_s']:.2f} TB/s ({r['score_tb_s'] / ceil['copy']['tb_s']:.0%} of copy); "
              f"A+C {r['fwd_ms']:.4f} (splits {r['splits']}); full {r['triton_ms']:.4f}; "
              f"err {r['max_rel_err_vs_ref32']:.1e}", flush=True)

    # final table
    print("\n| policy | prec | w | n | naive bf16 ms | Triton ms | speedup | kernel B ms | B TB/s | B % copy BW "
          "| ref fp32 ms | naive peak MB | Triton peak MB |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    naive_of = {(r["policy"], r["n"]): r for r in rows if r.get("naive_ms")}
    for r in rows:
        base = naive_of.get((r["policy"], r["n"]), {})
        r.setdefault("naive_ms", base.get("naive_ms"))
        r.setdefault("naive_peak_bytes", base.get("naive_peak_bytes"))
        r.setdefault("ref32_ms", base.get("ref32_ms"))
        sp = r["naive_ms"] / r["triton_ms"] if r.get("naive_ms") else float("nan")
        r["speedup_vs_naive"] = sp
        npk = (r.get("naive_peak_bytes") or float("nan")) / 1e6
        print(f"| {r['policy']} | {r['precision']} | {r['w']} | {r['n']} | {r.get('naive_ms') or float('nan'):.3f} | "
              f"{r['triton_ms']:.4f} | {sp:.1f}x | {r['score_ms']:.4f} | {r['score_tb_s']:.2f} | "
              f"{100 * r['score_tb_s'] / ceil['copy']['tb_s']:.0f}% | {r.get('ref32_ms') or float('nan'):.3f} | "
              f"{npk:.0f} | {r['triton_peak_bytes'] / 1e6:.1f} |")
    print(f"\nelapsed {time.time() - t0:.0f} s")
    with open(args.out, "w") as f:
        json.dump(dict(meta=meta, ceilings=ceil, rows=rows, sweep=sweep), f, indent=1)


def launch_case(label, policy, n, w, **kwargs):
    """bench_case of one launch configuration, without the naive and reference timings; None (and a line
    saying why) for a configuration that does not compile or launch."""
    try:
        return bench_case(policy, n, w, do_naive=False, do_ref=False, **kwargs)
    except Exception as e:  # noqa: BLE001 - a config may not compile
        print(f"{label}: {type(e).__name__}: {e}"[:300], flush=True)
        return None


def decode_point(args, meta, ceil):
    """--decode-point: kernels A + C and B at a decode-point batch's shape, both K/V layouts."""
    C = ws.WindowScoreConfig
    heads, n = 6 * 32 * 8, 1152
    grid = [(None, "defaults")] + [
        (C(sub_n_b=sub, num_warps_b=nw, num_stages_b=st, max_sub_b=mx), f"B sub={sub} warps={nw} stages={st} max_sub={mx}")
        for sub, nw, st, mx in ((64, 4, 3, 2), (64, 4, 3, 4), (64, 8, 3, 8), (128, 8, 3, 4), (32, 4, 3, 8),
                                (64, 4, 2, 8), (64, 4, 4, 8), (128, 4, 3, 2))] + [
        (C(block_n_a=bn, num_warps_a=nw, num_stages_a=st), f"A bn={bn} warps={nw} stages={st}")
        for bn, nw, st in ((32, 4, 3), (128, 4, 3), (128, 8, 3), (64, 8, 4), (64, 4, 2))]
    rows = []
    for policy, w in (("dropkv", 8), ("snapkv", 32)):
        for head_major in (False, True):
            for cfg, label in grid if policy == "dropkv" and head_major else grid[:1]:  # the engine's layout swept
                r = launch_case(f"{policy} {label}", policy, n, w, H_q=4 * heads, H_kv=heads, config=cfg,
                                head_major=head_major, check=False)
                if r is None:
                    continue
                r["label"] = label
                rows.append(r)
                print(f"{policy:7s} {'head-major' if head_major else 'token-major':11s} {label:36s} "
                      f"A+C {r['fwd_ms']:.4f} ms  B {r['score_ms']:.4f} ms = {r['score_tb_s']:.2f} TB/s  "
                      f"full {r['triton_ms']:.4f} ms  sub={r['num_sub_b']}  err {r['max_rel_err_vs_ref32']:.1e}",
                      flush=True)
    with open(args.out, "w") as f:
        json.dump(dict(meta=meta, ceilings=ceil, rows=rows), f, indent=1)


def against_reference(kernel, reference) -> dict:
    """A kernel call and its torch reference (no arguments): outputs equal, and each one's median ms."""
    return dict(equal=bool(torch.equal(kernel(), reference())), kernel_ms=_bench(kernel), torch_ms=_bench(reference))


def second_point_pages(shape: tuple, pages: int, gen: torch.Generator) -> torch.Tensor:
    """Pages per head [..., H] int64 as Ada-KV gives them at a first decode point of `pages` a head on average:
    32 to 96 for 64, at most the layer's total."""
    share = 0.5 + torch.rand(*shape, device="cuda", generator=gen)
    return (share / share.mean(dim=-1, keepdim=True) * pages).floor().clamp(max=1.5 * pages).to(torch.int64)


def adakv_allocation(args, meta, ceil):
    from vllm_evict.kernels.adakv_pages import adakv_pages_fused
    from vllm_evict.policies import EvictionConfig
    from vllm_evict.policies.budget import adakv_pages

    config = EvictionConfig.from_dict({"policy": "dropkv", "budget": 1024, "allocation": "adakv"})
    heads, page_size, pages, since = 8, 16, 64, 128
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for requests in (1, 6, 15):
        layers = 32 * requests
        # held sets as at a second decode point: the pages Ada-KV gave each head at the first and 128 tokens
        # since; padded to the fullest head
        lengths = second_point_pages((layers, heads), pages, gen) * page_size + since
        n = int(lengths.max())
        scores = torch.randn(layers, heads, n, device="cuda", generator=gen)
        scores[torch.arange(n, device="cuda") >= lengths.unsqueeze(-1)] = float("-inf")
        ordered = scores.sort(dim=-1, descending=True, stable=True).values
        terms = dict(page_size=page_size, alpha=config.alpha, max_protected=config.protected_count(n), lengths=lengths)
        row = dict(requests=requests, layers=layers, heads=heads, n=n, pages=pages, **against_reference(
            lambda: adakv_pages_fused(ordered, pages, **terms),
            lambda: adakv_pages(ordered, pages, sorted_scores=ordered, **terms)))
        rows.append(row)
        print(f"adakv allocation {requests:2d} requests ({layers} x {heads} x {n}): kernel {row['kernel_ms']:.4f} ms, "
              f"torch {row['torch_ms']:.4f} ms, equal {row['equal']}", flush=True)
    with open(args.out, "w") as f:
        json.dump(dict(meta=meta, ceilings=ceil, adakv_allocation=rows), f, indent=1)


def slot_tables(args, meta, ceil):
    from vllm_evict.engine.compaction import compaction_slots_torch
    from vllm_evict.engine.per_head import held_slots_torch
    from vllm_evict.kernels.compaction_slots import compaction_slots_fused
    from vllm_evict.kernels.held_slots import held_slots_fused

    layers, heads, page_size, pages, since, held_width = 32, 8, 16, 64, 128, 1152
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for requests in (1, 6, 15):
        # uniform: 1,024 of 1,152 held tokens kept a head, laid out over each request's 64 fresh blocks
        order = torch.rand(requests, layers, heads, held_width, device="cuda", generator=gen).argsort(dim=-1)
        keep = order < pages * page_size
        counts = torch.full((requests, layers, heads), pages, dtype=torch.int64, device="cuda")
        fresh = torch.randperm(100_000, device="cuda", generator=gen)[: requests * pages].view(requests, pages)
        # the torch form's transposed result was copied contiguous for the write (the kernel writes it so)
        destinations = (compaction_slots_fused, lambda *a: compaction_slots_torch(*a).contiguous(),
                        (keep, counts, fresh, page_size))
        # Ada-KV at its next point: the pages of its first, its kept tokens, then 128 since
        head_counts = second_point_pages((requests, layers, heads), pages, gen)
        kept = head_counts * page_size - torch.randint(0, page_size, head_counts.shape, device="cuda", generator=gen)
        held = kept + since
        row_blocks = torch.randperm(100_000, device="cuda", generator=gen)[: requests * (pages + 16)]
        spans = torch.full((requests,), pages, dtype=torch.int64, device="cuda")
        held_args = (head_counts, held, spans, row_blocks.view(requests, -1).to(torch.int64), int(held.max()),
                     page_size)
        for name, (kernel, reference, inputs) in (("compaction_slots", destinations),
                                                  ("held_slots", (held_slots_fused, held_slots_torch, held_args))):
            row = dict(table=name, requests=requests, layers=layers, heads=heads, tokens=held_width,
                       **against_reference(lambda: kernel(*inputs), lambda: reference(*inputs)))
            rows.append(row)
            print(f"{name} {requests:2d} requests: kernel {row['kernel_ms']:.4f} ms, torch {row['torch_ms']:.4f} ms, "
                  f"equal {row['equal']}", flush=True)
    with open(args.out, "w") as f:
        json.dump(dict(meta=meta, ceilings=ceil, slot_tables=rows), f, indent=1)


if __name__ == "__main__":
    main()
