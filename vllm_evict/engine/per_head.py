"""Per-(request, KV head) virtual sequences for one layer.

Sequence (h, r) for head h of batch row r reads its own pages: for an uncompacted request that is its
blocks' slot h (block * H + h, i.e. the standard layout); for a compacted one its kept pages of this
layer followed by slot h of its tail blocks. Sequences are ordered head-major (h, r) so the query
reorder is one transpose: [T, H, g, D] -> [H, T, g, D].

Everything is built once per step for all layers (StepTables): the identity tables, token rows and
positions, and the compacted rows' pages, shifts and token slots of every layer as [L, ...] tensors.
A layer then costs two in-place indexed copies (its compacted rows' pages and token slots): no
Python loop over rows, heads or layers, and no per-layer table arithmetic.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class VirtualTables:
    pages: torch.Tensor      # [H, R, W] int32 page ids
    shift: torch.Tensor      # [H, R] int64: semantic position - virtual position
    seq_lens: torch.Tensor   # [H, R] int32 virtual lengths
    slots: torch.Tensor      # [T, H] int64 cache slot of every scheduled token's key/value


@dataclass
class CompactedBatch:
    """The compacted rows of one step, all layers."""

    rows: torch.Tensor    # [Rc] batch rows
    pages: torch.Tensor   # [L, H, Rc, Wc] int32: kept pages, then slot h of the tail blocks
    shift: torch.Tensor   # [L, H, Rc] int64 E - kept tokens
    tokens: torch.Tensor  # [Tc] scheduled tokens of compacted rows
    slots: torch.Tensor   # [L, Tc, H] int64 their cache slots


@dataclass
class StepTables:
    """Everything the per-head path reads, all layers: built by the first layer of the step (the
    per-head path runs only for batches that hold compacted rows).

    `pages` and `slots` are this step's working tables: standard layout everywhere, and each layer
    overwrites only the compacted rows' part in place (stream order makes layer l's kernels read its
    tables before layer l+1 overwrites them)."""

    pages: torch.Tensor            # [H, R, W] int32
    slots: torch.Tensor            # [T, H] int64
    seq_lens: torch.Tensor         # [L, H*R] int32 virtual lengths per layer
    shift: torch.Tensor            # [L, H, R] int64
    query_start_loc: torch.Tensor  # [H*R + 1] int32 of the head-major virtual sequences
    compacted: CompactedBatch


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


def token_slots(pages: torch.Tensor, shift: torch.Tensor, req: torch.Tensor, positions: torch.Tensor,
                page_size: int) -> torch.Tensor:
    """Cache slots [..., T, H] of tokens (batch row `req`, semantic `positions`) under per-head tables
    pages [..., H, R, W] and shift [..., H, R]."""
    vpos = positions - shift[..., req]                                   # [..., H, T]
    width = pages.shape[-1]  # gather from the flattened rows: no [..., H, T, W] copy for long chunks
    # Clamped: the identity pass also visits compacted rows' tokens, whose slots are replaced per layer.
    page = torch.gather(pages.flatten(-2), -1, req * width + (vpos // page_size).clamp(0, width - 1))
    return (page.to(torch.int64) * page_size + vpos % page_size).transpose(-1, -2)


def host_to_device(values: list[int], device: torch.device) -> torch.Tensor:
    """int64 tensor of host values; on CUDA through pinned memory without a stream sync."""
    if device.type != "cuda":
        return torch.tensor(values, dtype=torch.int64, device=device)
    return torch.tensor(values, dtype=torch.int64, pin_memory=True).to(device, non_blocking=True)


def stacked_rows(plan, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Kept pages [L, H, Rc, Pm], counts [L, H, Rc, 1] and shift [L, H, Rc] of the compacted rows.

    Reused while the batch's compacted rows stay the same requests in the same order (steady decode)."""
    key = tuple((r, plan.states[r].serial) for r in plan.compacted_rows)
    held = plan.cache.get("stacked_rows")
    if held is not None and held[0] == key:
        return held[1]
    parts = [stacked_layers(plan.states[r], device) for r in plan.compacted_rows]
    kept_width = max(p[0].shape[-1] for p in parts)
    kept = torch.stack([F.pad(p[0], (0, kept_width - p[0].shape[-1])) for p in parts], dim=2)
    counts = torch.stack([p[1] for p in parts], dim=2).unsqueeze(-1)
    shift = torch.stack([p[2] for p in parts], dim=2)
    plan.cache["stacked_rows"] = (key, (kept, counts, shift))
    return kept, counts, shift


