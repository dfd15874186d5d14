"""GPU diagnosis of test_cuda_graphs' block-wise case: the same block-wise / one-shot KeyDiff requests under
eager, compile without graphs, PIECEWISE and FULL_AND_PIECEWISE, with every compaction's kept sets dumped, so
a divergence is traced to compile numerics (kept sets flip on near-ties) or to the graph path: compile
against eager, then PIECEWISE and FULL_AND_PIECEWISE against compile.
  python3 tools/device/diag_chunked_graphs.py OUT_DIR"""
from __future__ import annotations

import gc
import json
import os
import sys

import torch

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"

CASES = {"chunked": {"policy": "keydiff", "budget": 96, "chunked": True, "chunk_size": 64},
         "oneshot": {"policy": "keydiff", "budget": 96}}


def run(model, mode, out):
    from vllm import SamplingParams

    import vllm_evict.engine.compaction as compaction
    from vllm_evict.testing.engines import make_llm

    dump = os.path.join(out, mode)
    os.makedirs(dump, exist_ok=True)
    compaction.DUMP_DIR = dump
    over = {"enforce_eager": True} if mode == "eager" else {
        "compilation_config": {"cudagraph_mode": {"compile": "NONE", "piecewise": "PIECEWISE",
                                                  "full": "FULL_AND_PIECEWISE"}[mode]}}
    llm = make_llm(model, dtype="bfloat16", block_size=16, max_model_len=2048, kv_cache_memory_bytes=1 << 30,
                   max_num_seqs=16, seed=0, **over)
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(3, 1000, (800,), generator=g).tolist()
    names = list(CASES)
    params = [SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=5,
                             extra_args={"vllm_evict": CASES[n]}) for n in names]
    outs = llm.generate([{"prompt_token_ids": prompt}] * len(names), params)
    del llm
    gc.collect()
    torch.cuda.empty_cache()
    return {n: {"tokens": o.outputs[0].token_ids,
                "top": [sorted(lp, key=lambda t: lp[t].rank)[:5] for lp in o.outputs[0].logprobs],
                "req": o.request_id} for n, o in zip(names, outs)}


def main():
    from vllm_evict.testing.tiny_models import ensure_tiny_model

    out = sys.argv[1]
    model = ensure_tiny_model("llama")
    modes = ("eager", "compile", "piecewise", "full")
    results = {m: run(model, m, out) for m in modes}
    # kept sets: the engine dumps <request id>[.c<compaction>].L<layer>.pt (the id with vLLM's suffix)
    import glob

    def dumps(mode, name):
        req = results[mode][name]["req"]
        return {f.split(os.sep)[-1].split(".", 1)[1]: f for f in glob.glob(os.path.join(out, mode, f"{req}[-.]*"))}

    for base, mode in (("eager", "compile"), ("compile", "piecewise"), ("compile", "full")):
        for name in CASES:
            a, b = results[base][name]["tokens"], results[mode][name]["tokens"]
            first = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
            da, db = dumps(base, name), dumps(mode, name)
            diffs = [(k, int((torch.load(da[k]) != torch.load(db[k])).sum())) for k in sorted(da) if k in db]
            print(f"{name:8s} {mode:9s} vs {base:7s}: first differing token {first}; kept-set differences "
                  f"{[d for d in diffs if d[1]][:12]} in {len(diffs)} dumps")
    json.dump(results, open(os.path.join(out, "diag.json"), "w"))


if __name__ == "__main__":
    main()
