"""Scoring + compaction of one request's prompt KV in one layer, and the per-head page layout.

Page layout: a block holds one page per KV head, so page id = block * H_kv + head. After compaction a
request owns P fresh blocks = P*H_kv pages per layer. Head h with p_h pages first takes its own slot of
the first min(p_h, P) fresh blocks; heads with p_h > P take the slots left free by heads with p_h < P,
in (head, block) order. Tokens generated after the eviction point go to head h's slot of the tail
blocks (the request's blocks after the P fresh ones), continuing after the head's kept tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vllm_evict.policies import allocate_pages, keep_mask, kept_counts, score_tokens
from vllm_evict.policies.config import EvictionConfig


@dataclass
class LayerCompaction:
    """Where one layer's kept tokens of one request live."""

    pages: torch.Tensor        # [H, max_p] int32 page ids (padded with 0), head h uses pages[h, :page_counts[h]]
    page_counts: torch.Tensor  # [H] int64, sums to P*H
    kept: torch.Tensor         # [H] int64 kept tokens K_h = min(E, p_h * page_size)


def assign_head_pages(page_counts: list[int], fresh_blocks: list[int], num_heads: int) -> list[list[int]]:
    num_blocks = len(fresh_blocks)
    assert sum(page_counts) == num_blocks * num_heads, (page_counts, num_blocks, num_heads)
    own = [[fresh_blocks[k] * num_heads + h for k in range(min(p, num_blocks))] for h, p in enumerate(page_counts)]
    spare = iter([fresh_blocks[k] * num_heads + h for h, p in enumerate(page_counts) for k in range(p, num_blocks)])
    for h, p in enumerate(page_counts):
        own[h].extend(next(spare) for _ in range(p - num_blocks))
    return own


def plan_compaction(config: EvictionConfig, q_window: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                    scale: float, page_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Kept mask [H, E] and pages per head [H] for keys/values [E, H, D] and window queries [w, Hq, D].

    Same result as `select_tokens`, but the allocation (Ada-KV's global sort) runs once."""
    scores = score_tokens(config.policy, q_window, keys, values, scale=scale, **config.score_options())
    page_counts = allocate_pages(scores, config.budget, page_size=page_size, **config.select_options())
    keep = keep_mask(scores, kept_counts(page_counts, scores.shape[1], page_size))
    return keep, page_counts.to(torch.int64)


def compaction_slots(keep: torch.Tensor, page_counts: torch.Tensor, fresh_blocks: list[int],
                     page_size: int) -> tuple[LayerCompaction, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Destination of every kept token: (layout, token index [M], head index [M], slot [M]).

    Slots address the per-head page view: slot = page * page_size + offset."""
    num_heads = keep.shape[0]
    device = keep.device
    head_pages = assign_head_pages(page_counts.tolist(), fresh_blocks, num_heads)
    max_p = max(len(p) for p in head_pages)
    pages = torch.tensor([p + [0] * (max_p - len(p)) for p in head_pages], dtype=torch.int32, device=device)
    head_idx, token_idx = keep.nonzero(as_tuple=True)            # row-major: per head, ascending position
    kept = keep.sum(dim=1)
    first = torch.cumsum(kept, 0) - kept
    virtual = torch.arange(head_idx.numel(), device=device) - first[head_idx]
    slot = pages[head_idx, virtual // page_size].to(torch.int64) * page_size + virtual % page_size
    layout = LayerCompaction(pages=pages, page_counts=page_counts.to(device), kept=kept)
    return layout, token_idx, head_idx, slot
