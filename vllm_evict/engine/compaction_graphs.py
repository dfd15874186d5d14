"""CUDA graphs of decode-point compactions.

A decode point moves little per request (K_d + C_d tokens per head) but launches the same few dozen
kernels as a prompt's compaction, so a decode step that compacts a dozen requests was bound by the host
launching them. A compaction batch's work is fixed by its batch key (compaction.batch_key), its number of
requests and its gathered width, except for its inputs: the requests' block ids and window queries, and in
per-head (Ada-KV) layout their layouts at the last point (compaction.PerHeadInputs); the layer caches never
move. So the first batch of such a kind runs eagerly (it compiles and tunes the Triton kernels), the second
is captured over static copies of those inputs and replayed, and every later one copies its inputs in and
replays: a few launches instead of dozens per layer group.

Captured: decode points on caches whose adapter is `graphable`, batches with a batch key, engines with CUDA
graphs on (not `enforce_eager`); Ada-KV at TP=1 only (under TP its allocation all-gathers scores). Under
uniform allocation every head keeps the same count whatever the scores, so the layouts a replay leaves are
those the capture recorded; this is checked once, at capture (a host sync), and a kind whose layouts
differ between requests stays eager. Under Ada-KV the layouts follow the scores: each replay leaves them in
static tensors, copied out to the requests (two copies a batch). Every graph shares one memory pool: the
batch's gathered K/V and scores, at most the worker's group_bytes plus its score tensors, outside the memory
vLLM profiled.
"""

from __future__ import annotations

import copy
from collections import OrderedDict

import torch
from vllm.logger import init_logger

from vllm_evict.engine.compaction import (KVHeadGroup, LayerCompaction, LayerLayouts, PerHeadInputs, batch_key,
                                          compact_requests, gathered_width)

logger = init_logger(__name__)

MAX_GRAPHS = 32   # captured batches kept (least recently replayed dropped first)
MAX_MET = 4096    # keys met once, remembered until their second batch


def graph_key(batch: list, heads: KVHeadGroup = KVHeadGroup()) -> tuple | None:
    """What fixes a batch's captured work (None: it is not captured): its batch key, size, block counts and
    gathered width."""
    state = batch[0]
    point = state.point
    uniform = point.config.allocation == "uniform"
    if not point.decode or (uniform and not state.stock_layout) or (not uniform and heads.world > 1):
        return None
    key = batch_key(state)
    blocks = (len(state.prompt_block_ids), len(state.fresh_blocks))
    if key is None or any((len(s.prompt_block_ids), len(s.fresh_blocks)) != blocks for s in batch):
        return None
    return key, len(batch), blocks, gathered_width(batch)


def graphs_allowed(caches: list) -> bool:
    """Whether compaction over these layer cache adapters can be captured."""
    return all(getattr(cache, "graphable", False) for cache in caches)


class CaptureFailed(Exception):
    """A batch's compaction could not be captured (an operation a capture does not allow)."""


