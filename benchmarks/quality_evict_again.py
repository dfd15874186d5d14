"""Quality of evicting again (docs/DESIGN.md §4.8) on SmolLM2-135M-Instruct, through the real engine.

* **Perplexity under block-wise eviction** (the StreamingLLM evaluation): a long real text that ships
  offline, concatenated CPython standard-library sources of this interpreter, cut to --ppl-tokens tokens,
  is scored with `prompt_logprobs` once with the full cache and once per (policy, budget) with
  `chunked=true` (the prompt is evicted block-wise while it is prefilled, so each chunk's tokens are
  predicted from what the budget kept). Perplexity over all positions and over those past the budget.
* **Generation fidelity under decode-time eviction:** greedy tokens of a short chat prompt, --gen-tokens
  generated (ignore_eos), with `decode_budget` K_d per policy, against the full cache: the first
  divergence and the share of positions with the same token.
* **A decode policy:** a chat prompt holding --context-tokens of the same sources and a request to explain
  them, evicted at its end by --request-policy at --request-budget (the question's queries score it), then
  --gen-tokens generated under each decode budget with each --decode-policies at the decode points
  (`decode_policy`), against the full cache and against the prompt's eviction alone.

    python benchmarks/quality_evict_again.py --out-dir docs/quality     # CPU: ~15-30 min on 2 cores
    python benchmarks/quality_evict_again.py --parts decode-policy --name evict_again_decode_policy

Writes NAME.json (config, environment, every row) and NAME.md (tables), and NAME.png (perplexity per
policy and budget) when perplexity ran; NAME is --name (default evict_again).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import sysconfig
import time
from pathlib import Path

STDLIB_FILES = ("argparse.py", "collections/__init__.py", "json/decoder.py", "inspect.py", "textwrap.py",
                "dataclasses.py", "functools.py", "heapq.py", "bisect.py", "shlex.py")
EXPLAIN_PROMPT = "Explain what the code above does, function by function, in detail."
GEN_PROMPT = ("Write a long, detailed story about a lighthouse keeper who finds a message in a bottle. "
              "Describe the island, the weather, the keeper's daily routine and every person the keeper meets.")


PARTS = ("perplexity", "fidelity", "decode-policy")


def stdlib_text() -> str:
    root = Path(sysconfig.get_paths()["stdlib"])
    return "\n\n".join((root / name).read_text() for name in STDLIB_FILES)


def agreement(got: list[int], reference: list[int], suffix: str = "") -> dict:
    """`first_divergence`: the first index where `got` differs from `reference` (its length if nowhere);
    `agreement`: the share of equal positions (each key with `suffix`)."""
    first = next((i for i, (a, b) in enumerate(zip(got, reference)) if a != b), len(reference))
    return {"first_divergence" + suffix: first,
            "agreement" + suffix: round(sum(a == b for a, b in zip(got, reference)) / len(reference), 4)}


def markdown_table(rows: list[dict], row_key: str, column_key: str, header: str, column_label, cell) -> list[str]:
    """A table with a line per value of row_key (in first-seen order) and a column per value of column_key
    (sorted): `cell(row)` of the row holding both."""
    columns = sorted({r[column_key] for r in rows})
    grid: dict = {}
    for r in rows:
        grid.setdefault(r[row_key], {})[r[column_key]] = r
    lines = [f"| {header} | " + " | ".join(column_label(c) for c in columns) + " |", "|---|" + "---|" * len(columns)]
    for key, by_column in grid.items():
        lines.append(f"| {key} | " + " | ".join(cell(by_column[c]) for c in columns) + " |")
    return lines


def perplexity(logprobs: list[float]) -> float:
    return math.exp(-sum(logprobs) / len(logprobs))


def prompt_logprobs(output, token_ids: list[int]) -> list[float]:
    """Log-probability of each prompt token after the first."""
    return [step[token].logprob for step, token in zip(output.prompt_logprobs[1:], token_ids[1:])]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out-dir", default="docs/quality")
    ap.add_argument("--ppl-tokens", type=int, default=4096)
    ap.add_argument("--ppl-budgets", type=int, nargs="+", default=[1024, 2048])
    ap.add_argument("--chunk-size", type=int, default=128)
    ap.add_argument("--gen-tokens", type=int, default=2048)
    ap.add_argument("--decode-budgets", type=int, nargs="+", default=[256, 512, 1024])
    ap.add_argument("--policies", nargs="+", default=None, help="default: every registered policy")
    ap.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS))
    ap.add_argument("--name", default="evict_again", help="stem of the output files")
    ap.add_argument("--context-tokens", type=int, default=1024)
    ap.add_argument("--request-policy", default="snapkv")
    ap.add_argument("--request-budget", type=float, default=0.25)
    ap.add_argument("--decode-policies", nargs="+", default=["snapkv", "dropkv", "keydiff", "tova", "streaming"])
    args = ap.parse_args()

    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from vllm import SamplingParams

    from vllm_evict.models import prepare_smollm2
    from vllm_evict.policies import POLICIES
    from vllm_evict.testing.engines import make_llm

    policies = args.policies or list(POLICIES)
    model = prepare_smollm2()
    started = time.time()
    llm = make_llm(str(model), dtype="float32", block_size=16, kv_cache_memory_bytes=1 << 30,
                   max_model_len=max(args.ppl_tokens, args.gen_tokens + args.context_tokens + 256) + 16,
                   max_num_seqs=64, max_num_batched_tokens=2048)
    tokenizer = llm.get_tokenizer()
    text_ids = tokenizer(stdlib_text())["input_ids"][: args.ppl_tokens]

    def params(eviction: dict | None, **kw) -> SamplingParams:
        return SamplingParams(temperature=0, extra_args={"vllm_evict": eviction} if eviction else None, **kw)

    result = {"command": " ".join([Path(sys.executable).name, *sys.argv]), "model": str(model.name),
              "python": platform.python_version(), "text": {"stdlib_files": STDLIB_FILES, "tokens": len(text_ids)},
              "chunk_size": args.chunk_size, "gen_tokens": args.gen_tokens}
    if "perplexity" in args.parts:
        result["perplexity"] = perplexity_rows(llm, params, text_ids, args, policies)
    def chat_ids(content: str) -> list[int]:
        text = tokenizer.apply_chat_template([{"role": "user", "content": content}], tokenize=False,
                                             add_generation_prompt=True)
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    if "fidelity" in args.parts:
        chat = chat_ids(GEN_PROMPT)
        result["gen_prompt_tokens"] = len(chat)
        result["fidelity"] = fidelity_rows(llm, params, chat, args, policies)
    if "decode-policy" in args.parts:
        context = tokenizer.decode(text_ids[: args.context_tokens])
        prompt = chat_ids(f"{context}\n\n{EXPLAIN_PROMPT}")
        result["decode_policy"] = {"prompt_tokens": len(prompt), "context_tokens": args.context_tokens,
                                   "policy": args.request_policy, "budget": args.request_budget,
                                   "rows": decode_policy_rows(llm, params, prompt, args)}
    result.update(date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), seconds=round(time.time() - started))

    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"{args.name}.json").write_text(json.dumps(result, indent=1))
    write_markdown(result, out_dir / f"{args.name}.md")
    if "perplexity" in result:
        plot(result, out_dir / f"{args.name}.png")
    print((out_dir / f"{args.name}.md").read_text())
    return 0


def perplexity_rows(llm, params, text_ids: list[int], args, policies: list[str]) -> list[dict]:
    """Full cache, then every (policy, budget) block-wise, one budget and policy for every cut (each chunk is
    predicted from what that budget kept, as in StreamingLLM's evaluation)."""
    ppl_cases = [None] + [{"policy": p, "budget": b, "chunked": True, "chunk_size": args.chunk_size,
                           "chunk_budget": b, "chunk_policy": p} for b in args.ppl_budgets for p in policies]
    outs = llm.generate([{"prompt_token_ids": text_ids}] * len(ppl_cases),
                        [params(c, max_tokens=1, prompt_logprobs=0) for c in ppl_cases])
    ppl_rows = []
    for case, out in zip(ppl_cases, outs):
        lp = prompt_logprobs(out, text_ids)
        row = {"policy": case["policy"] if case else "full", "budget": case["budget"] if case else None,
               "ppl": round(perplexity(lp), 4)}
        if case:
            row["ppl_past_budget"] = round(perplexity(lp[case["budget"]:]), 4)
        ppl_rows.append(row)
    full_lp = prompt_logprobs(outs[0], text_ids)
    for row in ppl_rows[1:]:
        row["full_ppl_past_budget"] = round(perplexity(full_lp[row["budget"]:]), 4)
    return ppl_rows


def fidelity_rows(llm, params, chat: list[int], args, policies: list[str]) -> list[dict]:
    """Greedy tokens under decode budgets against the full cache."""
    gen_cases = [None] + [{"policy": p, "decode_budget": k} for k in args.decode_budgets for p in policies]
    outs = llm.generate([{"prompt_token_ids": chat}] * len(gen_cases),
                        [params(c, max_tokens=args.gen_tokens, ignore_eos=True) for c in gen_cases])
    full = list(outs[0].outputs[0].token_ids)
    gen_rows = []
    for case, out in zip(gen_cases[1:], outs[1:]):
        report = (out.kv_transfer_params or {}).get("vllm_evict", {})
        gen_rows.append({"policy": case["policy"], "decode_budget": case["decode_budget"],
                         **agreement(list(out.outputs[0].token_ids), full),
                         "decode_compactions": report.get("decode_compactions")})
    return gen_rows


def decode_policy_rows(llm, params, prompt: list[int], args) -> list[dict]:
    """The prompt evicted by the request's policy, then each decode policy at each decode budget: greedy tokens
    against the full cache and against the prompt's eviction alone (no decode budget)."""
    base = {"policy": args.request_policy, "budget": args.request_budget}
    cases = [None, base] + [{**base, "decode_budget": k, "decode_policy": d}
                            for k in args.decode_budgets for d in args.decode_policies]
    outs = llm.generate([{"prompt_token_ids": prompt}] * len(cases),
                        [params(c, max_tokens=args.gen_tokens, ignore_eos=True) for c in cases])
    full, prompt_only = (list(out.outputs[0].token_ids) for out in outs[:2])
    rows = [{"decode_policy": None, "decode_budget": None, **agreement(prompt_only, full)}]
    for case, out in zip(cases[2:], outs[2:]):
        got = list(out.outputs[0].token_ids)
        report = (out.kv_transfer_params or {}).get("vllm_evict", {})
        assert report.get("decode_policy") == case["decode_policy"], report
        rows.append({"decode_policy": case["decode_policy"], "decode_budget": case["decode_budget"],
                     **agreement(got, full), **agreement(got, prompt_only, "_prompt_only"),
                     "decode_compactions": report.get("decode_compactions")})
    return rows


def write_markdown(result: dict, path: Path) -> None:
    lines = []
    if "perplexity" in result:
        full, rows = result["perplexity"][0]["ppl"], result["perplexity"][1:]
        full_past = {r["budget"]: r["full_ppl_past_budget"] for r in rows}
        table = markdown_table(rows, "policy", "budget", "policy", lambda b: f"budget {b}",
                               lambda r: f"{r['ppl']} ({r['ppl_past_budget']})")
        table.insert(2, "| full cache | " + " | ".join(f"{full} ({full_past[b]})" for b in sorted(full_past)) + " |")
        lines += [f"Perplexity of {result['text']['tokens']} tokens of CPython sources (full cache {full}), "
                  f"block-wise eviction in chunks of {result['chunk_size']} tokens; in brackets, over the positions "
                  "past the budget (full cache there in the header).", "", *table, ""]
    def divergence(row: dict, suffix: str = "") -> str:
        return f"{row['first_divergence' + suffix]} / {row['agreement' + suffix]:.2f}"

    if "fidelity" in result:
        lines += [f"Greedy generation of {result['gen_tokens']} tokens (ignore_eos) from a "
                  f"{result['gen_prompt_tokens']}-token chat prompt with a decode budget, against the full cache: "
                  "first divergence (token index) / share of equal tokens.", "",
                  *markdown_table(result["fidelity"], "policy", "decode_budget", "policy", lambda k: f"K_d {k}",
                                  divergence), ""]
    if "decode_policy" in result:
        dp = result["decode_policy"]
        prompt_only = dp["rows"][0]
        lines += [f"Greedy generation of {result['gen_tokens']} tokens (ignore_eos) from a {dp['prompt_tokens']}-token "
                  f"chat prompt ({dp['context_tokens']} tokens of CPython sources and a request to explain them), "
                  f"evicted at its end by {dp['policy']} at budget {dp['budget']}, then decode points every 128 "
                  "tokens scored by each decode policy: first divergence / share of equal tokens against the full "
                  "cache; in brackets, against the prompt's eviction alone (no decode budget). The prompt's "
                  f"eviction alone against the full cache: {divergence(prompt_only)}.", "",
                  *markdown_table(dp["rows"][1:], "decode_policy", "decode_budget", "decode policy",
                                  lambda k: f"K_d {k}", lambda r: f"{divergence(r)} ({divergence(r, '_prompt_only')})")]
    path.write_text("\n".join(lines).rstrip("\n") + "\n")


def plot(result: dict, path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    rows = result["perplexity"][1:]
    policies = list(dict.fromkeys(r["policy"] for r in rows))
    budgets = sorted({r["budget"] for r in rows})
    fig, ax = plt.subplots(figsize=(10, 4))
    width = 0.8 / len(budgets)
    for i, b in enumerate(budgets):
        values = [next(r["ppl"] for r in rows if r["policy"] == p and r["budget"] == b) for p in policies]
        ax.bar([x + i * width for x in range(len(policies))], values, width, label=f"budget {b}")
    ax.axhline(result["perplexity"][0]["ppl"], color="k", linestyle="--", label="full cache")
    ax.set_xticks([x + width * (len(budgets) - 1) / 2 for x in range(len(policies))], policies, rotation=45,
                  ha="right")
    ax.set_ylabel("perplexity")
    ax.set_yscale("log")
    ax.set_title(f"SmolLM2-135M, {result['text']['tokens']} tokens of CPython sources, block-wise eviction")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    raise SystemExit(main())
