"""Speculative decoding beside eviction on a GPU: one vllm-evict engine serving a real model's configuration
with a draft of one layer (both dummy weights), plain, one-shot evicting and decode-budget requests in one
batch, all submitted at once. Checks that every request finishes without an error and prints the wall time,
the output tokens per second and the drafts accepted. Dummy weights accept few drafts, so this checks the
path (co-compaction of the draft's KV cache, CUDA graphs), not speculation's speed-up. It runs under
synchronous scheduling, which decode budgets with speculation need (the engine refuses them under vLLM's
asynchronous scheduling, DESIGN.md §4.8 g). The draft (--method): an EAGLE layer of the target's shape, an
EAGLE3 layer (GPT-OSS), or the model's own MTP layer (Qwen3-Next).

  python benchmarks/speculative.py --config llama-3.1-8b --batch 48 --prompt-len 8192 --max-tokens 512
  python benchmarks/speculative.py --config gpt-oss-20b --method eagle3
  python benchmarks/speculative.py --config qwen3-next-80b-a3b-64e --method mtp
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

CASES = [None, {"policy": "dropkv", "budget": 0.1},
         {"policy": "dropkv", "decode_budget": 1024, "decode_every": 128}]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="llama-3.1-8b", help="a name of tiny_models.REAL_CONFIGS")
    ap.add_argument("--batch", type=int, default=48, help="requests, a third of each kind")
    ap.add_argument("--prompt-len", type=int, default=8192)
    ap.add_argument("--max-tokens", type=int, default=512)
    ap.add_argument("--draft-tokens", type=int, default=3)
    ap.add_argument("--method", default="eagle", choices=("eagle", "eagle3", "mtp"), help="vLLM's speculative method")
    ap.add_argument("--workdir", default="/tmp/vllm-evict-bench")
    ap.add_argument("--out", default=None, help="write the result as JSON here")
    args = ap.parse_args()

    import torch
    from vllm import LLM, SamplingParams

    from vllm_evict.engine import eviction_report, engine_kwargs
    from vllm_evict.testing.engines import gpu_defaults
    from vllm_evict.testing.tiny_models import tiny_eagle3_draft, tiny_eagle_draft, tiny_mtp_model, write_real_config

    model = write_real_config(args.config, Path(args.workdir))
    speculation = {"method": args.method, "num_speculative_tokens": args.draft_tokens,
                   "draft_load_config": {"load_format": "dummy"}}
    if args.method == "mtp":  # the target's own checkpoint, its config asking for the MTP layer
        model = tiny_mtp_model(model)
    else:
        speculation["model"] = str((tiny_eagle3_draft if args.method == "eagle3" else tiny_eagle_draft)(model))
    started = time.time()
    llm = LLM(**engine_kwargs(**gpu_defaults(), model=str(model), load_format="dummy", dtype="bfloat16",
                              gpu_memory_utilization=0.9, block_size=16, seed=0, disable_log_stats=False,
                              max_model_len=args.prompt_len + args.max_tokens + 64, speculative_config=speculation,
                              async_scheduling=False))
    start_s = time.time() - started
    gen = torch.Generator().manual_seed(0)
    prompts = [{"prompt_token_ids": torch.randint(3, 1000, (args.prompt_len,), generator=gen).tolist()}
               for _ in range(args.batch)]
    cases = [CASES[i % len(CASES)] for i in range(args.batch)]
    params = [SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True,
                             extra_args={"vllm_evict": case} if case else None) for case in cases]

    def counters() -> dict[str, float]:
        return {m.name: m.value for m in llm.get_metrics()
                if m.name in ("vllm:spec_decode_num_draft_tokens", "vllm:spec_decode_num_accepted_tokens")}

    before = counters()
    t0 = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - t0
    after = counters()
    finish = [out.outputs[0].finish_reason for out in outputs]
    reports = [eviction_report(out) for out in outputs]
    result = {
        "config": args.config, "batch": args.batch, "prompt_len": args.prompt_len, "max_tokens": args.max_tokens,
        "speculation": {k: v for k, v in speculation.items() if k != "model"}, "engine_start_s": round(start_s, 1),
        "wall_s": round(wall, 2),
        "output_tok_s": round(sum(len(out.outputs[0].token_ids) for out in outputs) / wall, 1),
        "finish_reasons": {reason: finish.count(reason) for reason in set(finish)},
        "evicted": sum(1 for r in reports if r), "decode_compactions": sum((r or {}).get("decode_compactions", 0)
                                                                          for r in reports),
        **{name.split(":")[1]: after[name] - before.get(name, 0) for name in after},
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }
    print(json.dumps(result), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
    if set(finish) != {"length"}:
        raise SystemExit(f"requests did not all finish: {result['finish_reasons']}")


if __name__ == "__main__":
    main()