class CompactionGraphs:
    """One worker's captured compaction batches, for the layer caches they were captured on (enabled: CUDA
    graphs are on and every cache adapter, draft layers' included, is `graphable`; graphs_allowed)."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.graphs: OrderedDict[tuple, CapturedBatch | None] = OrderedDict()  # None: stays eager
        self.met: set[tuple] = set()
        self.pool = None

    def run(self, batch: list, layers: list, scale: float, heads, rotation, followers, group_bytes: int) -> bool:
        """Compact the batch by its key's graph (True), or leave it to the caller's eager compaction (False)."""
        key = graph_key(batch, heads) if self.enabled else None
        if key is None:
            return False
        if key not in self.graphs:
            if key not in self.met:  # first batch of its key: eager, which compiles its kernels
                if len(self.met) >= MAX_MET:
                    self.met.clear()
                self.met.add(key)
                return False
            self.met.discard(key)
            if self.pool is None:
                self.pool = torch.cuda.graph_pool_handle()
            try:
                captured = CapturedBatch.capture(batch, layers, scale, heads, rotation, followers, group_bytes,
                                                 self.pool)
            except CaptureFailed:  # nothing ran
                logger.warning("vllm-evict: a compaction batch could not be captured in a CUDA graph; its kind "
                               "compacts eagerly", exc_info=True)
                self.graphs[key] = None
                return False
            self.graphs[key] = captured if captured.layouts is not None else None
            while len(self.graphs) > MAX_GRAPHS:
                self.graphs.popitem(last=False)
            return True
        captured = self.graphs[key]
        if captured is None:
            return False
        self.graphs.move_to_end(key)
        captured.replay(batch)
        return True


class CapturedBatch:
    """One batch's compaction as a CUDA graph over static block ids [R, read + written], window queries
    [R, L, w, Hq, D] and per-head inputs, and the layouts every replay leaves each request: fixed ones
    (`layouts`, uniform allocation), or (Ada-KV) static tensors each replay fills (`outputs`)."""

    def __init__(self, batch: list, layers: list, device: torch.device) -> None:
        state = batch[0]
        self.read = len(state.prompt_block_ids)
        self.blocks = torch.zeros(len(batch), self.read + len(state.fresh_blocks), dtype=torch.int64, device=device)
        self.queries = None if state.q_window is None else torch.empty(len(batch), *state.q_window.shape,
                                                                       dtype=state.q_window.dtype, device=device)
        self.inputs = None if state.stock_layout else PerHeadInputs.of(batch, device)
        self.graph = torch.cuda.CUDAGraph()
        self.varying = state.point.config.allocation != "uniform"
        self.layouts: LayerLayouts | None = LayerLayouts()
        self.indices = sorted(index for index, _ in layers)
        self.outputs = (torch.empty(2, len(batch), len(layers), layers[0][1].num_heads, dtype=torch.int64,
                                    device=device) if self.varying else None)  # page counts, kept [R, L, H]

    @classmethod
    def capture(cls, batch, layers, scale, heads, rotation, followers, group_bytes, pool) -> "CapturedBatch":
        """Capture the batch's compaction and replay it once (this batch's own work). Its `layouts` are None
        when they should be equal between the batch's requests and are not: each request then keeps its own,
        and the kind's later batches run eagerly. CaptureFailed: nothing ran."""
        captured = cls(batch, layers, layers[0][1].device)
        captured.load(batch)
        stand_ins = []  # the requests as the graph reads them: static inputs, layouts recorded apart
        for r, state in enumerate(batch):
            stand_in = copy.copy(state)
            stand_in.layers = LayerLayouts()
            stand_in.layers.follow(state.layers)  # its layout so far (per-head or not), read as host values
            stand_in.q_window = None if captured.queries is None else captured.queries[r]
            stand_ins.append(stand_in)
        requests = [(s, captured.blocks[r, :captured.read], captured.blocks[r, captured.read:])
                    for r, s in enumerate(stand_ins)]
        try:
            with torch.cuda.graph(captured.graph, pool=pool, capture_error_mode="thread_local"):
                compact_into(captured.outputs, requests, layers, scale, heads, rotation, followers, group_bytes,
                             inputs=captured.inputs)
        except Exception as exc:
            raise CaptureFailed from exc
        captured.graph.replay()
        if captured.varying:
            captured.record(batch)
            return captured
        for state, stand_in in zip(batch, stand_ins):
            state.layers.follow(stand_in.layers)
        first = stand_ins[0].layers
        for index in first:  # a host sync, once per kind
            kept = first[index]
            if any(not (torch.equal(s.layers[index].page_counts, kept.page_counts)
                        and torch.equal(s.layers[index].kept, kept.kept)) for s in stand_ins[1:]):
                logger.warning("vllm-evict: a captured compaction left different layouts per request; its kind "
                               "compacts eagerly")
                captured.layouts = None
                return captured
            captured.layouts[index] = LayerCompaction(kept.page_counts.clone(), kept.kept.clone())
        captured.record(batch)
        return captured

    def load(self, batch: list) -> None:
        """Copy the batch's block ids, window queries and per-head layouts into the static inputs."""
        ids = [b for s in batch for b in (*s.prompt_block_ids, *s.fresh_blocks)]
        self.blocks.view(-1).copy_(torch.tensor(ids, dtype=torch.int64, pin_memory=self.blocks.is_cuda),
                                   non_blocking=True)
        if self.queries is not None:
            torch.stack([s.q_window for s in batch], out=self.queries)
        if self.inputs is not None:
            self.inputs.load(batch)

    def replay(self, batch: list) -> None:
        self.load(batch)
        self.graph.replay()
        self.record(batch)

    def record(self, batch: list) -> None:
        if not self.varying:
            for state in batch:
                state.layers.follow(self.layouts)
            return
        counts, kept = self.outputs.clone()  # copied out: the next replay overwrites them
        for state, request_counts, request_kept in zip(batch, counts, kept):
            state.layers.record(self.indices, request_counts, request_kept)


def compact_into(outputs: torch.Tensor | None, requests: list[tuple], *args, **kwargs) -> None:
    """compact_requests, then (Ada-KV) each request's layouts stacked into outputs [2, R, L, H]: what a
    captured batch runs."""
    compact_requests(requests, *args, **kwargs)
    if outputs is not None:
        parts = [state.layers.stacked() for state, _, _ in requests]
        torch.stack([counts for _, counts, _ in parts], out=outputs[0])
        torch.stack([kept for _, _, kept in parts], out=outputs[1])
