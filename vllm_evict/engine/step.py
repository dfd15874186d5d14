"""What eviction changes in one engine step (the worker's StepPlan), the CUDA-graph key of a step whose
attention runs per head, and what the attention metadata builders read while vLLM builds a step's
metadata (`BUILD`). The worker writes `BUILD`; the builders read it; neither imports the other."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
from vllm.forward_context import BatchDescriptor, get_forward_context, is_forward_context_available

from vllm_evict.engine.request_state import WorkerEviction
from vllm_evict.engine.window_store import WindowStore


@dataclass
class Capture:
    state: WorkerEviction
    token_start: int     # first batch token to copy
    count: int
    window_offset: int   # row in the request's window (its WindowStore rows)


@dataclass
class StepPlan:
    """What eviction changes in one step; None when no scheduled request evicts (the stock step)."""

    num_reqs: int
    states: list[WorkerEviction | None]     # per batch row
    captures: list[Capture]
    compacting: list[int]                    # rows whose chunk ends at their eviction point
    compacted_rows: list[int]                # rows already compacted: positions shifted for attention
    per_head_rows: list[int]                 # the compacted rows without stock layout (Ada-KV)
    per_head_tokens: list[int]               # batch indices of their scheduled tokens
    page_size: int
    capture_tokens: torch.Tensor | None = None  # [N] int64: batch tokens whose queries the step records
    capture_rows: torch.Tensor | None = None    # [N] int64: their WindowStore rows
    max_blocks: int = 0                      # widest block-table row this step (per-head steps only)
    row_blocks: list[int] = field(default_factory=list)  # blocks of each row (per-head steps only)
    cache: dict = field(default_factory=dict)  # kept across steps (per_head reuses row stacks)
    windows: WindowStore | None = None       # every request's window queries (the attention call records them)
    tables: object | None = None             # per_head.StepTables, built by the first layer
    split_kv: bool = True                    # which per-head FULL graph replays (per_head.split_kv; CUDA)
    row_shift: "np.ndarray | None" = None    # [num_reqs] positions each row is shifted by (shift_positions)
    shift: torch.Tensor | None = None        # [num_reqs] int64, the same on the device (a hybrid model's
                                             # evicted group, a drafter's later steps)

    @property
    def per_head(self) -> bool:
        return bool(self.per_head_rows)

    @property
    def stages_queries(self) -> bool:
        """A decode step of this plan needs every layer's queries after the forward: it records window queries
        or compacts (from the staged queries). In a FULL graph it replays a graph that stages them: the
        per-head graph for a step with per-head rows, else vLLM's attention in a StagedDecodeBatch graph."""
        return bool(self.captures or self.compacting)


@dataclass(frozen=True)
class PerHeadDecodeBatch(BatchDescriptor):
    """The key of a FULL decode graph whose attention runs per (request, KV head): a distinct key from
    the stock graph of the same size (dataclass equality compares classes), its fields plus whether the
    graph's FlashAttention calls may split a virtual sequence's KV (per_head.split_kv; two graphs per size
    where FlashAttention can split)."""

    split_kv: bool = False


@dataclass(frozen=True)
class StagedDecodeBatch(BatchDescriptor):
    """The key of a FULL decode graph of vLLM's own attention that also stages every layer's queries
    (per_head.DecodeGraphTables.queries): decode steps that record window queries or compact but hold no
    per-head rows (uniform allocation) keep the stock attention."""


def graph_step(kind):
    """The FULL decode graph of this kind (or kinds) this forward runs in (being captured: the plan is not
    read), or None."""
    if not is_forward_context_available():
        return None
    desc = get_forward_context().batch_descriptor
    return desc if isinstance(desc, kind) else None


def staging_graph_step() -> BatchDescriptor | None:
    """The FULL decode graph this forward runs in if it stages every layer's queries (per-head or staged), or None."""
    return graph_step((PerHeadDecodeBatch, StagedDecodeBatch))


@dataclass
class MetadataBuild:
    """What the attention metadata builders read: the KV cache group eviction compacts (its layers' names;
    `hybrid`: the model has other groups, whose layers must see semantic lengths), set when the runner
    makes its KV cache; and the step's plan, set only while vLLM builds the step's attention metadata
    (runner_hooks wraps `_build_attention_metadata`), None otherwise and for a stock step."""

    evicted_layers: frozenset = frozenset()
    hybrid: bool = False
    plan: StepPlan | None = None
    staged_queries: torch.Tensor | None = None  # the evicted group's builders' shared query stage


BUILD = MetadataBuild()
