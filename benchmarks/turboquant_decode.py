"""Benchmark of TurboQuant decode attention (not a test): vLLM 0.26's `triton_turboquant_decode_attention` (a
program per query head) against the engine's (kernels/turboquant_decode.py, a program per KV head, then vLLM's
stage 2), one layer's decode step.

Llama-3.1-8B head shapes (32 query heads, 8 KV heads, head size 128), bf16 queries, random slots of each preset
in a head-major cache of 32-token blocks (the engine's layout and vLLM's TurboQuant block), shuffled block
tables, 32 KV splits (vLLM's default for CUDA graphs). Each shape is REQUESTSxTOKENS: the default ones are a
DropKV 10% engine at capacity on an H100 (328 requests of about 3,400 tokens), vanilla's (38 of 32K) and a
mid-size batch. Times: triton.testing.do_bench medians over several caches in turn (no L2 reuse), each
checked against the other kernel first; GB/s counts the slot bytes a step must read once.

usage: python benchmarks/turboquant_decode.py [--presets turboquant_4bit_nc ...] [--shapes 328x3400 38x32768]
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the installed layout first

PAGE, HQ, HK, D, SPLITS, CACHES = 32, 32, 8, 128, 32, 3


def case(preset: str, requests: int, tokens: int, seed: int = 0) -> dict:
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
    query = torch.randn(requests, HQ, D, generator=gen).to("cuda", torch.bfloat16) * (0.02 if config.key_fp8 else 1)
    sets = []
    for _ in range(CACHES):  # [blocks, HK, PAGE, S] stored head-major, viewed [blocks, PAGE, HK, S]
        kv = random_slots(config, (requests * pages, HK, PAGE), gen, False).cuda().transpose(1, 2)
        table = torch.randperm(requests * pages, generator=gen).view(requests, pages).to("cuda", torch.int32)
        sets.append((kv, table))
    partials = torch.empty(requests, HQ, SPLITS, D + 1, device="cuda")
    out = torch.empty(requests, HQ, D, dtype=torch.bfloat16, device="cuda")
    lse = torch.empty(requests, HQ, device="cuda")
    turn = iter(range(1 << 62))

    def ours():
        kv, table = sets[next(turn) % CACHES]
        return decode_attention(query, kv, table, seq_lens, config, centroids, rotation.T.contiguous(), D ** -0.5,
                                False, partials, out, lse)

    def vllm():
        kv, table = sets[next(turn) % CACHES]
        return triton_turboquant_decode_attention(
            query, kv, table, seq_lens, rotation, centroids, D ** -0.5, config.key_mse_bits, config.key_packed_size,
            config.effective_value_quant_bits, key_fp8=config.key_fp8, norm_correction=config.norm_correction,
            PiT=rotation.T.contiguous(), max_num_kv_splits=SPLITS)

    kv, table = sets[0]
    expected = triton_turboquant_decode_attention(
        query, kv, table, seq_lens, rotation, centroids, D ** -0.5, config.key_mse_bits, config.key_packed_size,
        config.effective_value_quant_bits, key_fp8=config.key_fp8, norm_correction=config.norm_correction,
        max_num_kv_splits=SPLITS).float()
    got = decode_attention(query, kv, table, seq_lens, config, centroids, rotation.T.contiguous(), D ** -0.5, False,
                           partials, out, lse).float()
    error = float((got - expected).norm() / expected.norm())
    slot_bytes = requests * tokens * HK * config.slot_size_aligned
    times = {name: triton.testing.do_bench(fn, warmup=50, rep=300, return_mode="median")
             for name, fn in (("vllm", vllm), ("ours", ours), ("vllm again", vllm), ("ours again", ours))}
    return dict(preset=preset, requests=requests, tokens=tokens, error_vs_vllm=error, slot_gb=slot_bytes / 1e9,
                **{f"{name} ms": ms for name, ms in times.items()},
                **{f"{name} GB/s": slot_bytes / (ms * 1e-3) / 1e9 for name, ms in times.items()})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--presets", nargs="+", default=["turboquant_4bit_nc", "turboquant_3bit_nc",
                                                         "turboquant_k8v4"])
    parser.add_argument("--shapes", nargs="+", default=["328x3400", "38x32768", "64x8192"],
                        help="REQUESTSxTOKENS per step")
    args = parser.parse_args()
    print(torch.cuda.get_device_name(), flush=True)
    print("| preset | requests x tokens | slot GB | vLLM ms | ours ms | vLLM GB/s | ours GB/s | speed-up | "
          "‖ours − vLLM‖ / ‖vLLM‖ |")
    print("|---|---|---|---|---|---|---|---|---|")
    for preset in args.presets:
        for shape in args.shapes:
            requests, tokens = map(int, shape.split("x"))
            r = case(preset, requests, tokens)
            print(f"| {preset} | {requests} x {tokens} | {r['slot_gb']:.2f} | {r['vllm ms']:.3f} "
                  f"({r['vllm again ms']:.3f}) | {r['ours ms']:.3f} ({r['ours again ms']:.3f}) | "
                  f"{r['vllm GB/s']:.0f} | {r['ours GB/s']:.0f} | {r['vllm ms'] / r['ours ms']:.2f}x | "
                  f"{r['error_vs_vllm']:.1e} |", flush=True)


if __name__ == "__main__":
    main()
