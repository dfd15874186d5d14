"""GPU checks of the eviction engine (vLLM 0.26, FlashAttention per-head path). Not a unit test.

  exactness: a Llama-3.1-8B-shaped model (32 q / 8 kv heads, d=128, hidden 4096) cut to a few layers,
             random bf16 weights saved to disk so an independent torch reference can load them. vLLM
             generates with eviction; the reference decodes with the SAME kept sets (dumped by the engine),
             attending only to kept + new tokens at original positions. bf16 kernels differ from the fp32
             reference, so tokens are compared like vLLM's own `check_logprobs_close`: equal until the first
             divergence, where each side's token must be in the other's top-5. Kept sets are also compared
             with the reference's own selection on fp32 scores (agreement reported, not asserted).

Capacity, throughput and latency against vanilla vLLM: benchmarks/serving.py.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import time
from pathlib import Path

import torch


def build_llama8b_shaped(path: Path, layers: int, seed: int = 0) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    from vllm_evict.testing.tiny_models import REAL_CONFIGS, _build_tokenizer

    if (path / "READY").exists():
        return path
    cfg = dict(REAL_CONFIGS["llama-3.1-8b"])
    cfg.update(num_hidden_layers=layers, vocab_size=2048, max_position_embeddings=16384, torch_dtype="bfloat16")
    cfg.pop("architectures"), cfg.pop("model_type")
    tok = _build_tokenizer(vocab_size=1024)
    cfg["bos_token_id"], cfg["eos_token_id"] = tok.bos_token_id, tok.eos_token_id
    torch.manual_seed(seed)
    with torch.device("cuda"):
        model = LlamaForCausalLM(LlamaConfig(**cfg)).to(torch.bfloat16)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    (path / "READY").write_text("ok")
    del model
    torch.cuda.empty_cache()
    return path


def logprobs_close(engine_out, ref):
    """Tokens equal until the first divergence; there each token must be in the other's top-5."""
    got = list(engine_out.outputs[0].token_ids)
    for i, (a, b) in enumerate(zip(got, ref.token_ids)):
        if a != b:
            ok = a in ref.top5[i] and b in engine_out.outputs[0].logprobs[i]
            return i, ok
    return len(got), True


def run_exactness(args) -> dict:
    from vllm import LLM, SamplingParams

    from vllm_evict.engine import engine_kwargs
    from vllm_evict.policies import EvictionConfig, score_tokens, select_tokens
    from vllm_evict.testing.reference import ReferenceDecoder

    model_dir = build_llama8b_shaped(Path(args.workdir) / "llama8b-shaped", args.layers)
    dump = Path(args.workdir) / "keep"
    dump.mkdir(parents=True, exist_ok=True)
    os.environ["VLLM_EVICT_DUMP_KEEP"] = str(dump)
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(3, 1000, (args.prompt_len,), generator=g).tolist()
    cases = [{"policy": p, "budget": 0.1, "allocation": a}
             for p in ("dropkv", "snapkv", "keydiff", "obcache-joint", "caote", "streaming")
             for a in ("uniform", "adakv") if not (p == "streaming" and a == "adakv")]
    llm = LLM(**engine_kwargs(model=str(model_dir), dtype="bfloat16", block_size=16, max_model_len=8192,
                              gpu_memory_utilization=0.5, max_num_batched_tokens=512, seed=0))
    sp = [SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True, logprobs=5,
                         extra_args={"vllm_evict": c}) for c in cases]
    t0 = time.time()
    outs = llm.generate([{"prompt_token_ids": prompt}] * len(cases), sp)
    gen_s = time.time() - t0
    plain = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0, max_tokens=args.max_tokens,
                                                                       ignore_eos=True, logprobs=5))[0]
    del llm
    gc.collect()
    torch.cuda.empty_cache()
    ref = ReferenceDecoder(model_dir, dtype=torch.float32, device="cuda")
    prefill = ref.prefill(prompt)
    results = []
    full = ref.generate(prompt, args.max_tokens, prefill=prefill)
    n_match, ok = logprobs_close(plain, full)
    results.append({"case": "no eviction", "matched_tokens": n_match, "close": ok})
    for case, out in zip(cases, outs):
        req_id = out.request_id
        files = [p for p in dump.glob("*.L*.pt") if p.name.rsplit(".L", 1)[0] in (req_id,)
                 or p.name.rsplit(".L", 1)[0].startswith(req_id + "-")]
        files.sort(key=lambda p: int(p.name.rsplit(".L", 1)[1][:-3]))
        keeps = [torch.load(f) for f in files]
        expected = ref.generate(prompt, args.max_tokens, prefill=prefill, keep_override=keeps)
        n_match, ok = logprobs_close(out, expected)
        cfg = EvictionConfig.from_dict(case)
        agree = []
        for (q, k, v), keep in zip(prefill[0], keeps):
            w = cfg.window_size()
            scores = score_tokens(cfg.policy, q[-w:] if w else q[:0], k, v, scale=ref.scale, **cfg.score_options())
            own = select_tokens(scores, cfg.budget, page_size=16, **cfg.select_options()).cpu()
            agree.append(float((own & keep).sum() / keep.sum()))
        results.append({"case": case, "matched_tokens": n_match, "close": ok, "layers": len(keeps),
                        "kept_set_agreement_vs_fp32_reference": round(sum(agree) / len(agree), 4),
                        "report": out.kv_transfer_params.get("vllm_evict") if out.kv_transfer_params else None})
    return {"prompt_len": args.prompt_len, "max_tokens": args.max_tokens, "generate_s": round(gen_s, 2),
            "results": results}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("mode", choices=["exactness"])
    ap.add_argument("--workdir", default="/tmp/vllm-evict-gpu")
    ap.add_argument("--out", default=None)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--prompt-len", type=int, default=2000)
    ap.add_argument("--max-tokens", type=int, default=32)
    args = ap.parse_args()
    result = run_exactness(args)
    result.update(device=torch.cuda.get_device_name(), date=time.strftime("%Y-%m-%d"))
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