def compacted_batch(plan, block_table: torch.Tensor, req: torch.Tensor, positions: torch.Tensor,
                    num_heads: int) -> CompactedBatch:
    device = block_table.device
    kept, counts, shift = stacked_rows(plan, device)
    kept_width = kept.shape[-1]
    rows = host_to_device(plan.compacted_rows, device)
    first = host_to_device([plan.states[r].pages for r in plan.compacted_rows], device)
    end = host_to_device([plan.row_blocks[r] for r in plan.compacted_rows], device)
    tail_len = max(max(plan.row_blocks[r] - plan.states[r].pages for r in plan.compacted_rows), 1)
    col = first.unsqueeze(1) + torch.arange(tail_len, device=device).unsqueeze(0)       # [Rc, Tm]
    tail = block_table[rows.unsqueeze(1), col.clamp(max=block_table.shape[1] - 1)].to(torch.int32)
    tail = torch.where(col < end.unsqueeze(1), tail, torch.zeros_like(tail))
    # Row (layer, head, r): kept pages, then slot h of each tail block: [L, H, Rc, Pm + Tm]
    width = kept_width + tail_len
    col = torch.arange(width, device=device)
    heads = torch.arange(num_heads, dtype=torch.int32, device=device).view(1, -1, 1, 1)
    tail_col = (col - counts).clamp(0, tail_len - 1)
    tail_pages = torch.gather(tail.view(1, 1, *tail.shape).expand(*tail_col.shape[:3], tail_len), 3, tail_col)
    pages = torch.where(col < counts, F.pad(kept, (0, tail_len)), tail_pages * num_heads + heads)
    # Scheduled tokens of the compacted rows and their slots in every layer.
    row_of = torch.full((block_table.shape[0],), -1, dtype=torch.int64, device=device)
    row_of[rows] = torch.arange(rows.numel(), device=device)
    tokens = host_to_device(plan.compacted_tokens, device)  # known on the host: no nonzero() sync
    slots = token_slots(pages, shift, row_of[req[tokens]], positions[tokens], plan.page_size)
    return CompactedBatch(rows=rows, pages=pages, shift=shift, tokens=tokens, slots=slots)


def query_start_loc(qsl: torch.Tensor, num_heads: int, num_tokens: int) -> torch.Tensor:
    starts = (torch.arange(num_heads, dtype=qsl.dtype, device=qsl.device).unsqueeze(1) * num_tokens
              + qsl[:-1].unsqueeze(0))
    return torch.cat([starts.reshape(-1), qsl.new_tensor([num_heads * num_tokens])])


def step_tables(plan, block_table: torch.Tensor, seq_lens: torch.Tensor, qsl: torch.Tensor,
                num_tokens: int, num_heads: int) -> StepTables:
    if plan.tables is not None:
        return plan.tables
    with torch.profiler.record_function("vllm_evict::step_tables"):
        plan.tables = _build_step_tables(plan, block_table, seq_lens, qsl, num_tokens, num_heads)
    return plan.tables


def _build_step_tables(plan, block_table, seq_lens, qsl, num_tokens, num_heads) -> StepTables:
    device = block_table.device
    width = min(block_table.shape[1], plan.max_blocks)
    block_table = block_table[:, :width].to(torch.int32)
    heads = torch.arange(num_heads, dtype=torch.int32, device=device).view(-1, 1, 1)
    qsl64 = qsl.to(torch.int64)
    req = torch.repeat_interleave(torch.arange(seq_lens.numel(), device=device), qsl64[1:] - qsl64[:-1],
                                  output_size=num_tokens)
    positions = seq_lens.to(torch.int64)[req] - (qsl64[req + 1] - torch.arange(num_tokens, device=device))
    compacted = compacted_batch(plan, block_table, req, positions, num_heads)
    # A compacted row may need more columns than its blocks (a head keeping more than P pages).
    pages = F.pad(block_table.unsqueeze(0) * num_heads + heads, (0, max(compacted.pages.shape[-1] - width, 0)))
    shift = torch.zeros(compacted.shift.shape[0], *pages.shape[:2], dtype=torch.int64, device=device)
    shift[:, :, compacted.rows] = compacted.shift
    lens = (seq_lens.to(torch.int64) - shift).reshape(shift.shape[0], -1).to(torch.int32)
    identity_slots = token_slots(pages, torch.zeros_like(shift[0]), req, positions, plan.page_size)
    return StepTables(pages=pages, slots=identity_slots, seq_lens=lens, shift=shift,
                      query_start_loc=query_start_loc(qsl, num_heads, num_tokens), compacted=compacted)


def virtual_tables(plan, layer: int, block_table: torch.Tensor, seq_lens: torch.Tensor,
                   query_start_loc: torch.Tensor, num_tokens: int, num_heads: int) -> VirtualTables:
    """This layer's tables. The returned pages/slots are the step's shared buffers, valid until the
    next layer's call (read them in stream order, as the attention kernels do)."""
    step = step_tables(plan, block_table, seq_lens, query_start_loc, num_tokens, num_heads)
    batch = step.compacted
    step.pages[:, :, : batch.pages.shape[-1]].index_copy_(1, batch.rows, batch.pages[layer])
    step.slots.index_copy_(0, batch.tokens, batch.slots[layer])
    return VirtualTables(pages=step.pages, shift=step.shift[layer],
                         seq_lens=step.seq_lens[layer].view(num_heads, -1), slots=step.slots)
