"""Per-(request, KV head) virtual sequences for one layer.

Sequence (h, r) for head h of batch row r reads its own pages: for an uncompacted request that is its
blocks' slot h (block * H + h, i.e. the standard layout); for a compacted one its kept pages of this
layer followed by slot h of its tail blocks. Sequences are ordered head-major (h, r) so the query
reorder is one permute: [T, H, g, D] -> [H, T, g, D].
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class VirtualTables:
    pages: torch.Tensor     # [H, R, W] int32 page ids
    shift: torch.Tensor     # [H, R] int64: semantic position - virtual position
    seq_lens: torch.Tensor  # [H, R] int64 virtual lengths


def virtual_tables(plan, layer: int, block_table: torch.Tensor, seq_lens: torch.Tensor,
                   num_heads: int) -> VirtualTables:
    page_size = plan.page_size
    num_reqs = block_table.shape[0]
    width = min(block_table.shape[1], int((seq_lens.max() + page_size - 1) // page_size))
    block_table = block_table[:, :width].to(torch.int32)
    heads = torch.arange(num_heads, dtype=torch.int32)
    extra = max((plan.states[r].layers[layer].pages.shape[1] for r in plan.compacted_rows), default=0)
    pages = torch.zeros(num_heads, num_reqs, width + extra, dtype=torch.int32)
    pages[:, :, :width] = block_table.unsqueeze(0) * num_heads + heads.view(-1, 1, 1)
    shift = torch.zeros(num_heads, num_reqs, dtype=torch.int64)
    for r in plan.compacted_rows:
        state = plan.states[r]
        layout = state.layers[layer]
        tail = block_table[r, state.pages:]
        for h, p in enumerate(layout.page_counts.tolist()):
            pages[h, r, :p] = layout.pages[h, :p]
            pages[h, r, p: p + tail.numel()] = tail * num_heads + h
        shift[:, r] = state.evict_at - layout.kept
    return VirtualTables(pages=pages, shift=shift, seq_lens=seq_lens.to(torch.int64).unsqueeze(0) - shift)


def token_slots(tables: VirtualTables, query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                page_size: int) -> torch.Tensor:
    """Per-head cache slot [T, H] of every scheduled token (page * page_size + offset)."""
    qsl = query_start_loc.to(torch.int64)
    num_reqs = seq_lens.numel()
    num_tokens = int(qsl[-1])
    req = torch.repeat_interleave(torch.arange(num_reqs), qsl[1:] - qsl[:-1])
    positions = seq_lens.to(torch.int64)[req] - (qsl[req + 1] - torch.arange(num_tokens))
    vpos = positions.unsqueeze(0) - tables.shift[:, req]                       # [H, T]
    heads = torch.arange(tables.pages.shape[0]).unsqueeze(1)
    page = tables.pages[heads, req.unsqueeze(0), vpos // page_size].to(torch.int64)
    return (page * page_size + vpos % page_size).T.contiguous()


def query_start_loc(qsl: torch.Tensor, num_heads: int, num_tokens: int) -> torch.Tensor:
    starts = (torch.arange(num_heads, dtype=qsl.dtype).unsqueeze(1) * num_tokens + qsl[:-1].unsqueeze(0))
    return torch.cat([starts.reshape(-1), qsl.new_tensor([num_heads * num_tokens])])
