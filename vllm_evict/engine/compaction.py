"""Scoring + compaction of one request's prompt KV, all layers of a step at once, and the per-head page
layout.

Page layout ("flat slots"). A block holds one page per KV head of the rank, so page id = block * H + slot
(H = H_kv / TP heads per rank). After compaction a request owns F fresh blocks = F*H pages per layer,
numbered by flat slot s in [0, F*H): flat slot s is slot `s // F` of fresh block `s % F`. Head h with p_h
pages takes the flat slots [start_h, start_h + p_h), start_h = p_0 + ... + p_{h-1}, its kept tokens in
ascending position order. F = P, except for Ada-KV under tensor parallelism (below). Under uniform
allocation (p_h = P) head h gets slot h of every fresh block: exactly vLLM's own layout, so a uniformly
compacted request is a stock request whose positions are shifted by E - P*page_size (see worker.py).
Tokens after the eviction point go to head h's slot of the tail blocks (the blocks after the F fresh
ones), continuing after the head's kept tokens.

Ada-KV under tensor parallelism allocates a layer's P*H_kv pages over all H_kv heads (DESIGN.md §3.4), as at
TP=1: the ranks all-gather their heads' scores and each takes its own heads' counts (KVHeadGroup). A
rank's heads may then win more than P*H pages, up to min(P*H_kv, H*ceil(E/page_size)); the scheduler
reserves F = min(P*H_kv/H, ceil(E/page_size)) fresh blocks for such a request so that every rank fits
(scheduler.plan_eviction), before any score exists. The layout spans only the F' <= F blocks that the
fullest rank fills (over all layers; every rank computes the same F'), and the workers report F' so the
scheduler frees the other F - F' (worker.py). Under pipeline parallelism F' = F: no stage sees the layers
of the others, and the scheduler hears from the last stage only.

Compaction runs once per step, after the model forward (worker.py), over all layers of a request:
layers are folded into the head axis (layer-major: head l*H + h), so one scoring call, one selection
and one slot computation serve a group of layers; a group's gathered prompt KV is bounded by
group_bytes (half the activation memory vLLM profiled, at least GROUP_BYTES). Everything, Ada-KV's exact
page rounding (DESIGN.md §3.4) included, runs on the cache's device without host synchronisation.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import MutableMapping
from dataclasses import dataclass

import torch

from vllm_evict.engine.per_head import held_slots, host_to_device, stacked_counts
from vllm_evict.kernels.adakv_pages import adakv_pages_fused
from vllm_evict.kernels.compaction_slots import compaction_slots_fused
from vllm_evict.kernels.constants import device_ints
from vllm_evict.policies import POLICIES, keep_mask, kept_counts, score_tokens
from vllm_evict.policies.budget import adakv_pages
from vllm_evict.policies.config import EvictionConfig
from vllm_evict.policies.random import TokenContext
from vllm_evict.policies.selection import stable_sort

# Gathered K/V of one compaction batch, at least: below the activation memory vLLM profiles for a forward
# pass of any served model (the forward's activations are free when compaction runs), so the KV cache it
# sized is never short. An engine raises it to half the activation memory it profiled (group_bytes).
GROUP_BYTES = 512 << 20
DUMP_DIR = os.environ.get("VLLM_EVICT_DUMP_KEEP")


def group_bytes(peak_activation_bytes: int | None) -> int:
    """The gathered K/V one compaction batch may hold on an engine whose profiled forward peaked at
    peak_activation_bytes (vLLM keeps that much outside the KV cache): half of it, the other half for the
    scores and slot tables beside them, and at least GROUP_BYTES. Fewer, larger batches cost less host time
    (each batch is a fixed set of launches per layer group)."""
    return max(GROUP_BYTES, (peak_activation_bytes or 0) // 2)


@dataclass(frozen=True)
class KVHeadGroup:
    """This rank's KV heads among a layer's H_kv: vLLM's tensor parallelism gives rank r heads
    [r*H, (r+1)*H) of H_kv = H*TP, or, when H_kv < TP, the one head r // (TP/H_kv) (replicated)."""

    rank: int = 0
    world: int = 1       # TP
    total: int = 0       # H_kv (0: this rank's heads are all the heads)
    stages: int = 1      # PP: each stage holds its own layers

    def num_heads(self, local: int) -> int:
        """H_kv, for a rank holding `local` heads."""
        return self.total or local

    @property
    def replicas(self) -> int:
        return max(1, self.world // self.total) if self.total else 1

    def merge(self, gathered: torch.Tensor) -> torch.Tensor:
        """[L, H_kv, ...] of every rank's [L, H, ...] stacked as [TP, L, H, ...] (each head once)."""
        distinct = gathered[:: self.replicas]
        return distinct.transpose(0, 1).flatten(1, 2)

    def all_heads(self, local: torch.Tensor) -> torch.Tensor:
        """[L, H_kv, ...] from this rank's [L, H, ...]: a TP collective, so every rank calls it, in the same
        order (all ranks compact the same requests in the same steps)."""
        if self.world == 1:
            return local
        from vllm.distributed import tensor_model_parallel_all_gather

        return self.merge(gather_as_float(tensor_model_parallel_all_gather, local.unsqueeze(0).contiguous()))

    def global_heads(self, local: int) -> list[int]:
        """The layer-wide indices of this rank's `local` heads."""
        start = self.rank // self.replicas * local
        return list(range(start, start + local))

    def local(self, per_head: torch.Tensor) -> torch.Tensor:
        """This rank's heads [L, H, ...] of [L, H_kv, ...]."""
        if self.world == 1:
            return per_head
        groups = self.world // self.replicas
        size = per_head.shape[1] // groups
        start = self.rank // self.replicas * size
        return per_head[:, start: start + size]


# Every vLLM communicator gathers these; vLLM's CPU shared-memory one (AVX-512 builds) gathers nothing else
GATHERED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def gather_as_float(all_gather, local: torch.Tensor) -> torch.Tensor:
    """all_gather(local, dim=0) of a contiguous tensor (at least 1-D) of any dtype whose items are whole
    4-byte words (int64 page counts, float64 scores), sent as float32 bit patterns: a gather copies
    bytes, so the words come back exactly."""
    if local.dtype in GATHERED_DTYPES:
        return all_gather(local, dim=0)
    if local.dtype.itemsize % 4:
        raise TypeError(f"cannot gather {local.dtype} across ranks as float32 words")
    return all_gather(local.view(torch.float32), dim=0).view(local.dtype)


@dataclass
class LayerCompaction:
    """Where one layer's kept tokens of one request live (device tensors)."""

    page_counts: torch.Tensor  # [H] int64 p_h: sums to P*H, or (Ada-KV under TP) to this rank's share of P*H_kv
    kept: torch.Tensor         # [H] int64 kept tokens K_h = min(E, p_h * page_size)


class LayerLayouts(MutableMapping):
    """A request's LayerCompaction by layer index, recorded a layer group at a time: an entry points into the
    group's [G, H] tensors, and a layer's LayerCompaction is made when it is read (per-head tables, the random
    policy's positions; never for uniform layouts). Recording makes no tensor view per layer: a compaction
    step of many requests and layers would otherwise spend its host time on them."""

    def __init__(self) -> None:
        self._entries: dict[int, tuple[torch.Tensor, torch.Tensor, int]] = {}

    def record(self, indices: list[int], page_counts: torch.Tensor, kept: torch.Tensor) -> None:
        """Layers `indices` of a group, page_counts and kept [G, H]."""
        for i, index in enumerate(indices):
            self._entries[index] = (page_counts, kept, i)

    def stacked(self) -> tuple[list[int], torch.Tensor, torch.Tensor]:
        """(the recorded layer indices in order, page counts [n, H], kept [n, H] in that order): the recorded
        groups' rows sliced and concatenated, not a view per layer (a group's layers are consecutive in that
        order, so each group is one slice)."""
        indices = sorted(self._entries)
        runs = []  # [page_counts, kept, first row, rows] of consecutive rows of one recorded group
        for index in indices:
            page_counts, kept, i = self._entries[index]
            run = runs[-1] if runs else None
            if run is not None and run[0] is page_counts and run[1] is kept and run[2] + run[3] == i:
                run[3] += 1
            else:
                runs.append([page_counts, kept, i, 1])
        counts = [page_counts.narrow(0, first, rows) for page_counts, _, first, rows in runs]
        kept = [kept.narrow(0, first, rows) for _, kept, first, rows in runs]
        if len(runs) == 1:
            return indices, counts[0], kept[0]
        return indices, torch.cat(counts), torch.cat(kept)

    def follow(self, other: "LayerLayouts") -> None:
        """Record every layer's layout of `other` (a captured batch's, the same for all its requests)."""
        self._entries.update(other._entries)

    def __setitem__(self, index: int, layout: LayerCompaction) -> None:
        self._entries[index] = (layout.page_counts[None], layout.kept[None], 0)

    def __getitem__(self, index: int) -> LayerCompaction:
        page_counts, kept, i = self._entries[index]
        return LayerCompaction(page_counts=page_counts[i], kept=kept[i])

    def __delitem__(self, index: int) -> None:
        del self._entries[index]

    def __iter__(self):
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)


