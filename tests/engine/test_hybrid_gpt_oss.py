"""Eviction on GPT-OSS's layout: tiny random GPT-OSS (sliding window of 32 alternating with full attention,
attention sinks, a 4-expert MoE) in bf16 on vLLM's CPU platform against the reference decoder, which adds
the sinks to each softmax as vLLM does (tests/engine/hybrid.py: bf16 tokens are checked by teacher forcing).
The sinks reach the per-head (Ada-KV) attention path too. One engine for the module."""

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
EXACT = False


@pytest.fixture(scope="module")
def model():
    from vllm_evict.testing.tiny_models import ensure_tiny_model

    return ensure_tiny_model("gpt-oss")


@pytest.fixture(scope="module")
def engine(model):
    # inductor, as a user's engine compiles: BF16_GAP was measured on its fused bf16 kernels, and the eager
    # backend (conftest.py) rounds after every op
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("VLLM_CPU_CI_ENV", "0")
        with inprocess_llm(model, block_size=hybrid.PAGE, max_model_len=1024, max_num_batched_tokens=256,
                           dtype="bfloat16") as llm:
            yield llm


@pytest.fixture(scope="module")
def reference(model):
    return reference_for(model, torch.bfloat16)


@pytest.fixture(scope="module")
def exact():
    return EXACT


def test_the_evicted_layers_have_sinks(reference):
    assert all(s is not None for s, evicts in zip(reference.sinks, reference.evicts) if evicts)
