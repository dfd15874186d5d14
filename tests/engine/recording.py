"""One request's prompt compacted by the engine's compaction (compaction.compact_request) over a list of
layer caches, recording what each layer group's selection saw: the quantized-cache adapter tests check that
scoring read exactly the decoded values and kept what the policy API keeps on them."""

from __future__ import annotations

import torch


def compact_recording(policy: str, layers: list, prompt_blocks: torch.Tensor, fresh: torch.Tensor,
                      gen: torch.Generator, *, tokens: int, page: int, pages: int, heads: int, head_dim: int,
                      group: int = 2):
    """(config, window queries [L, w, group*heads, head_dim] or None, [(keys, values, keep, counts)] per layer
    group) of a `policy` cut to `pages` pages per head of a `tokens`-token prompt on prompt_blocks, written to
    the fresh blocks."""
    from vllm_evict.engine import compaction
    from vllm_evict.engine.request_config import RequestEviction
    from vllm_evict.engine.request_state import WorkerEviction
    from vllm_evict.policies import EvictionConfig

    config = EvictionConfig.from_dict({"policy": policy, "budget": pages * page})
    w = config.window_size()
    device = prompt_blocks.device
    q_window = torch.randn(len(layers), w, heads * group, head_dim, generator=gen).to(device) if w else None
    seen, select_group = [], compaction.select_group

    def recording(config, q_window, keys, values, *args, **kwargs):
        keep, counts = select_group(config, q_window, keys, values, *args, **kwargs)
        seen.append((keys, values, keep, counts))
        return keep, counts

    compaction.select_group = recording
    try:
        state = WorkerEviction.for_prompt("r", RequestEviction(config), tokens, page, q_window=q_window)
        compaction.compact_request(state, layers, head_dim ** -0.5, prompt_blocks, fresh)
    finally:
        compaction.select_group = select_group
    return config, q_window, seen
