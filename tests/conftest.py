import os
from pathlib import Path

import pytest

# One cache for tiny models across the test session (CI: a fresh dir per clone).
os.environ.setdefault("VLLM_EVICT_CACHE", str(Path(__file__).resolve().parent.parent / ".cache"))


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


def pytest_collection_modifyitems(config, items):
    import torch

    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU (run through the device tool)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)
