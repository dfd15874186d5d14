"""Per-(request, KV head) virtual sequences for one layer.

Sequence (h, r) for head h of batch row r reads its own pages: for an uncompacted request that is its
blocks' slot h (block * H + h, i.e. the standard layout); for a compacted one its kept pages of this
layer followed by slot h of its tail blocks. Sequences are ordered head-major (h, r) so the query
reorder is one transpose: [T, H, g, D] -> [H, T, g, D].
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
    device = block_table.device
    page_size = plan.page_size
    num_reqs = block_table.shape[0]
    width = min(block_table.shape[1], plan.max_blocks)
    block_table = block_table[:, :width].to(torch.int32)
    heads = torch.arange(num_heads, dtype=torch.int32, device=device)
    extra = max((plan.states[r].layers[layer].pages.shape[1] for r in plan.compacted_rows), default=0)
    pages = torch.zeros(num_heads, num_reqs, width + extra, dtype=torch.int32, device=device)
    pages[:, :, :width] = block_table.unsqueeze(0) * num_heads + heads.view(-1, 1, 1)
    shift = torch.zeros(num_heads, num_reqs, dtype=torch.int64, device=device)
    if plan.compacted_rows:
        rows, shifts = [], []
        for r in plan.compacted_rows:
            state = plan.states[r]
            tail = block_table[r, state.pages: plan.row_blocks[r]]
            row, row_shift = _compacted_row(state, layer, tail, num_heads)
            rows.append(torch.nn.functional.pad(row, (0, width + extra - row.shape[1])))
            shifts.append(row_shift)
        index = torch.tensor(plan.compacted_rows, device=device)
        pages[:, index] = torch.stack(rows, dim=1)
        shift[:, index] = torch.stack(shifts, dim=1).to(torch.int64)
    return VirtualTables(pages=pages, shift=shift, seq_lens=seq_lens.to(torch.int64).unsqueeze(0) - shift)


def _compacted_row(state, layer: int, tail: torch.Tensor, num_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """([H, max_p + tail] pages, [H] shift) of a compacted request in one layer: its kept pages, then
    slot h of its tail blocks. Cached per layer until a tail block is added."""
    cached = state.table_cache.get(layer)
    if cached is not None and cached[0] == tail.numel():
        return cached[1], cached[2]
    device = tail.device
    layout = state.layers[layer]
    width = layout.pages.shape[1] + tail.numel()
    counts = layout.page_counts.to(device).unsqueeze(1)                        # [H, 1]
    col = torch.arange(width, device=device).unsqueeze(0)
    heads = torch.arange(num_heads, dtype=torch.int32, device=device).unsqueeze(1)
    own = torch.zeros(num_heads, width, dtype=torch.int32, device=device)
    own[:, : layout.pages.shape[1]] = layout.pages
    if tail.numel():
        tail_pages = tail[(col - counts).clamp(0, tail.numel() - 1)] * num_heads + heads
    else:
        tail_pages = torch.zeros_like(own)
    row = torch.where(col < counts, own, tail_pages)
    shift = (state.evict_at - layout.kept).to(device=device, dtype=torch.int64)
    state.table_cache[layer] = (tail.numel(), row, shift)
    return row, shift


def token_slots(tables: VirtualTables, query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                page_size: int, num_tokens: int) -> torch.Tensor:
    """Per-head cache slot [T, H] of every scheduled token (page * page_size + offset)."""
    device = seq_lens.device
    qsl = query_start_loc.to(torch.int64)
    num_reqs = seq_lens.numel()
    req = torch.repeat_interleave(torch.arange(num_reqs, device=device), qsl[1:] - qsl[:-1],
                                  output_size=num_tokens)
    positions = seq_lens.to(torch.int64)[req] - (qsl[req + 1] - torch.arange(num_tokens, device=device))
    vpos = positions.unsqueeze(0) - tables.shift[:, req]                       # [H, T]
    heads = torch.arange(tables.pages.shape[0], device=device).unsqueeze(1)
    page = tables.pages[heads, req.unsqueeze(0), vpos // page_size].to(torch.int64)
    return (page * page_size + vpos % page_size).T.contiguous()


def query_start_loc(qsl: torch.Tensor, num_heads: int, num_tokens: int) -> torch.Tensor:
    starts = (torch.arange(num_heads, dtype=qsl.dtype, device=qsl.device).unsqueeze(1) * num_tokens
              + qsl[:-1].unsqueeze(0))
    return torch.cat([starts.reshape(-1), qsl.new_tensor([num_heads * num_tokens])])
