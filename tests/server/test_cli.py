"""`vllm-evict serve` command line (no engine start)."""

from __future__ import annotations

import subprocess
import sys

import pytest

pytest.importorskip("vllm")

from vllm_evict.cli import build_parser  # noqa: E402


def parse(*argv):
    args = build_parser().parse_args(["serve", *argv])
    return args, args._parser


def test_registering_serve_does_not_import_vllm():
    code = ("import sys, argparse, server.cli as c\n"
            "p = argparse.ArgumentParser(); c.register(p.add_subparsers())\n"
            "assert 'vllm' not in sys.modules and 'torch' not in sys.modules, 'eager import'\n")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_only_user_flags_are_forwarded(tmp_path, monkeypatch):
    from server.cli import resolve_engine_config

    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    args, parser = parse(str(tmp_path), "--max-model-len", "512", "--block-size", "16", "--enforce-eager",
                         "--gpu-memory-utilization", "0.5", "--port", "9999", "--api-key", "k",
                         "--default-eviction-policy", "snapkv", "--default-eviction-budget", "0.1")
    model, kwargs, names = resolve_engine_config(args, parser)
    assert model == str(tmp_path) and names == [str(tmp_path)]
    assert kwargs["max_model_len"] == 512 and kwargs["block_size"] == 16 and kwargs["enforce_eager"] is True
    assert kwargs["gpu_memory_utilization"] == 0.5
    assert args.port == 9999 and args.api_key == "k" and args.default_eviction_policy == "snapkv"
    for server_flag in ("port", "host", "api_key", "default_eviction_policy", "model_tag"):
        assert server_flag not in kwargs
    assert "attention_backend" not in kwargs and "scheduler_cls" not in kwargs  # left to engine_kwargs
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        assert kwargs["dtype"] == "float32" and kwargs["kv_cache_memory_bytes"] == 1 << 30


def test_explicit_engine_flags_win(tmp_path, monkeypatch):
    from server.cli import resolve_engine_config

    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "2")
    args, parser = parse("--model", str(tmp_path), "--dtype", "bfloat16", "--served-model-name", "a", "b")
    model, kwargs, names = resolve_engine_config(args, parser)
    assert model == str(tmp_path) and names == ["a", "b"]
    assert kwargs["dtype"] == "bfloat16" and "kv_cache_memory_bytes" not in kwargs  # env var decides


def test_no_model_serves_tiny_model(tiny_llama):
    from server.cli import TINY_MODEL_NAME, resolve_engine_config

    args, parser = parse()
    model, kwargs, names = resolve_engine_config(args, parser)
    assert model == str(tiny_llama) and names == [TINY_MODEL_NAME]
    assert kwargs["served_model_name"] == [TINY_MODEL_NAME] and kwargs["max_model_len"] == 2048


def test_engine_args_are_built_through_engine_kwargs(tiny_llama):
    from server.app import build_engine_args

    ea = build_engine_args(str(tiny_llama), dtype="float32", max_model_len=256)
    assert ea.model == str(tiny_llama) and ea.dtype == "float32" and ea.max_model_len == 256
    assert "vllm_evict" in str(ea.scheduler_cls)


@pytest.mark.parametrize("flags", [
    ["--default-eviction-policy", "nope", "--default-eviction-budget", "0.1"],
    ["--default-eviction-policy", "snapkv", "--default-eviction-budget", "1.5"],
    ["--default-eviction-policy", "snapkv"],  # no budget
    ["--default-eviction-policy", "snapkv", "--default-eviction-budget", "abc"],
])
def test_bad_default_eviction_exits_2(tmp_path, flags, capsys):
    from server.cli import serve

    args, _ = parse(str(tmp_path), *flags)
    assert serve(args) == 2
    assert "--default-eviction" in capsys.readouterr().err


def test_budget_parsing():
    from server.eviction import build_defaults, parse_budget

    assert parse_budget("0.1") == 0.1 and parse_budget("2048") == 2048 and isinstance(parse_budget("2048"), int)
    assert build_defaults("snapkv", "64", None) == {"policy": "snapkv", "budget": 64}
    with pytest.raises(ValueError):
        parse_budget("lots")
