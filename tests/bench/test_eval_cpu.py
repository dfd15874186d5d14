"""CPU-sized run of the quality pipeline on the real SmolLM2-135M-Instruct (float32, one engine).

Checks what CI can check in a few minutes on 2 cores: the model prepares, full-cache passkey accuracy at 1K
is high (>= 8/9; the Hugging Face check in docs/QUALITY.md, "Model"), and the runner writes a complete table
(every requested cell present, evicting cells really evicted) plus its CSV/JSON/Markdown/PNG files.
Policy orderings are findings, not assertions (docs/QUALITY.md).
"""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest

pytestmark = [pytest.mark.engine, pytest.mark.slow]

POLICIES = ["snapkv", "streaming"]
ALLOCATIONS = ["uniform", "adakv"]
BUDGETS = [0.1, 1.0]
VARIANTS = ["aware", "agnostic"]
N = 9


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    from vllm_evict.bench.eval import EvalConfig, run_eval
    from vllm_evict.models import prepare_smollm2

    model_dir = prepare_smollm2()
    out = tmp_path_factory.mktemp("quality")
    cfg = EvalConfig(
        model=str(model_dir), tasks=["passkey"], lengths=[1024], samples=N, depths=[0.1, 0.5, 0.9],
        variants=VARIANTS, policies=POLICIES, allocations=ALLOCATIONS, budgets=BUDGETS, out_dir=str(out),
        name="cpu",
    )
    return run_eval(cfg)


def test_full_cache_passkey_accuracy(result):
    full = [r for r in result.rows if r["policy"] == "full"]
    assert {r["variant"] for r in full} == set(VARIANTS)
    for row in full:
        assert row["n"] == N and row["status"] == "ok"
        assert row["correct"] >= 8, f"full-cache passkey accuracy {row['correct']}/{N} at 1K"


def test_complete_table(result):
    expected = {(v, "full", "-", 1.0) for v in VARIANTS}
    for v in VARIANTS:
        for p in POLICIES:
            for a in (["uniform"] if p == "streaming" else ALLOCATIONS):
                expected.add((v, p, a, 0.1))
    got = {(r["variant"], r["policy"], r["allocation"], r["budget"]) for r in result.rows}
    assert got == expected
    agnostic_supported = result.probe.evict_at_supported
    for row in result.rows:
        assert row["task"] == "passkey" and row["length"] == 1024
        if row["variant"] == "agnostic" and not agnostic_supported:
            assert row["status"].startswith("skipped"), row
            continue
        assert row["n"] == N, row
        assert row["status"] == "ok", row  # evicting cells carry an eviction report for every request
        assert 0.0 <= row["accuracy"] <= 1.0
        if row["policy"] != "full":
            # budget 0.1 of ~1K tokens: whole pages, at least the protected window (32 tokens)
            assert 0.05 < row["kept_fraction"] < 0.2, row
    assert result.probe.eviction_active, result.probe.messages


def test_output_files(result):
    files = {k: Path(v) for k, v in result.files.items()}
    for key in ("csv", "summary_csv", "json", "markdown", "png", "requests"):
        assert files[key].is_file() and files[key].stat().st_size > 0, key
    assert files["png"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    payload = json.loads(files["json"].read_text())
    assert payload["command"].startswith("vllm-evict eval ") and "--samples 9" in payload["command"]
    assert payload["command"] == result.command
    assert len(payload["rows"]) == len(result.rows)
    with open(files["csv"]) as f:
        assert len(list(csv.DictReader(f))) == len(result.rows)
    assert result.command in files["markdown"].read_text()
