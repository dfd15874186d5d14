"""Per-(request, KV head) virtual sequences for one layer, for batches that hold Ada-KV-compacted rows.

Sequence (h, r) for head h of batch row r reads its own pages: for a stock-layout row (not compacted, or
compacted uniformly, whose positions the worker already shifted) that is its blocks' slot h (block * H + h,
the standard layout); for a per-head row its kept pages of this layer (compaction.py's flat-slot layout)
followed by slot h of its tail blocks. Sequences are ordered head-major (h, r) so the query
reorder is one transpose: [T, H, g, D] -> [H, T, g, D].

Everything is built once per step for all layers (StepTables): the identity tables, token rows and
positions, and the per-head rows' pages, shifts and token slots of every layer as [L, ...] tensors.
A layer then costs two in-place indexed copies (its per-head rows' pages and token slots): no
Python loop over rows, heads or layers, and no per-layer table arithmetic.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from vllm_evict.kernels.constants import device_ints
from vllm_evict.kernels.held_slots import held_slots_fused


@dataclass
class VirtualTables:
    pages: torch.Tensor      # [H, R, W] int32 page ids
    shift: torch.Tensor      # [H, R] int64: row position (worker-shifted) - head-virtual position
    seq_lens: torch.Tensor   # [H, R] int32 virtual lengths
    slots: torch.Tensor      # [T, H] int64 cache slot of every scheduled token's key/value


@dataclass
class CompactedBatch:
    """The per-head (Ada-KV) compacted rows of one step, all layers."""

    rows: torch.Tensor    # [Rc] batch rows
    pages: torch.Tensor   # [L, H, Rc, Wc] int32: kept pages, then slot h of the tail blocks
    shift: torch.Tensor   # [L, H, Rc] int64 row-virtual position - head-virtual position (F*N - kept)
    tokens: torch.Tensor  # [Tc] scheduled tokens of these rows
    slots: torch.Tensor   # [L, Tc, H] int64 their cache slots


@dataclass
class StepTables:
    """Everything the per-head path reads, all layers: built by the first layer of the step (the
    per-head path runs only for batches that hold per-head rows).

    `pages` and `slots` are this step's working tables: standard layout everywhere, and each layer
    overwrites only the per-head rows' part in place (stream order makes layer l's kernels read its
    tables before layer l+1 overwrites them)."""

    pages: torch.Tensor            # [H, R, W] int32
    slots: torch.Tensor            # [T, H] int64
    seq_lens: torch.Tensor         # [L, H*R] int32 virtual lengths per layer
    shift: torch.Tensor            # [L, H, R] int64
    query_start_loc: torch.Tensor  # [H*R + 1] int32 of the head-major virtual sequences
    compacted: CompactedBatch


def stacked_counts(state, device) -> tuple[torch.Tensor, torch.Tensor]:
    """([L, H] pages per head, [L, H] kept tokens) of a compacted request, indexed by layer index
    (layers without attention stay zero); built once per layout (request_state.WorkerEviction.advance)."""
    if state.stacked is None:
        indices, counts, kept = state.layers.stacked()
        counts, kept = counts.to(device, torch.int64), kept.to(device, torch.int64)
        if indices != list(range(len(indices))):
            where = device_ints(tuple(indices), device)
            counts = counts.new_zeros(indices[-1] + 1, counts.shape[1]).index_copy_(0, where, counts)
            kept = kept.new_zeros(counts.shape).index_copy_(0, where, kept)
        state.stacked = (counts, kept)
    return state.stacked


def token_slots(pages: torch.Tensor, shift: torch.Tensor, req: torch.Tensor, positions: torch.Tensor,
                page_size: int) -> torch.Tensor:
    """Cache slots [..., T, H] of tokens (batch row `req`, row-virtual `positions`) under per-head tables
    pages [..., H, R, W] and shift [..., H, R]."""
    vpos = positions - shift[..., req]                                   # [..., H, T]
    width = pages.shape[-1]  # gather from the flattened rows: no [..., H, T, W] copy for long chunks
    # Clamped: the identity pass also visits per-head rows' tokens, whose slots are replaced per layer.
    page = torch.gather(pages.flatten(-2), -1, req * width + (vpos // page_size).clamp(0, width - 1))
    return (page.to(torch.int64) * page_size + vpos % page_size).transpose(-1, -2)


def host_to_device(values: list[int], device: torch.device) -> torch.Tensor:
    """int64 tensor of host values; on CUDA through pinned memory without a stream sync."""
    if device.type != "cuda":
        return torch.tensor(values, dtype=torch.int64, device=device)
    return torch.tensor(values, dtype=torch.int64, pin_memory=True).to(device, non_blocking=True)


def stacked_rows(plan, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Pages per head [L, H, Rc] and kept tokens [L, H, Rc] of the per-head rows.

    Reused while the batch's per-head rows stay the same requests in the same order (steady decode)."""
    key = tuple((r, plan.states[r].serial) for r in plan.per_head_rows)
    held = plan.cache.get("stacked_rows")
    if held is not None and held[0] == key:
        return held[1]
    parts = [stacked_counts(plan.states[r], device) for r in plan.per_head_rows]
    stacked = (torch.stack([p[0] for p in parts], dim=2), torch.stack([p[1] for p in parts], dim=2))
    plan.cache["stacked_rows"] = (key, stacked)
    return stacked


