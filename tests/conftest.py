import os
from pathlib import Path

import pytest

# One cache for tiny models across the test session (CI: a fresh dir per clone).
os.environ.setdefault("VLLM_EVICT_CACHE", str(Path(__file__).resolve().parent.parent / ".cache"))
# vLLM's CPU platform compiles the model with Dynamo and the `eager` backend under this variable instead of
# inductor's C++ build (as vLLM's own CPU CI): the plugin's ops are still traced and engine starts are
# shorter. Engine subprocesses and served processes inherit it; test_default_model.py (a user's server) and
# test_hybrid_gpt_oss.py (its bf16 bound was measured on inductor's kernels) set it to 0.
os.environ.setdefault("VLLM_CPU_CI_ENV", "1")


@pytest.fixture(scope="session")
def tiny_llama() -> Path:
    from vllm_evict.testing.tiny_models import ensure_tiny_model

    return ensure_tiny_model("llama")


@pytest.fixture(scope="session")
def tiny_qwen2() -> Path:
    from vllm_evict.testing.tiny_models import ensure_tiny_model

    return ensure_tiny_model("qwen2")


@pytest.fixture(scope="session")
def reference(tiny_llama):
    """The independent torch decoder the engine tests compare vLLM's tokens with."""
    from vllm_evict.testing.reference import ReferenceDecoder

    return ReferenceDecoder(tiny_llama)


@pytest.hookimpl(tryfirst=True)  # before pytest-isolated groups the items
def pytest_collection_modifyitems(config, items):
    import torch

    skip_gpu = None if torch.cuda.is_available() else pytest.mark.skip(
        reason="needs a CUDA GPU (run through the device tool)")
    for item in items:
        if skip_gpu and "gpu" in item.keywords:
            item.add_marker(skip_gpu)
        # Every module that starts a real engine runs in a Python process of its own (pytest-isolated): vLLM,
        # torch and the plugin keep process-wide state across engines, and a native crash (an abort in a
        # kernel) then fails that module's tests with the process's stderr instead of ending the whole run.
        if "engine" in item.keywords and not item.get_closest_marker("isolated"):
            item.add_marker(pytest.mark.isolated(group=item.nodeid.split("::")[0]))