def select_group(config: EvictionConfig, q_window: torch.Tensor | None, keys: torch.Tensor, values: torch.Tensor,
                 scale: float, page_size: int, pages: int, num_layers: int = 1,
                 heads: KVHeadGroup = KVHeadGroup(), options: dict | None = None,
                 context: TokenContext | None = None,
                 lengths: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Kept mask [L*H, E] and pages per head [L*H] (int64, on the keys' device) of keys/values [E, L*H, D]
    and window queries [w, L*Hq, D] of L layers folded into the head axis (layer-major); `heads`: where
    these H heads sit among the layer's (Ada-KV allocates over all of them); `options`: score_tokens
    options (default: the config's); `context`: where the tokens sit (the random policy); `lengths` [L*H]:
    each head's candidates, the first lengths[i] of its E (None: all E; DESIGN.md §4.8 a's uneven held sets)."""
    options = config.score_options() if options is None else options
    scores = score_tokens(config.policy, q_window, keys, values, scale=scale, context=context, lengths=lengths,
                          **options)
    rows, n = scores.shape
    local = rows // num_layers
    ordered, order = stable_sort(scores)  # one sort per head serves the Ada-KV head counts and the kept mask
    if config.allocation == "uniform" or heads.num_heads(local) == 1:
        page_counts = torch.full((rows,), pages, dtype=torch.int64, device=scores.device)
    else:
        # the allocation reads each head's scores as a multiset (the B-th largest, counts above it, +inf
        # counts), so the sorted scores serve as both arguments: one all-gather under TP, not two
        ordered_all = heads.all_heads(ordered.view(num_layers, local, n))
        held = None if lengths is None else heads.all_heads(lengths.view(num_layers, local))
        terms = dict(page_size=page_size, alpha=config.alpha, max_protected=config.protected_count(n), lengths=held)
        if ordered_all.is_cuda and ordered_all.dtype == torch.float32:  # one launch where the reference has ~70
            page_counts = adakv_pages_fused(ordered_all, pages, **terms)
        else:
            page_counts = adakv_pages(ordered_all, pages, sorted_scores=ordered_all, **terms)
        page_counts = heads.local(page_counts).reshape(-1)
    return keep_mask(scores, kept_counts(page_counts, n if lengths is None else lengths, page_size), order), page_counts


def compaction_slots(keep: torch.Tensor, page_counts: torch.Tensor, fresh_blocks: torch.Tensor,
                     page_size: int, num_blocks: int | torch.Tensor | None = None) -> torch.Tensor:
    """Destination slot [..., E, H] (int64, -1 = evicted) of every prompt token of every head, for kept
    masks [..., H, E] and pages per head [..., H] (leading axes: layers, or requests then layers), laid out
    over the first `num_blocks` fresh blocks (default: all; a device scalar is read without a host sync)
    of fresh_blocks [F], or [R, F] for R requests (the leading axis of keep).

    Slots address the per-head page view: slot = page * page_size + offset. On CUDA one launch
    (kernels/compaction_slots.py), where the torch form issues ~20 kernels over int64 [..., H, E] tensors."""
    if keep.is_cuda:
        return compaction_slots_fused(keep, page_counts, fresh_blocks, page_size, num_blocks)
    return compaction_slots_torch(keep, page_counts, fresh_blocks, page_size, num_blocks)


def compaction_slots_torch(keep: torch.Tensor, page_counts: torch.Tensor, fresh_blocks: torch.Tensor,
                           page_size: int, num_blocks: int | torch.Tensor | None = None) -> torch.Tensor:
    """compaction_slots in torch: the CPU path and the kernel's reference (a transposed view [..., E, H])."""
    num_heads = keep.shape[-2]
    num_pages = fresh_blocks.shape[-1] if num_blocks is None else num_blocks
    counts = page_counts.unsqueeze(-1)
    virtual = torch.cumsum(keep, dim=-1) - 1                          # rank among the head's kept tokens
    flat = torch.cumsum(counts, -2) - counts + virtual // page_size
    index = flat % num_pages
    if fresh_blocks.dim() == 2:  # each request's own row
        rows = torch.arange(fresh_blocks.shape[0], device=index.device) * fresh_blocks.shape[1]
        index = index + rows.view(-1, *[1] * (index.dim() - 1))
    block = fresh_blocks.to(torch.int64).reshape(-1)[index]
    slot = (block * num_heads + flat // num_pages) * page_size + virtual % page_size
    return torch.where(keep, slot, -1).transpose(-1, -2)


def layer_groups(layers: list, prompt_len: int, group_bytes: int = GROUP_BYTES) -> list[list]:
    """Consecutive layers of one cache layout (a TurboQuant model keeps its boundary layers in the model
    dtype) whose gathered K and V (prompt_len tokens of each head, the adapter's gathered_bytes each,
    dequantized copies included) fit group_bytes together (at least one layer each)."""
    groups = []
    for _, run in itertools.groupby(layers, key=lambda item: stored_layout(item[1])):
        run = list(run)
        cache = run[0][1]
        size = max(1, group_bytes // (prompt_len * cache.num_heads * cache.gathered_bytes))
        groups += [run[i: i + size] for i in range(0, len(run), size)]
    return groups


def stored_layout(cache) -> tuple:
    """What layers must share to be gathered, scored and written together: the adapter and what a half holds."""
    return type(cache), cache.stored_dim, cache.dtype


def batch_key(state) -> tuple | None:
    """Requests whose keys are equal (not None) at their next point can be compacted together
    (compact_requests): same policy and options, same point geometry. None: compacted alone (the policies
    that read where tokens sit, Ada-KV under TP's deferred layout, the kept-set dumps)."""
    point, config = state.point, state.point.config
    if POLICIES[config.policy].needs_context or state.deferred or DUMP_DIR:
        return None
    return (config, point.held, point.fixed, point.kept, point.pages, point.window, point.sink, point.in_place,
            None if point.in_place else state.blocks, state.stock_layout)


def gathered_width(states: list) -> int:
    """Tokens per head a batch's compaction gathers: the most any of its requests holds. In per-head layout
    that is its fullest head, rounded up to one of eight widths an octave (whole pages), so that batches
    of nearly equal fill share one captured graph (compaction_graphs.py); a head's tokens past its count
    are masked, so the width changes no kept set."""
    held = max(state.gathered_tokens for state in states)
    if states[0].stock_layout:  # one batch key: one layout
        return held
    page = states[0].page_size
    step = page * max(1, (1 << max(held.bit_length() - 3, 0)) // page)
    return -(-held // step) * step


@dataclass
class PerHeadInputs:
    """What a batch of R requests in per-head layout reads to gather what each head holds (by layer index,
    all layers): their layouts at the last point and two host values each, on the cache's device."""

    counts: torch.Tensor   # [R, L, H] int64 pages per head
    kept: torch.Tensor     # [R, L, H] int64 tokens kept per head
    scalars: torch.Tensor  # [2, R] int64 tokens written since the last point; blocks the layout spans

    @classmethod
    def of(cls, states: list, device) -> "PerHeadInputs":
        stacked = [stacked_counts(state, device) for state in states]                     # ([L, H], [L, H])
        return cls(torch.stack([c for c, _ in stacked]), torch.stack([k for _, k in stacked]),
                   host_to_device(cls.host_values(states), device).view(2, -1))

    @staticmethod
    def host_values(states: list) -> list[int]:
        return [s.point.at - s.last_at for s in states] + [s.blocks for s in states]

    @property
    def since(self) -> torch.Tensor:
        return self.scalars[0]

    @property
    def fresh(self) -> torch.Tensor:
        return self.scalars[1]

    def load(self, states: list) -> None:
        """Copy another batch's inputs (as many requests, as many layers) into these tensors (static ones)."""
        stacked = [stacked_counts(state, self.counts.device) for state in states]
        torch.stack([c for c, _ in stacked], out=self.counts)
        torch.stack([k for _, k in stacked], out=self.kept)
        values = torch.tensor(self.host_values(states), dtype=torch.int64, pin_memory=self.scalars.is_cuda)
        self.scalars.view(-1).copy_(values, non_blocking=True)


def token_head_bytes(layers: list[tuple[int, object]]) -> int:
    """The largest of the layers' gathered bytes per token and head (layouts may differ between layers)."""
    return max(cache.gathered_bytes for _, cache in layers)


def compaction_batches(states: list, num_layers: int, num_heads: int, token_head_bytes: int,
                       group_bytes: int = GROUP_BYTES) -> list[list]:
    """The requests of one step, in batches for compact_requests: equal batch keys, at most as many as fit
    group_bytes with all their layers (a request too large for that is a batch of its own)."""
    batches, open_batches = [], {}
    for state in states:
        key = batch_key(state)
        per_request = state.gathered_tokens * num_layers * num_heads * token_head_bytes
        batch = open_batches.get(key) if key is not None else None
        if batch is None or (len(batch) + 1) * per_request > group_bytes:
            batch = []
            batches.append(batch)
            if key is not None:
                open_batches[key] = batch
        batch.append(state)
    return batches


def compact_request(state, layers: list[tuple[int, object]], scale: float, prompt_blocks: torch.Tensor,
                    fresh_blocks: torch.Tensor, heads: KVHeadGroup = KVHeadGroup(),
                    group_bytes: int = GROUP_BYTES) -> torch.Tensor | None:
    """compact_requests for one request."""
    return compact_requests([(state, prompt_blocks, fresh_blocks)], layers, scale, heads, group_bytes=group_bytes)


def compact_requests(requests: list[tuple], layers: list[tuple[int, object]], scale: float,
                     heads: KVHeadGroup = KVHeadGroup(), rotation: torch.Tensor | None = None,
                     followers: dict[int, list] | None = None, group_bytes: int = GROUP_BYTES,
                     inputs: PerHeadInputs | None = None) -> torch.Tensor | None:
    """Score, select and move the tokens each request holds at its next compaction point (request_config.Point:
    its prompt up to E, or, evicting again, its kept pages and the tokens since) into their blocks, in every
    layer. Several requests (one batch_key) fold into the head axis next to the layers, so one scoring call,
    one selection, one slot computation, one gather and one write launch per layer group serve all of them.

    requests: (state, prompt_blocks, fresh_blocks) each: the worker's WorkerEviction and the blocks read /
    written, on the cache's device; the written blocks may be the first read ones (compaction in place):
    each group is gathered whole before it is written. A request already in per-head (Ada-KV) layout is
    gathered head by head: each head holds its own count (DESIGN.md §4.8 a), padded to the batch's largest.
    layers: (layer index, paged cache adapter) in layer order. heads: this rank's KV heads among the
    layer's (tensor parallelism). rotation: the model's mean RoPE move to future positions (expected attention).
    followers: {layer index: [(layer index, cache)]} layers that keep, head by head, the tokens that layer
    keeps (a draft model's layers in the same KV cache group; uniform allocation only, DESIGN.md §4.8 g).
    inputs: the per-head requests' layouts at their last point (default: read off the requests; a captured
    graph passes static copies). Fills each state.layers. Returns, for Ada-KV under TP (one request), the
    fresh blocks F' <= F that the fullest rank fills (a device scalar): the layout spans those, and the
    other F - F' are never written; else None."""
    state, num_heads = requests[0][0], layers[0][1].num_heads
    point, config = state.point, state.point.config
    fixed, R = point.fixed, len(requests)
    states = [each for each, _, _ in requests]
    assert R == 1 or len({batch_key(s) for s, _, _ in requests} - {None}) == 1, "requests of one batch key"
    per_head = not state.stock_layout
    assert not (followers and per_head), "a draft model's layers follow stock-layout (uniform) requests only"
    held = gathered_width(states)
    if per_head and inputs is None:
        inputs = PerHeadInputs.of(states, layers[0][1].device)
    # one point geometry (batch_key): equal block counts, a row per request (per-head requests read theirs
    # head by head, and their in-place points may span different counts: zero-padded rows then)
    written = torch.stack([blocks for _, _, blocks in requests])
    rows = [blocks for _, blocks, _ in requests]
    read = torch.stack(rows) if len({len(row) for row in rows}) == 1 else None  # one copy, not one a request
    if per_head:
        read = (torch.nn.utils.rnn.pad_sequence(rows, batch_first=True) if read is None else read).long()
    groups = layer_groups(layers, held * R, group_bytes)
    options = {**config.score_options(), "window": point.window, "sink": point.sink, "future_rotation": rotation}
    # Ada-KV under TP: the layout spans the blocks of the fullest rank over all layers, known once every
    # layer is selected, so the groups are written after that (gathered again, all but the last). Under
    # pipeline parallelism a stage sees its own layers only and vLLM hands the scheduler the last stage's
    # report alone, so there the layout spans every written block (F' = F: nothing is trimmed).
    spans_written = state.deferred and heads.stages > 1
    deferred = state.deferred and not spans_written
    selected, used = [], None
    for group in groups:
        lengths, cache = None, group[0][1]
        if per_head:
            keys, values, lengths = _gather_heads(cache, group, read, inputs, held)
        else:
            keys, values = _gather(cache, group, read, held)
        G, H = len(group), num_heads
        q_window = None
        if state.window:  # [w, R, G, Hq, D] of every request's [L, w, Hq, D]
            q_window = group_layers(torch.stack([s.q_window for s, _, _ in requests], dim=1), group, 0)
            q_window = q_window.permute(2, 1, 0, 3, 4)
        # scoring reads a quantized cache dequantized; the kept tokens move as the cache's own bytes
        scored_keys, scored_values, q_window = cache.dequantize([c for _, c in group], keys, values, q_window)
        if q_window is not None:
            q_window = q_window.flatten(1, 3)
        context = positions = None
        if POLICIES[config.policy].needs_context:  # one request (batch_key)
            positions = _held_positions(state, point, group, H, held, keys.device)
            context = _token_context(state, point, positions, group, heads)
        n = held - fixed  # the candidates: every held token, or under protect_prompt the generated ones
        flat = (n, R * G * H, scored_keys.shape[-1])
        keep, counts = select_group(config, q_window, scored_keys[fixed:].view(flat), scored_values[fixed:].view(flat), scale,
                                    state.page_size, point.pages, num_layers=R * G, heads=heads, options=options,
                                    context=context, lengths=None if lengths is None else (lengths - fixed).view(-1))
        keep, counts = keep.view(R, G, H, n), counts.view(R, G, H)
        if fixed:
            keep = torch.cat([keep.new_ones(R, G, H, fixed), keep], dim=-1)
        if config.allocation == "uniform":  # every head keeps point.kept tokens, in stock layout
            counts = torch.full_like(counts, -(-point.kept // state.page_size))
        else:  # each head's pages hold what it keeps, its protected prompt included (whole blocks: Point.kept)
            counts = -(-keep.sum(dim=-1) // state.page_size)
        if positions is not None:  # each head's kept positions first, in order: read again at the next point
            order = torch.argsort(keep[0].logical_not().to(torch.uint8), dim=-1, stable=True)
            kept_positions = positions.gather(-1, order)
            for i, (index, _) in enumerate(group):
                state.positions[index] = kept_positions[i]
            state.positions_at = point.at
        if not deferred:
            _write_group(states, group, keys, values, keep, counts, written)
            for i, (index, _) in enumerate(group):
                for follower in (followers or {}).get(index, ()):
                    follower_keys, follower_values = _gather(follower[1], [follower], read, held)
                    _write_group(states, [follower], follower_keys, follower_values, keep[:, i: i + 1],
                                 counts[:, i: i + 1], written)
            continue
        fullest = heads.all_heads(counts[0].sum(dim=1, keepdim=True)).amax()  # pages of the fullest rank's layer
        used = fullest if used is None else torch.maximum(used, fullest)
        selected.append((group, keep[0], counts[0]))
    if deferred:
        used = (used + num_heads - 1) // num_heads
        for i, (group, keep, counts) in enumerate(selected):
            if i < len(selected) - 1:  # the last group's K/V are still gathered (the others' layers unwritten)
                keys, values = (_gather_heads(group[0][1], group, read, inputs, held)[:2] if per_head
                                else _gather(group[0][1], group, read, held))
            _write_group(states, group, keys, values, keep[None], counts[None], written, used)
    if spans_written:
        return torch.tensor(written.shape[1], device=written.device)
    return used


def _held_positions(state, point, group: list, num_heads: int, n: int, device) -> torch.Tensor:
    """Original positions [G, H, n] of what each head of a layer group holds at this point (padded to n):
    what it kept at the last point, then every token since."""
    col = torch.arange(n, device=device)
    held = []
    for index, _ in group:
        kept_positions = state.positions.get(index)
        if kept_positions is None:  # nothing compacted yet: every token from 0
            held.append((state.positions_at + col).expand(num_heads, n))
            continue
        count = state.layers[index].kept.view(-1, 1)
        earlier = kept_positions.gather(-1, col.clamp(max=kept_positions.shape[1] - 1).expand(num_heads, n))
        held.append(torch.where(col < count, earlier, state.positions_at + col - count))
    return torch.stack(held)


def _token_context(state, point, positions: torch.Tensor, group: list, heads: KVHeadGroup) -> TokenContext:
    """Where a group's candidates sit, for the policies that read it (random): original positions, and the
    global head and layer of each folded head."""
    G, H = positions.shape[:2]
    device = positions.device
    layer_ids = torch.tensor([index for index, _ in group], device=device).repeat_interleave(H)
    head_ids = torch.tensor(heads.global_heads(H), device=device).repeat(G)
    return TokenContext(positions=positions[..., point.fixed:].reshape(G * H, -1), heads=head_ids, layers=layer_ids,
                        compaction=point.index, seed=state.spec.config.seed or 0)


def staging(n: int, R: int, G: int, cache) -> tuple[torch.Tensor, torch.Tensor]:
    """Empty keys, values [n, R, G, H, W] for what R requests hold in G layers of the cache's layout, each
    head's n tokens contiguous in memory: the scoring kernels and the write then read a head's key tile as
    one block, not n rows a whole layer group apart."""
    shape = (R, G, cache.num_heads, n, cache.stored_dim)
    keys = torch.empty(shape, dtype=cache.dtype, device=cache.device).permute(3, 0, 1, 2, 4)
    return keys, torch.empty_like(keys)


def _gather(cache, group: list, blocks: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """keys, values [n, R, G, H, D] of the first n held tokens of R requests (blocks [R, >= cdiv(n, page)])
    in a layer group: one launch."""
    keys, values = staging(n, blocks.shape[0], len(group), cache)
    cache.gather_layers([layer_cache for _, layer_cache in group], blocks, n, keys, values)
    return keys, values


def group_layers(per_layer: torch.Tensor, group: list, dim: int) -> torch.Tensor:
    """The entries of a layer group's layers along `dim` of a tensor indexed by layer index: a view when they
    are consecutive (a model whose layers all attend), else a copy."""
    indices = [index for index, _ in group]
    if indices == list(range(indices[0], indices[0] + len(indices))):
        return per_layer.narrow(dim, indices[0], len(indices))
    return per_layer.index_select(dim, device_ints(tuple(indices), per_layer.device))


def _gather_heads(cache, group: list, row_blocks: torch.Tensor, inputs: PerHeadInputs, n: int) -> tuple:
    """keys, values [n, R, G, H, D] of what each head of R requests in per-head layout holds in a layer
    group (zero past a head's count), and the counts [R, G, H]: the head's kept tokens at the last point,
    then the tokens since, in its pages (per_head.head_pages over the request's blocks, row_blocks [R, >= F]
    int64). One slot table for all requests and layers, one gather (the adapter's gather_held)."""
    G, H, D = len(group), cache.num_heads, cache.stored_dim
    R = row_blocks.shape[0]
    counts = group_layers(inputs.counts, group, 1)                                          # [R, G, H]
    held = group_layers(inputs.kept, group, 1) + inputs.since.view(R, 1, 1)
    slots = held_slots(counts, held, inputs.fresh, row_blocks, n, cache.page_size)           # [R, G, n, H]
    keys, values = staging(n, R, G, cache)
    caches = [layer_cache for _, layer_cache in group] * R
    cache.gather_held(caches, slots.view(R * G, n, H), keys.view(n, R * G, H, D), values.view(n, R * G, H, D))
    return keys, values, held


def _write_group(states: list, group: list, keys: torch.Tensor, values: torch.Tensor, keep: torch.Tensor,
                 counts: torch.Tensor, fresh_blocks: torch.Tensor, num_blocks: torch.Tensor | None = None) -> None:
    """Write a layer group's kept tokens of R requests (keys/values [E, R, G, H, D], keep [R, G, H, E], counts
    [R, G, H], fresh_blocks [R, F]) in one launch, and record each request's layout."""
    caches = [layer_cache for _, layer_cache in group]
    E, R, G = keys.shape[:3]
    slots = compaction_slots(keep, counts, fresh_blocks, states[0].page_size, num_blocks)    # [R, G, E, H]
    caches[0].write_layers(caches * R, keys.view(E, R * G, *keys.shape[3:]), values.view(E, R * G, *keys.shape[3:]),
                           slots.reshape(R * G, E, -1).contiguous())
    kept = keep.sum(dim=-1)
    indices = [index for index, _ in group]
    for r, (state, request_counts, request_kept) in enumerate(zip(states, counts.unbind(), kept.unbind())):
        state.layers.record(indices, request_counts, request_kept)
        if DUMP_DIR:  # kept sets for offline comparison with a reference (GPU checks)
            point = f".c{state.done}" if state.chunk else ""  # block-wise: one file per compaction
            for i, index in enumerate(indices):
                torch.save(keep[r, i].cpu(), os.path.join(DUMP_DIR, f"{state.req_id}{point}.L{index}.pt"))
