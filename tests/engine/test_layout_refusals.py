"""Which KV layouts evict, and how the ones that cannot are refused (engine/layout.py): the group rule on KV
cache configs of each kind, then a real engine whose layout cannot evict (tiny Gemma 3 with the hybrid KV
cache manager disabled, so its sliding-window layers share the full-attention layers' blocks): a request
with an `eviction` object is refused at the API naming the layout (by the OpenAI handlers too, before a
stream starts), `policy: none` runs, and an engine told
to evict every request by default refuses to start."""

from __future__ import annotations

import json

import pytest
import torch

from tests.engine.inprocess import inprocess_llm

PAGE = 16


def spec(kind: str, **fields):
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MLAAttentionSpec, SlidingWindowSpec

    cls = {"full": FullAttentionSpec, "sliding": SlidingWindowSpec, "mla": MLAAttentionSpec}[kind]
    return cls(block_size=PAGE, num_kv_heads=2, head_size=64, dtype=torch.float32, **fields)


def config(*specs):
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec

    return KVCacheConfig(num_blocks=64, kv_cache_tensors=[], kv_cache_groups=[
        KVCacheGroupSpec([f"model.layers.{i}.attn"], s) for i, s in enumerate(specs)])


def test_the_full_attention_group_is_the_one_evicted():
    from vllm_evict.engine.layout import evicted_group, other_group_blocks

    group, reason = evicted_group(config(spec("full")))
    assert reason is None and group.index == 0 and not group.hybrid
    hybrid = config(spec("sliding", sliding_window=40), spec("sliding", sliding_window=40), spec("full"))
    group, reason = evicted_group(hybrid)
    assert reason is None and group.index == 2 and group.hybrid and group.window_blocks == 4
    # the sliding groups hold at most their window's blocks (plus the one being filled): 2 x (ceil(39/16) + 1)
    assert other_group_blocks(hybrid, group, 10_000) == 2 * 4 and other_group_blocks(hybrid, group, 20) == 2 * 2


def test_a_turboquant_group_with_model_dtype_boundary_layers_is_evicted():
    """vLLM puts a dense model's TurboQuant layers and the boundary layers it keeps in the model dtype in one
    group of differently sized caches (UniformTypeKVCacheSpecs): one block table, evicted whole. A group that
    also holds a window layer is not."""
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec, TQFullAttentionSpec, UniformTypeKVCacheSpecs

    from vllm_evict.engine.layout import evicted_group

    tq = TQFullAttentionSpec(block_size=PAGE, num_kv_heads=2, head_size=64, dtype=torch.uint8, tq_slot_size=70)
    layers = {"model.layers.0.attn": spec("full"), "model.layers.1.attn": tq, "model.layers.2.attn": tq}
    group, reason = evicted_group(KVCacheConfig(num_blocks=64, kv_cache_tensors=[], kv_cache_groups=[
        KVCacheGroupSpec(list(layers), UniformTypeKVCacheSpecs(block_size=PAGE, kv_cache_specs=layers))]))
    assert reason is None and group.index == 0 and not group.hybrid
    assert evicted_group(config(tq))[0].index == 0  # a hybrid model's TurboQuant group: no boundary layers
    windowed = {**layers, "model.layers.3.attn": spec("full", sliding_window=32)}
    group, reason = evicted_group(KVCacheConfig(num_blocks=64, kv_cache_tensors=[], kv_cache_groups=[
        KVCacheGroupSpec(list(windowed), UniformTypeKVCacheSpecs(block_size=PAGE, kv_cache_specs=windowed))]))
    assert group is None and "no full-attention KV cache group" in reason


@pytest.mark.parametrize("specs, words", [
    (("mla",), "no full-attention KV cache group"),
    (("sliding",), "no full-attention KV cache group"),
    (("full", "full"), "2 full-attention KV cache groups"),
    (("full-window",), "no full-attention KV cache group"),   # sliding layers unified into the full group
])
def test_layouts_that_cannot_evict_say_why(specs, words):
    from vllm_evict.engine.layout import evicted_group

    made = [spec("full", sliding_window=32) if s == "full-window" else
            spec(s, sliding_window=32) if s == "sliding" else spec(s) for s in specs]
    group, reason = evicted_group(config(*made))
    assert group is None and words in reason