def head_pages(counts: torch.Tensor, fresh: torch.Tensor, row_blocks: torch.Tensor, width: int) -> torch.Tensor:
    """Page ids [..., H, R, width] (int64) of every head's virtual sequence in R rows of per-head layout:
    its counts[..., h, r] kept pages (compaction.py's flat slots over the row's first fresh[r] blocks), then
    slot h of the row's tail blocks. counts [..., H, R] int64, fresh [R] int64, row_blocks [R, Wb] int64
    (the row's block ids); columns past a row's blocks repeat its last block (never read)."""
    num_heads, device = counts.shape[-2], counts.device
    col = torch.arange(width, device=device)
    start = torch.cumsum(counts, -2) - counts
    flat = start.unsqueeze(-1) + col                                            # [..., H, R, W]
    in_kept = col < counts.unsqueeze(-1)
    p = fresh.view(-1, 1)
    block_col = torch.where(in_kept, flat % p, p + col - counts.unsqueeze(-1))
    heads = torch.arange(num_heads, device=device).view(-1, 1, 1)
    slot = torch.where(in_kept, flat // p, heads)
    block = torch.gather(row_blocks.expand(*block_col.shape[:-2], -1, -1), -1,
                         block_col.clamp(0, row_blocks.shape[1] - 1))
    return block * num_heads + slot


def held_slots(counts: torch.Tensor, held: torch.Tensor, fresh: torch.Tensor, row_blocks: torch.Tensor, n: int,
               page_size: int) -> torch.Tensor:
    """Cache slots [R, G, n, H] (int64, -1 past a head's held count) of the first n tokens that each head of R
    requests in per-head layout holds in G layers: its head_pages, token by token. counts [R, G, H] int64 pages
    per head at the last point, held [R, G, H] int64 tokens the head holds, fresh [R] int64, row_blocks [R, Wb]
    int64. One launch on CUDA (kernels/held_slots.py)."""
    if counts.is_cuda:
        return held_slots_fused(counts, held, fresh, row_blocks, n, page_size)
    return held_slots_torch(counts, held, fresh, row_blocks, n, page_size)


def held_slots_torch(counts: torch.Tensor, held: torch.Tensor, fresh: torch.Tensor, row_blocks: torch.Tensor, n: int,
                     page_size: int) -> torch.Tensor:
    """held_slots in torch: the CPU path and the kernel's reference."""
    R, G, H = counts.shape
    pages = head_pages(counts.permute(1, 2, 0), fresh, row_blocks, -(-n // page_size))   # [G, H, R, W]
    col = torch.arange(n, device=counts.device)
    slots = pages.gather(-1, (col // page_size).expand(G, H, R, n)) * page_size + col % page_size
    slots = torch.where(col < held.permute(1, 2, 0).unsqueeze(-1), slots, -1)              # past a head's count
    return slots.permute(2, 0, 3, 1).contiguous()


def compacted_batch(plan, block_table: torch.Tensor, req: torch.Tensor, positions: torch.Tensor,
                    num_heads: int) -> CompactedBatch:
    """Tables of the per-head rows (head_pages for all of them and all layers at once)."""
    device = block_table.device
    counts, kept = stacked_rows(plan, device)                                   # [L, H, Rc]
    states = [plan.states[r] for r in plan.per_head_rows]
    rows = host_to_device(plan.per_head_rows, device)
    fresh = host_to_device([s.blocks for s in states], device)                  # F per row
    # Host bound of a head's pages: never more than F*H, nor the pages of every token written by its last point.
    width = max(min(s.blocks * num_heads, -(-s.last_at // plan.page_size)) + plan.row_blocks[r] - s.blocks
                for r, s in zip(plan.per_head_rows, states))
    pages = head_pages(counts, fresh, block_table[rows].to(torch.int64), width).to(torch.int32)
    shift = fresh.view(1, 1, -1) * plan.page_size - kept
    # Scheduled tokens of the per-head rows and their slots in every layer.
    row_of = torch.full((block_table.shape[0],), -1, dtype=torch.int64, device=device)
    row_of[rows] = torch.arange(rows.numel(), device=device)
    tokens = host_to_device(plan.per_head_tokens, device)  # known on the host: no nonzero() sync
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


# FlashAttention 3 splits a sequence's KV dynamically (by its length) only for batches of at most this many
# sequences; above it the sequences alone fill the GPU and the per-head graphs never split.
MAX_SPLIT_SEQUENCES = 992
# Splitting costs a split kernel and a combine per call even where FlashAttention then keeps one split, and
# unsplit, one CTA reads each virtual sequence: the call lasts at least as long as the longest one takes. The
# per-head graphs split when the longest sequence holds more than SPLIT_KV_RATIO times the batch's KV tokens
# per SM and more than SPLIT_KV_MIN_TOKENS (below that one CTA reads it about as fast as a split call starts).
# Fitted on the per-head call alone over 42 shapes and head spreads (H200, docs/BENCHMARKS.md):
# 0.3% slower than the faster choice on average, 6.4% at worst; always splitting (before) 6.1% and 27%.
SPLIT_KV_RATIO = 1.75
SPLIT_KV_MIN_TOKENS = 4096


def split_kv(longest: int, total: int, num_sms: int) -> bool:
    """Whether a per-head decode step lets FlashAttention split KV, for virtual sequences of `total` tokens
    whose longest holds `longest`, on `num_sms` SMs."""
    return longest > SPLIT_KV_MIN_TOKENS and longest * num_sms > SPLIT_KV_RATIO * total


class DecodeGraphTables:
    """Persistent per-head decode tables for FULL CUDA graphs (kernels/per_head_tables.py), for decode
    steps of one token per row: virtual sequence (r, h) reads query row r*H + h and writes that output row.

    FlashAttention hands its sequences to the SMs in index order, so uneven heads late in that order set
    the call's tail. Each layer's sequences are therefore given to it longest first: its pages and lengths
    are written in that order and FlashAttention 3 finds each sequence's query (and output) row through
    `order` as cu_seqlens_q with one query each (seqused_q), so queries and outputs stay in place
    (cuda_backend.ordered_decode_attention; the call 13-26% faster at head spreads 1-2).

    Owned by the CUDA metadata builder (one per KV-cache group). Every buffer is allocated once, so a
    captured decode graph reads and writes the same addresses on every replay:
    - per-row inputs fresh [R] and counts / kept [L, R, H] (int32), zero for rows without per-head
      pages, written by `load` row by row where the per-head rows changed (new requests or layouts, rows moved);
    - per-layer order [L, R*H + 1] (order[l, i]: the virtual sequence at position i; the last entry pads
      cu_seqlens_q's shape) and its inverse position [L, R*H] (int32), recomputed by `load` when the per-head
      rows or the number of rows change, for steps that replay a per-head graph, from the lengths then
      (rows grow alike from step to step); rows past the batch keep their own positions, so the first n*H
      entries permute 0 .. n*H - 1 for every graph size n of the batch;
    - per-layer outputs (pages, lens, token slots), recomputed on device inside the graph by one kernel
      per layer from vLLM's block table and (worker-shifted) seq_lens; the same launch copies the layer's
      query and, for a model-dtype cache (`writes_kv`), writes the step's keys and values to their slots;
    - every layer's queries [L, R, Hq, D] (`queries`): a per-head graph's table kernel (a staged graph's
      attention call) copies the layer's strided query there, the contiguous copy FlashAttention needs
      anyway, so the worker can record window queries after a graph replay (window_store.WindowStore.capture_all).
    """

    def __init__(self, num_layers: int, max_rows: int, num_heads: int, max_pages: int, page_size: int,
                 device: torch.device, num_q_heads: int, head_dim: int, dtype: torch.dtype,
                 queries: torch.Tensor | None = None, writes_kv: bool = False):
        self.num_heads, self.max_pages, self.page_size = num_heads, max_pages, page_size
        shape = (num_layers, max_rows, num_q_heads, head_dim)
        if queries is None or queries.shape != shape or queries.dtype != dtype or queries.device != device:
            queries = torch.empty(shape, dtype=dtype, device=device)   # else another builder's, shared
        self.queries = queries
        zeros = dict(dtype=torch.int32, device=device)
        self.fresh = torch.zeros(max_rows, **zeros)
        self.counts = torch.zeros(num_layers, max_rows, num_heads, **zeros)
        self.kept = torch.zeros(num_layers, max_rows, num_heads, **zeros)
        self.order = torch.arange(max_rows * num_heads + 1, **zeros).repeat(num_layers, 1)
        self.position = self.order[:, :-1].clone()
        self.query_counts = torch.ones(max_rows * num_heads, **zeros)     # seqused_q: one query per sequence
        self.pages = torch.zeros(max_rows * num_heads * max_pages, **zeros)
        self.lens = torch.zeros(max_rows * num_heads, **zeros)
        self.slots = torch.zeros(max_rows, num_heads, dtype=torch.int64, device=device)
        self.loaded: dict[int, int] = {}    # row -> layout serial of the per-head rows in the buffers
        self.ordered_rows = 0               # the number of rows `order` was computed for
        self._compile(writes_kv)

    def _compile(self, writes_kv: bool) -> None:
        """Compile the table kernel before graph capture as the per-head graphs launch it: with the query copy,
        and with the K/V write when they write the cache (one of the queries' dtype)."""
        device, (q_heads, dim) = self.fresh.device, self.queries.shape[2:]
        table = torch.zeros(1, 1, dtype=torch.int32, device=device)
        row = torch.zeros(1, (q_heads + 2 * self.num_heads) * dim, dtype=self.queries.dtype, device=device)
        keys, values = row[:, q_heads * dim:].view(1, 2, self.num_heads, dim).unbind(1)
        cache = torch.zeros(1, self.num_heads, self.page_size, 2 * dim, dtype=row.dtype, device=device)
        self.layer(0, table, table[0], row[:, : q_heads * dim], (keys, values, cache) if writes_kv else None)

    @property
    def max_rows(self) -> int:
        return self.fresh.shape[0]

    def load(self, plan, seq_lens: torch.Tensor) -> None:
        """Per-row inputs of the step's per-head rows (none: every row in stock layout). Only rows whose
        request or layout changed are written (steady decode: none; a decode point: its requests), and rows
        that left the per-head layout are zeroed. Then, for a step that replays a per-head graph, the order
        if those rows or the number of rows changed since it was computed, from the (worker-shifted) seq_lens."""
        if plan.num_reqs > self.max_rows:
            return
        rows = {r: plan.states[r].serial for r in plan.per_head_rows}
        if rows != self.loaded:
            self._load_rows(plan, rows)
        if plan.per_head and plan.num_reqs != self.ordered_rows:
            self._order(plan.num_reqs, seq_lens)

    def _load_rows(self, plan, rows: dict[int, int]) -> None:
        device = self.fresh.device
        stale = [r for r, serial in self.loaded.items() if rows.get(r) != serial]
        if stale:
            where = host_to_device(stale, device)
            self.fresh.index_fill_(0, where, 0)
            self.counts.index_fill_(1, where, 0)
            self.kept.index_fill_(1, where, 0)
        changed = [r for r, serial in rows.items() if self.loaded.get(r) != serial]
        if changed:
            where = host_to_device(changed, device)
            parts = [stacked_counts(plan.states[r], device) for r in changed]     # ([L, H], [L, H]) each
            num_layers = parts[0][0].shape[0]
            self.fresh.index_copy_(0, where, host_to_device([plan.states[r].blocks for r in changed],
                                                             device).to(torch.int32))
            self.counts[:num_layers].index_copy_(1, where, torch.stack([c for c, _ in parts], 1).to(torch.int32))
            self.kept[:num_layers].index_copy_(1, where, torch.stack([k for _, k in parts], 1).to(torch.int32))
        self.loaded, self.ordered_rows = rows, 0  # the lengths changed: order again when a graph needs it

    def _order(self, num_rows: int, seq_lens: torch.Tensor) -> None:
        """Each layer's virtual sequences longest first (the kernel's lengths: seq_len - P*page + kept_h),
        then the rows past the batch in their own order."""
        num_layers, max_rows, heads = self.kept.shape
        lens = torch.zeros(max_rows, dtype=torch.int64, device=self.fresh.device)
        lens[:num_rows] = seq_lens[:num_rows]
        lengths = lens.view(1, -1, 1) - (self.fresh.to(torch.int64) * self.page_size).view(1, -1, 1) + self.kept
        key = lengths.view(num_layers, -1)
        sequences = torch.arange(max_rows * heads, device=key.device)
        key[:, num_rows * heads:] = -1 - sequences[num_rows * heads:]  # below every length, in their own order
        order = torch.sort(key, dim=1, descending=True, stable=True).indices
        self.order[:, :-1].copy_(order)
        self.position.scatter_(1, order, sequences.to(torch.int32).expand(num_layers, -1))
        self.ordered_rows = num_rows

    def layer(self, layer: int, block_table: torch.Tensor, seq_lens: torch.Tensor, query: torch.Tensor,
              kv: tuple | None = None):
        """(pages [R*H, max_pages], lens [R*H] in this layer's order; slots [R*H] by (row, head)) of one layer
        for the R rows of seq_lens. In the same launch `query` [R, Hq*D] (unit stride in the last dim) is
        copied into this layer's `queries`, and kv = (keys [R, H, D], values [R, H, D], cache [blocks, H,
        page, 2*D] of their dtype), when given, writes each row's token to its slot (kernels/per_head_tables.py)."""
        from vllm_evict.kernels.per_head_tables import decode_tables

        num_rows, heads = seq_lens.shape[0], self.num_heads
        pages = self.pages[: num_rows * heads * self.max_pages].view(num_rows * heads, self.max_pages)
        lens, slots = self.lens[: num_rows * heads], self.slots[:num_rows]
        staged = self.queries[layer, :num_rows].view(num_rows, -1)
        decode_tables(block_table, seq_lens, self.fresh[:num_rows], self.counts[layer, :num_rows],
                      self.kept[layer, :num_rows], 1, self.page_size, pages, lens, slots,
                      self.position[layer, : num_rows * heads], (query, staged), kv)
        return pages, lens, slots.view(-1)
