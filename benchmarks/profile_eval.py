"""Where one quality-eval engine spends its time (SmolLM2, one 4K sample, every setting): wall time per
policy group and the top GPU operators of one group under torch.profiler. Not a unit test.

  python benchmarks/profile_eval.py MODEL_DIR [LENGTH]
"""

from __future__ import annotations

import os
import sys
import time

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # engine in-process: the profiler sees the worker


def main() -> None:
    import torch
    from transformers import AutoTokenizer

    from vllm_evict.bench.eval import EvalConfig, engine_arguments, make_llm, make_settings, run_requests
    from vllm_evict.bench.ruler import generate_samples

    model_dir, length = sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 4096
    tok = AutoTokenizer.from_pretrained(model_dir)
    samples = generate_samples(["passkey"], [length], 3, tok, seed=0)
    cfg = EvalConfig(model=model_dir, kv_cache_memory_bytes=6_000_000_000, gpu_memory_utilization=0.05)
    llm = make_llm(engine_arguments(cfg, model_dir, samples))
    settings = make_settings(cfg)
    t0 = time.time()
    run_requests(llm, [(st, samples[0]) for st in settings], False)
    print(f"warm-up: {len(settings)} settings of one sample in {time.time() - t0:.1f} s", flush=True)
    groups: dict[str, list] = {}
    for st in settings:
        groups.setdefault(f"{st.variant}|{st.policy}", []).append(st)
    for name, sts in groups.items():
        t0 = time.time()
        run_requests(llm, [(st, samples[1]) for st in sts], False)
        print(f"{name:28s} {len(sts):2d} requests {1e3 * (time.time() - t0) / len(sts):8.1f} ms/request", flush=True)
    for name in ("aware|snapkv", "aware|dropkv"):
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                torch.profiler.ProfilerActivity.CUDA]) as prof:
            run_requests(llm, [(st, samples[2]) for st in groups[name]], False)
        print(name)
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=22, max_name_column_width=60))


if __name__ == "__main__":
    main()
