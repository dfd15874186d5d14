"""Sharded evaluation (`--shard k/n`, parallel engines) merges into exactly the tables of one unsharded run.

The engine is replaced by a deterministic stand-in: this checks the runner's bookkeeping (which shard
runs which samples, merging, resuming), not eviction; tests/bench/test_eval_cpu.py runs the real engine.
"""

from __future__ import annotations

import gzip
import json
import re
import zlib
from pathlib import Path
from types import SimpleNamespace

import pytest

from vllm_evict.bench.eval import EvalConfig, run_eval

from .test_ruler import _trained_tokenizer

EXTRA = "vllm_evict"


class DeterministicLLM:
    """Answers a passkey prompt correctly or not depending on a hash of (prompt, eviction spec), and
    reports an eviction for every request that asks for one."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.calls = 0

    def generate(self, prompts, params, use_tqdm=False):
        params = params if isinstance(params, list) else [params] * len(prompts)
        self.calls += 1
        outs = []
        for prompt, p in zip(prompts, params):
            ids = prompt["prompt_token_ids"]
            spec = (p.extra_args or {}).get(EXTRA)
            key = zlib.crc32(json.dumps([ids, spec], sort_keys=True).encode())
            keys = re.findall(r"pass key is (\d+)", self.tokenizer.decode(ids))
            text = f" {keys[0]}." if keys and key % 3 else " 0."
            report = None
            if spec is not None:
                evicted = spec.get("evict_at", len(ids))
                report = {"evicted_prefix_tokens": evicted, "kept_tokens_per_head": int(evicted * spec["budget"])}
            outs.append(SimpleNamespace(outputs=[SimpleNamespace(text=text)],
                                        kv_transfer_params={EXTRA: report} if report else None))
        return outs


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tok")
    _trained_tokenizer().save_pretrained(str(path))
    return path


def _config(tokenizer_dir, out, **kw):
    return EvalConfig(model=str(tokenizer_dir), tasks=["passkey"], lengths=[1024], samples=7,
                      policies=["snapkv", "streaming"], budgets=[0.1, 1.0], out_dir=str(out), name="q",
                      chunk_samples=1, plot=False, **kw)


def _table(rows):
    return sorted((r["variant"], r["policy"], r["allocation"], r["budget"], r["task"], r["length"], r["n"],
                   r["accuracy"], r["status"]) for r in rows)


def test_shards_merge_to_the_unsharded_table(tokenizer_dir, tmp_path):
    from transformers import AutoTokenizer

    llm = DeterministicLLM(AutoTokenizer.from_pretrained(str(tokenizer_dir)))
    single = run_eval(_config(tokenizer_dir, tmp_path / "single"), llm=llm)
    assert single.complete
    accuracies = {r["accuracy"] for r in single.rows}
    assert len(accuracies) > 1, "the stand-in must make cells differ, or the comparison proves nothing"
    title = (tmp_path / "single" / "q.md").read_text().splitlines()[2]
    assert title.startswith(f"{tokenizer_dir.name}, RULER-style passkey")  # names the model that ran

    out = tmp_path / "sharded"
    for k in range(3):
        res = run_eval(_config(tokenizer_dir, out, shard=(k, 3)), llm=llm)
        assert res.complete and res.rows == []
        shard_file = out / f"q.shard{k}of3_requests.jsonl.gz"
        with gzip.open(shard_file, "rt") as f:
            indices = {json.loads(line)["index"] for line in f}
        assert indices == {i for i in range(7) if i % 3 == k}
    assert not (out / "q.csv").exists()

    merged = run_eval(_config(tokenizer_dir, out, report_only=True), llm=None)
    assert _table(merged.rows) == _table(single.rows)
    assert merged.complete
    assert not list(out.glob("q.shard*")), "merged shard files are removed"
    meta = json.loads((out / "q.json").read_text())
    assert meta["probe"]["evict_at_supported"] and meta["probe"]["eviction_active"]
    assert len(meta["generate_calls"]) == 7          # one call per sample index across the 3 shards


def test_shard_resumes_from_merged_records(tokenizer_dir, tmp_path):
    from transformers import AutoTokenizer

    llm = DeterministicLLM(AutoTokenizer.from_pretrained(str(tokenizer_dir)))
    out = tmp_path / "resume"
    for k in range(2):
        run_eval(_config(tokenizer_dir, out, shard=(k, 2)), llm=llm)
    run_eval(_config(tokenizer_dir, out, report_only=True))
    calls = llm.calls
    # a second round of shards finds everything in the merged file: only the probes reach the engine
    for k in range(2):
        run_eval(_config(tokenizer_dir, out, shard=(k, 2), resume=True), llm=llm)
    assert llm.calls - calls == 2 * 2
    merged = run_eval(_config(tokenizer_dir, out, resume=True), llm=llm)
    assert merged.complete and all(r["n"] == 7 for r in merged.rows if r["status"] == "ok")


def test_bad_shard_is_rejected():
    with pytest.raises(ValueError, match="shard"):
        EvalConfig(shard=(2, 2)).validate()
    with pytest.raises(ValueError, match="report-only"):
        EvalConfig(shard=(0, 2), report_only=True).validate()
