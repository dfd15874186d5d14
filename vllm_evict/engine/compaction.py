"""Scoring + compaction of one request's prompt KV in one layer, and the per-head page layout.

Page layout ("flat slots"). A block holds one page per KV head, so page id = block * H_kv + slot. After
compaction a request owns P fresh blocks = P*H_kv pages per layer, numbered by flat slot
s in [0, P*H_kv): flat slot s is slot `s // P` of fresh block `s % P`. Head h with p_h pages takes the
flat slots [start_h, start_h + p_h), start_h = p_0 + ... + p_{h-1}, its kept tokens in ascending
position order. Under uniform allocation (p_h = P) head h gets slot h of every fresh block: exactly
vLLM's own layout, so a uniformly compacted request is a stock request whose positions are shifted by
E - P*page_size (see worker.py). Tokens after the eviction point go to head h's slot of the tail blocks
(the blocks after the P fresh ones), continuing after the head's kept tokens.

Everything here runs on the cache's device without host synchronisation, except Ada-KV's exact page
rounding (SPEC §3.4), which is host arithmetic.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vllm_evict.policies import allocate_pages, keep_mask, kept_counts, score_tokens
from vllm_evict.policies.config import EvictionConfig


@dataclass
class LayerCompaction:
    """Where one layer's kept tokens of one request live (device tensors)."""

    page_counts: torch.Tensor  # [H] int64 p_h, sums to P*H
    kept: torch.Tensor         # [H] int64 kept tokens K_h = min(E, p_h * page_size)


def plan_compaction(config: EvictionConfig, q_window: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                    scale: float, page_size: int, pages: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Kept mask [H, E] and pages per head [H] (int64, device) for keys/values [E, H, D] and window queries
    [w, Hq, D]; `pages` is P, which the scheduler derived from the request alone.

    Same result as `select_tokens`. Uniform allocation needs no host value (P is known); Ada-KV's global
    allocation runs once, on the host (exact rounding)."""
    scores = score_tokens(config.policy, q_window, keys, values, scale=scale, **config.score_options())
    num_heads, n = scores.shape
    if config.allocation == "uniform" or num_heads == 1:
        page_counts = torch.full((num_heads,), pages, dtype=torch.int64, device=scores.device)
    else:
        page_counts = allocate_pages(scores, config.budget, page_size=page_size,
                                     **config.select_options()).to(scores.device)
    keep = keep_mask(scores, kept_counts(page_counts, n, page_size))
    return keep, page_counts


def compaction_slots(keep: torch.Tensor, page_counts: torch.Tensor, fresh_blocks: torch.Tensor,
                     page_size: int) -> tuple[LayerCompaction, torch.Tensor]:
    """Destination slot [E, H] (int64, -1 = evicted) of every prompt token of every head.

    Slots address the per-head page view: slot = page * page_size + offset."""
    num_heads = keep.shape[0]
    num_pages = fresh_blocks.numel()
    counts = page_counts.view(-1, 1)
    virtual = torch.cumsum(keep, dim=1) - 1                       # rank among the head's kept tokens
    flat = torch.cumsum(counts, 0) - counts + virtual // page_size
    block = fresh_blocks.to(torch.int64)[flat % num_pages]
    slot = (block * num_heads + flat // num_pages) * page_size + virtual % page_size
    slot = torch.where(keep, slot, -1)
    layout = LayerCompaction(page_counts=page_counts, kept=keep.sum(dim=1))
    return layout, slot.t()


def warm_up(device: torch.device, num_q_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
            page_size: int) -> None:
    """Run every policy's scoring and compaction once on a small prompt, so that the Triton kernels
    (compiled once per policy and head shape, never per prompt length) and the torch kernels are ready
    before the first request instead of inside its prefill."""
    from vllm_evict.policies import POLICIES

    n = 16 * page_size
    gen = torch.Generator(device=device).manual_seed(0)
    keys = torch.randn(n, num_kv_heads, head_dim, device=device, dtype=dtype, generator=gen)
    values = torch.randn(n, num_kv_heads, head_dim, device=device, dtype=dtype, generator=gen)
    queries = torch.randn(n, num_q_heads, head_dim, device=device, dtype=dtype, generator=gen)
    fresh = torch.arange(4, device=device)
    for policy in POLICIES:
        config = EvictionConfig.from_dict({"policy": policy, "budget": 4 * page_size})
        window = config.window_size()
        keep, counts = plan_compaction(config, queries[n - max(window, 1):], keys, values, head_dim ** -0.5,
                                       page_size, 4)
        compaction_slots(keep, counts, fresh, page_size)
    torch.cuda.synchronize(device)
