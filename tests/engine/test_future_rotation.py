"""worker.future_rotation: expected attention's mean RoPE move, read off the RoPE module beside an evicted
layer, equals the mean of vLLM's own RoPE applied at each future offset (YaRN's cache scale divided out)."""

from __future__ import annotations

import pytest
import torch


@pytest.mark.parametrize("rope_parameters", [
    {"rope_type": "default", "rope_theta": 10000.0},
    {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "original_max_position_embeddings": 4096,
     "beta_fast": 32.0, "beta_slow": 1.0},  # GPT-OSS's kind: the cache carries a scale of about 1.35
], ids=["default", "yarn"])
@pytest.mark.parametrize("neox", [True, False])
def test_future_rotation_is_the_mean_rope_move(rope_parameters, neox):
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.rotary_embedding import get_rope

    from vllm_evict.engine.worker import future_rotation
    from vllm_evict.policies.expected_attention import FUTURE_POSITIONS

    head_dim = 64
    with set_current_vllm_config(VllmConfig()):
        rope = get_rope(head_dim, 8192, neox, rope_parameters, torch.float32)
    model = torch.nn.Module()
    model.model = torch.nn.Module()
    model.model.layers = torch.nn.ModuleList([torch.nn.Module()])
    model.model.layers[0].self_attn = torch.nn.Module()
    model.model.layers[0].self_attn.rotary_emb = rope
    rotation = future_rotation(model, "model.layers.0.self_attn.attn", torch.device("cpu"))

    q = torch.randn(1, head_dim, generator=torch.Generator().manual_seed(3))
    offsets = torch.arange(1, FUTURE_POSITIONS + 1)
    moved, _ = rope.forward_native(offsets, q.expand(len(offsets), head_dim).clone(), None)
    scale = rope.cos_sin_cache[0, 0]  # position 0 moves nothing but scales by the cache's factor
    torch.testing.assert_close(rotation @ q[0], moved.mean(0) / scale, rtol=1e-4, atol=1e-5)

    bare = torch.nn.Module()
    bare.attn = torch.nn.Module()
    assert future_rotation(bare, "attn.attn", torch.device("cpu")) is None  # no RoPE there