@pytest.mark.parametrize("cache_dtype, backend, per_head", [
    ("auto", None, True), ("fp8", None, True), ("auto", "FLASH_ATTN", True),
    ("int8_per_token_head", None, False), ("int4_per_token_head", None, False), ("auto", "TRITON_ATTN", False),
    ("turboquant_4bit_nc", None, False), ("turboquant_k8v4", None, False)])
def test_adakv_is_refused_where_attention_has_no_per_head_path(monkeypatch, cache_dtype, backend, per_head):
    """Ada-KV's per-head layout needs the per-head attention path, which the Triton backend (per-token-head
    caches, or picked by name) does not have: refused where requests arrive, naming the backend; uniform
    allocation passes everywhere. TurboQuant's backend has no per-head path either. (The engine rule alone:
    the engine's model checks are stubbed.)"""
    from types import SimpleNamespace

    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    from vllm_evict.engine import layout
    from vllm_evict.engine.request_config import RequestEviction
    from vllm_evict.policies import EvictionConfig

    monkeypatch.setattr(layout, "model_refusal", lambda *args: None)
    vllm_config = SimpleNamespace(
        model_config=None, scheduler_config=None, speculative_config=None,
        cache_config=SimpleNamespace(cache_dtype=cache_dtype, block_size=PAGE),
        attention_config=SimpleNamespace(backend=backend and AttentionBackendEnum[backend]))
    assert layout.per_head_attention(vllm_config) == per_head

    def request(allocation):
        return RequestEviction(EvictionConfig.from_dict({"policy": "snapkv", "budget": 0.2, "allocation": allocation}))

    layout.check_on_engine(request("uniform"), vllm_config)
    if per_head:
        layout.check_on_engine(request("adakv"), vllm_config)
    else:
        expected = "TURBOQUANT" if cache_dtype.startswith("turboquant_") else "TRITON_ATTN"
        with pytest.raises(ValueError, match=f"allocation 'adakv' is not supported .*{expected}"):
            layout.check_on_engine(request("adakv"), vllm_config)


@pytest.fixture(scope="module")
def model():
    from vllm_evict.testing.tiny_models import ensure_tiny_model

    return ensure_tiny_model("gemma3")


@pytest.mark.engine
def test_a_layout_that_cannot_evict_is_refused_by_name(model, monkeypatch):
    from vllm import SamplingParams

    def params(eviction):
        return SamplingParams(temperature=0, max_tokens=4, extra_args={"vllm_evict": eviction})

    with inprocess_llm(model, block_size=PAGE, max_model_len=512, disable_hybrid_kv_cache_manager=True) as llm:
        scheduler = llm.llm_engine.engine_core.engine_core.scheduler
        assert "hybrid KV cache manager is disabled" in scheduler.refusal
        prompt = {"prompt_token_ids": list(range(3, 203))}
        with pytest.raises(ValueError, match="cannot evict.*sliding-window layers"):
            llm.generate([prompt], [params({"policy": "snapkv", "budget": 0.5})])
        out = llm.generate([prompt], [params({"policy": "none"})])[0]  # no eviction asked: served
        assert len(out.outputs[0].token_ids) == 4 and out.outputs[0].finish_reason == "length"
        # the OpenAI handlers run the same check before they start a response (streaming or not)
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
        from vllm.exceptions import VLLMValidationError

        from vllm_evict.engine.openai_api import checked_request

        def chat(eviction):
            return ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}], stream=True,
                                         eviction=eviction)

        with pytest.raises(VLLMValidationError, match="cannot evict.*sliding-window layers"):
            checked_request(chat({"policy": "snapkv", "budget": 0.5}), llm.llm_engine.vllm_config)
        assert checked_request(chat({"policy": "none"}), llm.llm_engine.vllm_config) is None
    # told to evict every request by default, the engine refuses to start with the same reason
    from vllm_evict.engine.request_config import DEFAULT_ENV

    monkeypatch.setenv(DEFAULT_ENV, json.dumps({"policy": "snapkv", "budget": 0.5}))
    with pytest.raises(Exception, match="cannot evict.*sliding-window layers"):
        with inprocess_llm(model, block_size=PAGE, max_model_len=512, disable_hybrid_kv_cache_manager=True):
            pass
