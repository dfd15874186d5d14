"""Second architecture: a tiny Qwen2 (q/k/v biases, GQA 4/2) evicts exactly like the reference."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.engine

PAGE = 16
CASES = [{"policy": "dropkv", "budget": 0.25, "allocation": "adakv"}, {"policy": "snapkv", "budget": 0.5},
         {"policy": "obcache-key", "budget": 0.25, "allocation": "adakv"}, {"policy": "knorm", "budget": 96},
         None]


@pytest.fixture(scope="module")
def qwen_llm(tiny_qwen2):
    from vllm_evict.testing.engines import make_llm

    llm = make_llm(tiny_qwen2, block_size=PAGE, max_num_batched_tokens=256)
    yield llm
    del llm


def test_qwen2_matches_reference(qwen_llm, tiny_qwen2):
    from vllm import SamplingParams

    from vllm_evict.policies import EvictionConfig
    from vllm_evict.testing.reference import ReferenceDecoder

    g = torch.Generator().manual_seed(21)
    prompt = torch.randint(3, 1000, (380,), generator=g).tolist()
    params = [SamplingParams(temperature=0, max_tokens=32, ignore_eos=True,
                             extra_args={"vllm_evict": c} if c else None) for c in CASES]
    outputs = qwen_llm.generate([{"prompt_token_ids": prompt}] * len(CASES), params)
    reference = ReferenceDecoder(tiny_qwen2)
    prefill = reference.prefill(prompt)
    for case, out in zip(CASES, outputs):
        config = EvictionConfig.from_dict(case) if case else None
        expected = reference.generate(prompt, 32, config, page_size=PAGE, prefill=prefill)
        assert list(out.outputs[0].token_ids) == expected.token_ids, case
        if case:
            assert out.kv_transfer_params["vllm_evict"]["blocks_freed"] > 0
