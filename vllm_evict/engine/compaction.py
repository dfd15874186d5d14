"""Scoring + compaction of one request's prompt KV, all layers of a step at once, and the per-head page
layout.

Page layout ("flat slots"). A block holds one page per KV head, so page id = block * H_kv + slot. After
compaction a request owns P fresh blocks = P*H_kv pages per layer, numbered by flat slot
s in [0, P*H_kv): flat slot s is slot `s // P` of fresh block `s % P`. Head h with p_h pages takes the
flat slots [start_h, start_h + p_h), start_h = p_0 + ... + p_{h-1}, its kept tokens in ascending
position order. Under uniform allocation (p_h = P) head h gets slot h of every fresh block: exactly
vLLM's own layout, so a uniformly compacted request is a stock request whose positions are shifted by
E - P*page_size (see worker.py). Tokens after the eviction point go to head h's slot of the tail blocks
(the blocks after the P fresh ones), continuing after the head's kept tokens.

Compaction runs once per step, after the model forward (worker.py), over all layers of a request:
layers are folded into the head axis (layer-major: head l*H + h), so one scoring call, one selection
and one slot computation serve a group of layers; a group's gathered prompt KV is bounded by
GROUP_BYTES. Everything, Ada-KV's exact page rounding (SPEC §3.4) included, runs on the cache's device
without host synchronisation.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from vllm_evict.policies import keep_mask, kept_counts, score_tokens
from vllm_evict.policies.budget import adakv_pages
from vllm_evict.policies.config import EvictionConfig
from vllm_evict.policies.selection import stable_sort

# Gathered prompt K/V of one layer group: below the activation memory vLLM profiled for a forward pass
# (the forward's activations are free when compaction runs), so the KV cache it sized is never short.
GROUP_BYTES = 512 << 20
DUMP_DIR = os.environ.get("VLLM_EVICT_DUMP_KEEP")


@dataclass
class LayerCompaction:
    """Where one layer's kept tokens of one request live (device tensors)."""

    page_counts: torch.Tensor  # [H] int64 p_h, sums to P*H
    kept: torch.Tensor         # [H] int64 kept tokens K_h = min(E, p_h * page_size)


def select_group(config: EvictionConfig, q_window: torch.Tensor | None, keys: torch.Tensor, values: torch.Tensor,
                 scale: float, page_size: int, pages: int, num_layers: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Kept mask [L*H, E] and pages per head [L*H] (int64, on the keys' device) of keys/values [E, L*H, D]
    and window queries [w, L*Hq, D] of L layers folded into the head axis (layer-major)."""
    scores = score_tokens(config.policy, q_window, keys, values, scale=scale, **config.score_options())
    rows, n = scores.shape
    heads = rows // num_layers
    ordered, order = stable_sort(scores)  # one sort per head serves the Ada-KV head counts and the kept mask
    if config.allocation == "uniform" or heads == 1:
        page_counts = torch.full((rows,), pages, dtype=torch.int64, device=scores.device)
    else:
        page_counts = adakv_pages(scores.view(num_layers, heads, n), pages, page_size=page_size,
                                  alpha=config.alpha, max_protected=config.protected_count(n),
                                  sorted_scores=ordered.view(num_layers, heads, n)).view(-1)
    return keep_mask(scores, kept_counts(page_counts, n, page_size), order), page_counts


def compaction_slots(keep: torch.Tensor, page_counts: torch.Tensor, fresh_blocks: torch.Tensor,
                     page_size: int) -> torch.Tensor:
    """Destination slot [..., E, H] (int64, -1 = evicted) of every prompt token of every head, for kept
    masks [..., H, E] and pages per head [..., H] (leading axes: layers).

    Slots address the per-head page view: slot = page * page_size + offset."""
    num_heads = keep.shape[-2]
    num_pages = fresh_blocks.numel()
    counts = page_counts.unsqueeze(-1)
    virtual = torch.cumsum(keep, dim=-1) - 1                          # rank among the head's kept tokens
    flat = torch.cumsum(counts, -2) - counts + virtual // page_size
    block = fresh_blocks.to(torch.int64)[flat % num_pages]
    slot = (block * num_heads + flat // num_pages) * page_size + virtual % page_size
    return torch.where(keep, slot, -1).transpose(-1, -2)


def layer_groups(layers: list, prompt_len: int, num_heads: int, head_dim: int, itemsize: int) -> list[list]:
    """Consecutive layers whose gathered K and V fit GROUP_BYTES together (at least one layer each)."""
    per_layer = 2 * prompt_len * num_heads * head_dim * itemsize
    size = max(1, GROUP_BYTES // per_layer)
    return [layers[i: i + size] for i in range(0, len(layers), size)]


def compact_request(state, layers: list[tuple[int, object]], scale: float, prompt_blocks: torch.Tensor,
                    fresh_blocks: torch.Tensor) -> None:
    """Score, select and move the tokens one request holds (its prompt up to the eviction point, or for
    block-wise eviction its kept pages and the chunks since) into P blocks, in every layer.

    layers: (layer index, paged cache adapter) in layer order; `state` is the worker's WorkerEviction;
    prompt_blocks / fresh_blocks: the blocks read / written, on the cache's device. The written blocks may
    be the first P read ones (block-wise eviction): each group is gathered whole before it is written.
    Fills state.layers."""
    E, N, cache = state.held, state.page_size, layers[0][1]
    H, D = cache.num_heads, cache.head_dim
    for group in layer_groups(layers, E, H, D, cache.dtype.itemsize):
        G, caches = len(group), [layer_cache for _, layer_cache in group]
        keys = torch.empty(E, G, H, D, dtype=cache.dtype, device=cache.device)
        values = torch.empty_like(keys)
        cache.gather_layers(caches, prompt_blocks, E, keys, values)
        q_window = None
        if state.window:
            q_window = torch.stack([state.q_window[index] for index, _ in group], dim=1).flatten(1, 2)
        keep, counts = select_group(state.spec.config, q_window, keys.view(E, G * H, D), values.view(E, G * H, D),
                                    scale, N, state.pages, num_layers=G)
        keep, counts = keep.view(G, H, E), counts.view(G, H)
        cache.write_layers(caches, keys, values, compaction_slots(keep, counts, fresh_blocks, N).contiguous())
        kept = keep.sum(dim=-1)
        for i, (index, _) in enumerate(group):
            state.layers[index] = LayerCompaction(page_counts=counts[i], kept=kept[i])
            if DUMP_DIR:  # kept sets for offline comparison with a reference (GPU checks)
                point = f".c{state.done}" if state.chunk else ""  # block-wise: one file per compaction
                torch.save(keep[i].cpu(), os.path.join(DUMP_DIR, f"{state.req_id}{point}.L{index}.pt"))
