"""Per-(request, KV head) virtual sequences for one layer.

Sequence (h, r) for head h of batch row r reads its own pages: for an uncompacted request that is its
blocks' slot h (block * H + h, i.e. the standard layout); for a compacted one its kept pages of this
layer followed by slot h of its tail blocks. Sequences are ordered head-major (h, r) so the query
reorder is one transpose: [T, H, g, D] -> [H, T, g, D].

Everything layer-independent (identity tables, token rows and positions, the compacted rows' pages of
all layers) is built once per step (StepTables); each layer then only overwrites its compacted rows
with a few batched tensor ops: no Python loop over rows or heads per layer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class VirtualTables:
    pages: torch.Tensor      # [H, R, W] int32 page ids
    shift: torch.Tensor      # [H, R] int64: semantic position - virtual position
    seq_lens: torch.Tensor   # [H, R] int64 virtual lengths
    req: torch.Tensor        # [T] batch row of every scheduled token
    positions: torch.Tensor  # [T] semantic position of every scheduled token


@dataclass
class CompactedBatch:
    """The compacted rows of one step, all layers: built once per step, read by every layer."""

    rows: torch.Tensor    # [Rc] batch rows
    pages: torch.Tensor   # [Rc, L, H, Pm] int32 kept pages (padded)
    counts: torch.Tensor  # [Rc, L, H] int64 pages per head
    shift: torch.Tensor   # [Rc, L, H] int64 E - kept tokens
    tail: torch.Tensor    # [Rc, Tm] int32 tail blocks (padded with 0)


@dataclass
class StepTables:
    """Everything of the per-head tables that does not depend on the layer: built by the first layer."""

    identity: torch.Tensor        # [H, R, W] int32 standard-layout pages (slot h of each block)
    req: torch.Tensor             # [T]
    positions: torch.Tensor       # [T]
    compacted: CompactedBatch | None


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
    return CompactedBatch(rows=rows, pages=pages, counts=counts, shift=shift, tail=tail)


def step_tables(plan, block_table: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor,
                num_tokens: int, num_heads: int) -> StepTables:
    if plan.tables is not None:
        return plan.tables
    device = block_table.device
    width = min(block_table.shape[1], plan.max_blocks)
    block_table = block_table[:, :width].to(torch.int32)
    compacted = compacted_batch(plan, block_table) if plan.compacted_rows else None
    extra = compacted.pages.shape[-1] if compacted is not None else 0
    heads = torch.arange(num_heads, dtype=torch.int32, device=device).view(-1, 1, 1)
    identity = F.pad(block_table.unsqueeze(0) * num_heads + heads, (0, extra))
    qsl = query_start_loc.to(torch.int64)
    req = torch.repeat_interleave(torch.arange(seq_lens.numel(), device=device), qsl[1:] - qsl[:-1],
                                  output_size=num_tokens)
    positions = seq_lens.to(torch.int64)[req] - (qsl[req + 1] - torch.arange(num_tokens, device=device))
    plan.tables = StepTables(identity=identity, req=req, positions=positions, compacted=compacted)
    return plan.tables


def virtual_tables(plan, layer: int, block_table: torch.Tensor, seq_lens: torch.Tensor,
                   query_start_loc: torch.Tensor, num_tokens: int, num_heads: int) -> VirtualTables:
    step = step_tables(plan, block_table, seq_lens, query_start_loc, num_tokens, num_heads)
    pages = step.identity
    shift = torch.zeros(pages.shape[:2], dtype=torch.int64, device=pages.device)
    batch = step.compacted
    if batch is not None:
        pages = pages.clone()
        full = pages.shape[-1]
        num_rows, tail_len = batch.tail.shape
        col = torch.arange(full, device=pages.device)
        heads = torch.arange(num_heads, dtype=torch.int32, device=pages.device).view(1, -1, 1)
        counts = batch.counts[:, layer].unsqueeze(-1)                                  # [Rc, H, 1]
        kept_pages = F.pad(batch.pages[:, layer], (0, full - batch.pages.shape[-1]))     # [Rc, H, W]
        tail_col = (col - counts).clamp(0, tail_len - 1)                                  # [Rc, H, W]
        tail_pages = torch.gather(batch.tail.unsqueeze(1).expand(num_rows, num_heads, tail_len), 2, tail_col)
        rows_pages = torch.where(col < counts, kept_pages, tail_pages * num_heads + heads)
        pages[:, batch.rows] = rows_pages.transpose(0, 1)
        shift[:, batch.rows] = batch.shift[:, layer].T
    return VirtualTables(pages=pages, shift=shift, seq_lens=seq_lens.to(torch.int64).unsqueeze(0) - shift,
                         req=step.req, positions=step.positions)


def token_slots(tables: VirtualTables, page_size: int) -> torch.Tensor:
    """Per-head cache slot [T, H] of every scheduled token (page * page_size + offset)."""
    vpos = tables.positions.unsqueeze(0) - tables.shift[:, tables.req]             # [H, T]
    heads = torch.arange(tables.pages.shape[0], device=vpos.device).unsqueeze(1)
    page = tables.pages[heads, tables.req.unsqueeze(0), vpos // page_size].to(torch.int64)
    return (page * page_size + vpos % page_size).T.contiguous()


def query_start_loc(qsl: torch.Tensor, num_heads: int, num_tokens: int) -> torch.Tensor:
    starts = (torch.arange(num_heads, dtype=qsl.dtype, device=qsl.device).unsqueeze(1) * num_tokens
              + qsl[:-1].unsqueeze(0))
    return torch.cat([starts.reshape(-1), qsl.new_tensor([num_heads * num_tokens])])
