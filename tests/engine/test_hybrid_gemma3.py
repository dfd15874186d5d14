"""Eviction on a hybrid model with sliding-window layers: tiny random Gemma 3 (two sliding-window layers of
32 tokens to one full-attention layer, float32) on vLLM's CPU platform against the reference decoder
(tests/engine/hybrid.py). On a GPU (FlashAttention takes no float32) the engine runs in bf16 and is checked
by teacher forcing. One engine for the module."""

from __future__ import annotations

import pytest
import torch

from tests.engine import hybrid
from tests.engine.hybrid import (reference_for, test_aborted_requests_return_every_group_s_blocks,  # noqa: F401
                                 test_block_wise_and_decode_time_eviction_follow_the_reference,
                                 test_one_shot_eviction_follows_the_reference_in_a_mixed_batch,
                                 test_only_the_full_attention_group_is_evicted)
from tests.engine.inprocess import inprocess_llm

pytestmark = pytest.mark.engine
EXACT = not torch.cuda.is_available()


@pytest.fixture(scope="module")
def model():
    from vllm_evict.testing.tiny_models import ensure_tiny_model

    return ensure_tiny_model("gemma3")


@pytest.fixture(scope="module")
def engine(model):
    with inprocess_llm(model, block_size=hybrid.PAGE, max_model_len=1024, max_num_batched_tokens=256,
                       dtype="float32" if EXACT else "bfloat16") as llm:
        yield llm


@pytest.fixture(scope="module")
def reference(model):
    return reference_for(model, torch.float32)


@pytest.fixture(scope="module")
def exact():
    return EXACT
