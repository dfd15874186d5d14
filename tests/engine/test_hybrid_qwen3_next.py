"""Eviction on a linear-attention hybrid: tiny random Qwen3-Next (three Gated DeltaNet layers to one
full-attention layer, a 4-expert MoE) in bf16 on vLLM's CPU platform, whose Gated DeltaNet kernels take
bf16 inputs and a float32 state. The full-attention group is compacted in pages of vLLM's attention block
size (sized to the linear-attention state: 48 tokens here); the DeltaNet state is left alone. Checked
against the reference decoder by teacher forcing (tests/engine/hybrid.py). One engine for the module."""

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

    return ensure_tiny_model("qwen3-next")


@pytest.fixture(scope="module")
def engine(model):
    with inprocess_llm(model, block_size=hybrid.PAGE, max_model_len=1024, max_num_batched_tokens=256,
                       dtype="bfloat16", mamba_ssm_cache_dtype="float32") as llm:
        yield llm


@pytest.fixture(scope="module")
def reference(model):
    return reference_for(model, torch.bfloat16)


@pytest.fixture(scope="module")
def exact():
    return EXACT


def test_pages_are_vllm_s_block_for_the_state(engine, reference):
    assert sum(reference.evicts) == 1 and hybrid.page_of(engine) > hybrid.PAGE
