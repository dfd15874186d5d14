"""Benchmark of TurboQuant decode attention (not a test): vLLM 0.26's `triton_turboquant_decode_attention` (a
program per query head) against the engine's on 4-bit presets (kernels/turboquant_decode.py, a program per KV
head, then vLLM's stage 2), one layer's decode step.

Llama-3.1-8B head shapes (32 query heads, 8 KV heads, head size 128), bf16 queries, random `turboquant_4bit_nc`
slots in a head-major cache of 32-token blocks (the engine's layout and vLLM's TurboQuant block), shuffled block
tables, 32 KV splits (vLLM's default for CUDA graphs). Each shape is REQUESTSxTOKENS: the default ones are a
DropKV 10% engine at capacity on an H100 (328 requests of about 3,400 tokens), vanilla's (38 of 32K) and a
mid-size batch. Each launch of the engine's stage 1 (BLOCK_NxNUM_WARPS; the first is the engine's own) is checked
against vLLM's output, then timed. Times: triton.testing.do_bench medians over several caches in turn
(no L2 reuse), each twice; GB/s counts the slot bytes a step must read once.

usage: python benchmarks/turboquant_decode.py [--shapes 328x3400 38x32768] [--launches 32x4 64x4 ...]
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys

import torch

sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the installed layout first

from vllm_evict.kernels.turboquant_decode import BLOCK_N, NUM_WARPS  # noqa: E402

PAGE, HQ, HK, D, SPLITS, CACHES = 32, 32, 8, 128, 32, 3


def case(preset: str, requests: int, tokens: int, launches: list[str], seed: int = 0) -> dict:
    import triton.testing
    from vllm.model_executor.layers.quantization.turboquant.centroids import get_centroids
    from vllm.model_executor.layers.quantization.turboquant.config import TurboQuantConfig
    from vllm.v1.attention.backends.turboquant_attn import _build_hadamard
    from vllm.v1.attention.ops.triton_turboquant_decode import triton_turboquant_decode_attention

    from vllm_evict.engine.turboquant_backend import decode_attention
    from vllm_evict.testing.turboquant import random_slots

    gen = torch.Generator().manual_seed(seed)
    config = TurboQuantConfig.from_cache_dtype(preset, D)
    centroids = get_centroids(D, config.centroid_bits).float().cuda()
    rotation = _build_hadamard(D, "cuda")
    pages = -(-tokens // PAGE)
    seq_lens = torch.full((requests,), tokens, dtype=torch.int32, device="cuda")
    query = torch.randn(requests, HQ, D, generator=gen).to("cuda", torch.bfloat16)
    sets = []
    for _ in range(CACHES):  # [blocks, HK, PAGE, S] stored head-major, viewed [blocks, PAGE, HK, S]
        kv = random_slots(config, (requests * pages, HK, PAGE), gen, False).cuda().transpose(1, 2)
        table = torch.randperm(requests * pages, generator=gen).view(requests, pages).to("cuda", torch.int32)
        sets.append((kv, table))
    partials = torch.empty(requests, HQ, SPLITS, D + 1, device="cuda")
    out = torch.empty(requests, HQ, D, dtype=torch.bfloat16, device="cuda")
    lse = torch.empty(requests, HQ, device="cuda")

    def ours(kv, table, launch):
        return decode_attention(query, kv, table, seq_lens, config, centroids, rotation.T.contiguous(), D ** -0.5,
                                partials, out, lse, **launch_arguments(launch))

    def vllm(kv, table):
        return triton_turboquant_decode_attention(
            query, kv, table, seq_lens, rotation, centroids, D ** -0.5, config.key_mse_bits, config.key_packed_size,
            config.effective_value_quant_bits, key_fp8=config.key_fp8, norm_correction=config.norm_correction,
            PiT=rotation.T.contiguous(), max_num_kv_splits=SPLITS)

    def median_ms(fn):  # each call on the next cache set
        turn = itertools.count()
        return triton.testing.do_bench(lambda: fn(*sets[next(turn) % CACHES]), warmup=50, rep=300,
                                       return_mode="median")

    expected = vllm(*sets[0]).float()
    slot_bytes = requests * tokens * HK * config.slot_size_aligned
    row = dict(slot_gb=slot_bytes / 1e9, vllm_ms=[median_ms(vllm), median_ms(vllm)], launches={})
    for launch in launches:
        got = ours(*sets[0], launch).float()
        timed = [median_ms(lambda kv, table: ours(kv, table, launch)) for _ in range(2)]
        row["launches"][launch] = dict(
            ms=timed, error_vs_vllm=float((got - expected).norm() / expected.norm()))
    return row


def launch_arguments(launch: str) -> dict:
    """decode_partials' launch arguments of BLOCK_NxNUM_WARPS."""
    block_n, num_warps = map(int, launch.split("x"))
    return dict(block_n=block_n, num_warps=num_warps)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", nargs="+", default=["328x3400", "38x32768", "64x8192"],
                        help="REQUESTSxTOKENS per step")
    parser.add_argument("--launches", nargs="+", default=[f"{BLOCK_N}x{NUM_WARPS}", "32x1", "16x2", "32x4"],
                        help="BLOCK_NxNUM_WARPS of the engine's stage 1 (the first: the engine's own)")
    args = parser.parse_args()
    print(torch.cuda.get_device_name(), flush=True)
    print("| preset | requests x tokens | slot GB | vLLM ms (again) | launch | ours ms (again) | vLLM GB/s | ours GB/s "
          "| speed-up | ‖ours − vLLM‖ / ‖vLLM‖ |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    preset = "turboquant_4bit_nc"
    for shape in args.shapes:
        requests, tokens = map(int, shape.split("x"))
        r = case(preset, requests, tokens, args.launches)
        gb, (vllm_ms, vllm_again) = r["slot_gb"], r["vllm_ms"]
        for launch, m in r["launches"].items():
            ms, again = m["ms"]
            print(f"| {preset} | {requests} x {tokens} | {gb:.2f} | {vllm_ms:.3f} ({vllm_again:.3f}) | {launch} "
                  f"| {ms:.3f} ({again:.3f}) | {gb / vllm_ms * 1e3:.0f} | {gb / ms * 1e3:.0f} "
                  f"| {vllm_ms / ms:.2f}x | {m['error_vs_vllm']:.1e} |", flush=True)


if __name__ == "__main__":
    main()
