"""CUDA graphs of decode-point compactions.

A decode point moves little per request (K_d + C_d tokens per head) but launches the same few dozen
kernels as a prompt's compaction, so a decode step that compacts a dozen requests was bound by the host
launching them. A compaction batch's work is fixed by its batch key (compaction.batch_key) and its number
of requests, except for two inputs: the requests' block ids and their window queries (the layer caches
never move). So the first batch of such a key runs eagerly (it compiles and tunes the Triton kernels),
the second is captured over static copies of those two inputs and replayed, and every later one copies
its inputs in and replays: a few launches instead of dozens per layer group.

Captured: decode points under uniform allocation, on caches whose adapter is `graphable`, batches with a
batch key, engines with CUDA graphs on (not `enforce_eager`). Under uniform allocation every head keeps
the same count whatever the scores, so the layouts a replay leaves are those the capture recorded; this
is checked once, at capture (a host sync), and a key whose layouts differ between requests stays eager.
Every graph shares one memory pool: the batch's gathered K/V and scores, at most the worker's group_bytes
plus its score tensors, outside the memory vLLM profiled.
"""

from __future__ import annotations

import copy
from collections import OrderedDict

import torch
from vllm.logger import init_logger

from vllm_evict.engine.compaction import LayerCompaction, LayerLayouts, batch_key, compact_requests

logger = init_logger(__name__)

MAX_GRAPHS = 32   # captured batches kept (least recently replayed dropped first)
MAX_MET = 4096    # keys met once, remembered until their second batch


def graph_key(batch: list) -> tuple | None:
    """What fixes a batch's captured work (None: it is not captured): its batch key, size and block counts."""
    state = batch[0]
    point = state.point
    if not (point.decode and point.config.allocation == "uniform" and state.stock_layout):
        return None
    key = batch_key(state)
    blocks = (len(state.prompt_block_ids), len(state.fresh_blocks))
    if key is None or any((len(s.prompt_block_ids), len(s.fresh_blocks)) != blocks for s in batch):
        return None
    return key, len(batch), blocks


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
        key = graph_key(batch) if self.enabled else None
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
    """One batch's compaction as a CUDA graph over static block ids [R, read + written] and window queries
    [R, L, w, Hq, D], and the layouts every replay leaves each request."""

    def __init__(self, batch: list, device: torch.device) -> None:
        state = batch[0]
        self.read = len(state.prompt_block_ids)
        self.blocks = torch.zeros(len(batch), self.read + len(state.fresh_blocks), dtype=torch.int64, device=device)
        self.queries = None if state.q_window is None else torch.empty(len(batch), *state.q_window.shape,
                                                                       dtype=state.q_window.dtype, device=device)
        self.graph = torch.cuda.CUDAGraph()
        self.layouts: LayerLayouts | None = LayerLayouts()

    @classmethod
    def capture(cls, batch, layers, scale, heads, rotation, followers, group_bytes, pool) -> "CapturedBatch":
        """Capture the batch's compaction and replay it once (this batch's own work). Its `layouts` are None
        when they differ between the batch's requests: each request then keeps its own, and the key's later
        batches run eagerly. CaptureFailed: nothing ran."""
        captured = cls(batch, layers[0][1].device)
        captured.load(batch)
        stand_ins = []  # the requests as the graph reads them: static inputs, layouts recorded apart
        for r, state in enumerate(batch):
            stand_in = copy.copy(state)
            stand_in.layers = LayerLayouts()
            stand_in.q_window = None if captured.queries is None else captured.queries[r]
            stand_ins.append(stand_in)
        requests = [(s, captured.blocks[r, :captured.read], captured.blocks[r, captured.read:])
                    for r, s in enumerate(stand_ins)]
        try:
            with torch.cuda.graph(captured.graph, pool=pool, capture_error_mode="thread_local"):
                compact_requests(requests, layers, scale, heads, rotation, followers, group_bytes)
        except Exception as exc:
            raise CaptureFailed from exc
        captured.graph.replay()
        for state, stand_in in zip(batch, stand_ins):
            state.layers.follow(stand_in.layers)
        first = stand_ins[0].layers
        for index in first:  # a host sync, once per key
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
        """Copy the batch's block ids and window queries into the static inputs."""
        ids = [b for s in batch for b in (*s.prompt_block_ids, *s.fresh_blocks)]
        self.blocks.view(-1).copy_(torch.tensor(ids, dtype=torch.int64, pin_memory=self.blocks.is_cuda),
                                   non_blocking=True)
        if self.queries is not None:
            torch.stack([s.q_window for s in batch], out=self.queries)

    def replay(self, batch: list) -> None:
        self.load(batch)
        self.graph.replay()
        self.record(batch)

    def record(self, batch: list) -> None:
        for state in batch:
            state.layers.follow(self.layouts)
