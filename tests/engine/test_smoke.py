"""vLLM (with the plugin loaded) generates exactly HF transformers' greedy tokens on a tiny model."""

import pytest
import torch

pytestmark = pytest.mark.engine

PROMPTS = [
    "the key value of the city river " * 12,
    "blue green red sky grass sun moon code token cache page head layer",
    "number 17 and number 42 and the answer is",
]
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def llm(tiny_llama):
    from vllm_evict.testing.engines import make_llm

    engine = make_llm(tiny_llama)
    yield engine
    del engine


def hf_greedy(model_dir, prompt_ids: list[int], max_tokens: int) -> list[int]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt_ids]), max_new_tokens=max_tokens, do_sample=False,
                             min_new_tokens=max_tokens, pad_token_id=0)
    return out[0, len(prompt_ids):].tolist()


def test_vllm_matches_hf_greedy(llm, tiny_llama):
    from vllm import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outputs = llm.generate(PROMPTS, params)
    for out in outputs:
        expected = hf_greedy(tiny_llama, list(out.prompt_token_ids), MAX_TOKENS)
        assert list(out.outputs[0].token_ids) == expected, out.prompt


def test_plugin_loaded_in_engine_process():
    import importlib.metadata as md

    names = [ep.name for ep in md.entry_points(group="vllm.general_plugins")]
    assert "vllm_evict" in names
