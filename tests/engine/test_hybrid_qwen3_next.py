"""Eviction on a linear-attention hybrid: tiny random Qwen3-Next (three Gated DeltaNet layers to one
full-attention layer, a 4-expert MoE) in bf16 on vLLM's CPU platform, whose Gated DeltaNet kernels take
bf16 inputs and a float32 state. The full-attention group is compacted in pages of vLLM's attention block
size (sized to the linear-attention state: 48 tokens here); the DeltaNet state is left alone. Checked
against the reference decoder by teacher forcing (tests/engine/hybrid.py). One engine for the module."""

from __future__ import annotations

import pytest
import torch

from tests.engine import hybrid
from tests.engine.inprocess import inprocess_llm

pytestmark = pytest.mark.engine


@pytest.fixture(scope="module")
def model():
    from vllm_evict.testing.tiny_models import ensure_tiny_model

    return ensure_tiny_model("qwen3-next")


@pytest.fixture(scope="module")
def engine(model):
    with inprocess_llm(model, dtype="bfloat16", mamba_ssm_cache_dtype="float32", block_size=hybrid.PAGE,
                       max_model_len=1024, max_num_batched_tokens=256) as llm:
        yield llm


@pytest.fixture(scope="module")
def reference(model):
    from vllm_evict.testing.reference import ReferenceDecoder

    return ReferenceDecoder(model, dtype=torch.bfloat16)


def test_only_the_full_attention_group_is_evicted(engine, reference):
    hybrid.check_only_full_attention_is_evicted(engine)
    assert sum(reference.evicts) == 1 and hybrid.page_of(engine) > hybrid.PAGE  # vLLM's block for the state


def test_one_shot_eviction_follows_the_reference_in_a_mixed_batch(engine, reference):
    hybrid.check_one_shot_mixed_batch(engine, reference, exact=False)


def test_block_wise_and_decode_time_eviction_follow_the_reference(engine, reference):
    hybrid.check_evicting_again(engine, reference, exact=False)


def test_aborted_requests_return_every_group_s_blocks(engine):
    hybrid.check_aborts_leak_nothing(engine)
