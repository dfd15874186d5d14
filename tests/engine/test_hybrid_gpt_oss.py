"""Eviction on GPT-OSS's layout: tiny random GPT-OSS (sliding window of 32 alternating with full attention,
attention sinks, a 4-expert MoE) in bf16 on vLLM's CPU platform against the reference decoder, which adds
the sinks to each softmax as vLLM does (tests/engine/hybrid.py: bf16 tokens are checked by teacher forcing).
The sinks reach the per-head (Ada-KV) attention path too. One engine for the module."""

from __future__ import annotations

import pytest
import torch

from tests.engine import hybrid
from tests.engine.inprocess import inprocess_llm

pytestmark = pytest.mark.engine


@pytest.fixture(scope="module")
def model():
    from vllm_evict.testing.tiny_models import ensure_tiny_model

    return ensure_tiny_model("gpt-oss")


@pytest.fixture(scope="module")
def engine(model):
    with inprocess_llm(model, dtype="bfloat16", block_size=hybrid.PAGE, max_model_len=1024,
                       max_num_batched_tokens=256) as llm:
        yield llm


@pytest.fixture(scope="module")
def reference(model):
    from vllm_evict.testing.reference import ReferenceDecoder

    return ReferenceDecoder(model, dtype=torch.bfloat16)


def test_only_the_full_attention_group_is_evicted(engine, reference):
    hybrid.check_only_full_attention_is_evicted(engine)
    assert all(s is not None for s, evicts in zip(reference.sinks, reference.evicts) if evicts)  # sinks evicted


def test_one_shot_eviction_follows_the_reference_in_a_mixed_batch(engine, reference):
    hybrid.check_one_shot_mixed_batch(engine, reference, exact=False)


def test_block_wise_and_decode_time_eviction_follow_the_reference(engine, reference):
    hybrid.check_evicting_again(engine, reference, exact=False)


def test_aborted_requests_return_every_group_s_blocks(engine):
    hybrid.check_aborts_leak_nothing(engine)
