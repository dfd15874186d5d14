"""Per-(request, KV head) virtual sequences for one layer.

Sequence (h, r) for head h of batch row r reads its own pages: for an uncompacted request that is its
blocks' slot h (block * H + h, i.e. the standard layout); for a compacted one its kept pages of this
layer followed by slot h of its tail blocks. Sequences are ordered head-major (h, r) so the query
reorder is one transpose: [T, H, g, D] -> [H, T, g, D].

The compacted rows' per-layer pages are stacked once per step (CompactedBatch) and every layer then
builds its tables with a few batched tensor ops: no Python loop over rows or heads per layer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class VirtualTables:
    pages: torch.Tensor     # [H, R, W] int32 page ids
    shift: torch.Tensor     # [H, R] int64: semantic position - virtual position
    seq_lens: torch.Tensor  # [H, R] int64 virtual lengths


@dataclass
class CompactedBatch:
    """The compacted rows of one step, all layers: built once per step, read by every layer."""

    rows: torch.Tensor    # [Rc] batch rows
    pages: torch.Tensor   # [Rc, L, H, Pm] int32 kept pages (padded)
    counts: torch.Tensor  # [Rc, L, H] int64 pages per head
    shift: torch.Tensor   # [Rc, L, H] int64 E - kept tokens
    tail: torch.Tensor    # [Rc, Tm] int32 tail blocks (padded with 0)


def stacked_layers(state, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """([L, H, Pm] pages, [L, H] counts, [L, H] shift) of a compacted request; built once."""
    if state.stacked is None:  # indexed by layer index (layers without attention stay zero)
        num_layers = max(state.layers) + 1
        num_heads = next(iter(state.layers.values())).pages.shape[0]
        width = max(layout.pages.shape[1] for layout in state.layers.values())
        pages = torch.zeros(num_layers, num_heads, width, dtype=torch.int32, device=device)
        counts = torch.zeros(num_layers, num_heads, dtype=torch.int64, device=device)
        shift = torch.zeros(num_layers, num_heads, dtype=torch.int64, device=device)
        for i, layout in state.layers.items():
            pages[i, :, : layout.pages.shape[1]] = layout.pages.to(device)
            counts[i] = layout.page_counts.to(device=device, dtype=torch.int64)
            shift[i] = state.evict_at - layout.kept.to(device=device, dtype=torch.int64)
        state.stacked = (pages, counts, shift)
    return state.stacked


def compacted_batch(plan, block_table: torch.Tensor) -> CompactedBatch:
    if plan.compacted is not None:
        return plan.compacted
    device = block_table.device
    parts = [stacked_layers(plan.states[r], device) for r in plan.compacted_rows]
    width = max(p[0].shape[-1] for p in parts)
    pages = torch.stack([F.pad(p[0], (0, width - p[0].shape[-1])) for p in parts])
    counts = torch.stack([p[1] for p in parts])
    shift = torch.stack([p[2] for p in parts])
    rows = torch.tensor(plan.compacted_rows, device=device)
    first = torch.tensor([plan.states[r].pages for r in plan.compacted_rows], device=device)
    end = torch.tensor([plan.row_blocks[r] for r in plan.compacted_rows], device=device)
    tail_len = max(max(plan.row_blocks[r] - plan.states[r].pages for r in plan.compacted_rows), 1)
    col = first.unsqueeze(1) + torch.arange(tail_len, device=device).unsqueeze(0)       # [Rc, Tm]
    tail = block_table[rows.unsqueeze(1), col.clamp(max=block_table.shape[1] - 1)].to(torch.int32)
    tail = torch.where(col < end.unsqueeze(1), tail, torch.zeros_like(tail))
    plan.compacted = CompactedBatch(rows=rows, pages=pages, counts=counts, shift=shift, tail=tail)
    return plan.compacted


def virtual_tables(plan, layer: int, block_table: torch.Tensor, seq_lens: torch.Tensor,
                   num_heads: int) -> VirtualTables:
    device = block_table.device
    num_reqs = block_table.shape[0]
    width = min(block_table.shape[1], plan.max_blocks)
    block_table = block_table[:, :width].to(torch.int32)
    heads = torch.arange(num_heads, dtype=torch.int32, device=device)
    batch = compacted_batch(plan, block_table) if plan.compacted_rows else None
    extra = batch.pages.shape[-1] if batch is not None else 0
    pages = torch.zeros(num_heads, num_reqs, width + extra, dtype=torch.int32, device=device)
    pages[:, :, :width] = block_table.unsqueeze(0) * num_heads + heads.view(-1, 1, 1)
    shift = torch.zeros(num_heads, num_reqs, dtype=torch.int64, device=device)
    if batch is not None:
        full = width + extra
        num_rows, tail_len = batch.tail.shape
        col = torch.arange(full, device=device)
        counts = batch.counts[:, layer].unsqueeze(-1)                                  # [Rc, H, 1]
        kept_pages = F.pad(batch.pages[:, layer], (0, full - extra))                     # [Rc, H, W]
        tail_col = (col - counts).clamp(0, tail_len - 1)                                  # [Rc, H, W]
        tail_pages = torch.gather(batch.tail.unsqueeze(1).expand(num_rows, num_heads, tail_len), 2, tail_col)
        tail_pages = tail_pages * num_heads + heads.view(1, -1, 1)
        rows_pages = torch.where(col < counts, kept_pages, tail_pages)
        pages[:, batch.rows] = rows_pages.transpose(0, 1)
        shift[:, batch.rows] = batch.shift[:, layer].T
    return VirtualTables(pages=pages, shift=shift, seq_lens=seq_lens.to(torch.int64).unsqueeze(0) - shift)


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
