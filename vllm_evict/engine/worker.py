"""Worker side: per-request eviction state, the per-step plan the attention backend reads, and the
model-runner hooks that keep the runner's block table in step with the scheduler's block swap.

The runner hooks wrap four `GPUModelRunner` methods (the CPU runner inherits them):
- `_update_states`: drop state of finished/resumed requests; after a compaction step, strip the
  prompt blocks from the request's block-table row (the scheduler already freed them).
- `_prepare_inputs`: build the StepPlan for this batch (row order is final here) and shift the
  compacted rows' attention lengths and KV slots;
- `_model_forward`: after the forward, compact the requests that reached their eviction point, all
  layers at once (compaction.compact_request);
- `execute_model`: clear the plan when the forward is done.
and the CUDA-graph dispatcher: steps that need the attention call (window capture, compaction, eager
per-head tables) skip FULL graphs; uniform decode steps with per-head (Ada-KV) rows replay FULL graphs
of their own, keyed by `PerHeadDecodeBatch` and captured next to vLLM's decode graphs.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from dataclasses import dataclass, field

import torch
from vllm.forward_context import BatchDescriptor, get_forward_context, is_forward_context_available
from vllm.logger import init_logger
from vllm.model_executor.models.utils import extract_layer_index
from vllm.utils.torch_utils import is_quantized_kv_cache

from vllm_evict.engine.compaction import KVHeadGroup, LayerCompaction, compact_requests, compaction_batches
from vllm_evict.engine.request_config import (PLAN_KEY, CompactionSchedule, FollowsSchedule, RequestEviction,
                                              parse_request)

logger = init_logger(__name__)
_SERIALS = itertools.count()


class WindowStore:
    """The window queries of every evicting request, one tensor [L, rows, Hq, D] for all layers: a request
    owns the rows [offset, offset + w) (row i: the query of position `point - w + i` of its next point). A
    step's captures are one gather and one scatter per layer (`capture`, from the attention call), or for all
    layers at once (`capture_all`, from the queries a FULL decode graph staged), whatever the number of
    requests. Rows are handed out per window size and reused once a request is gone; the tensor grows (its
    rows copied) when a new request needs more."""

    def __init__(self, num_layers: int) -> None:
        self.rows: torch.Tensor | None = None
        self.num_layers = num_layers             # layer indices of the model's attention layers: 0 .. L-1
        self.capacity = 0
        self.free: dict[int, list[int]] = {}  # window size -> free offsets

    def allocate(self, size: int) -> int:
        spare = self.free.get(size)
        if spare:
            return spare.pop()
        offset, self.capacity = self.capacity, self.capacity + size
        return offset

    def release(self, offset: int, size: int) -> None:
        self.free.setdefault(size, []).append(offset)

    def tensor(self, like: torch.Tensor) -> torch.Tensor:
        """All rows, grown to the current capacity (a query [T, Hq, D] of this step gives dtype and shape)."""
        rows = self.rows
        if rows is None or rows.shape[1] < self.capacity:
            grown = like.new_empty(self.num_layers, self.capacity, *like.shape[1:])
            if rows is not None:
                grown[:, : rows.shape[1]] = rows
            rows = self.rows = grown
        return rows

    def capture(self, layer: int, query: torch.Tensor, tokens: torch.Tensor, rows: torch.Tensor) -> None:
        """Copy one layer's queries [T, Hq, D] of batch tokens `tokens` into `rows` (device int64 tensors)."""
        indexable(self.tensor(query))[layer].index_copy_(0, rows, indexable(query).index_select(0, tokens))

    def capture_all(self, queries: torch.Tensor, tokens: torch.Tensor, rows: torch.Tensor) -> None:
        """The same for every layer at once, from staged queries [L, T, Hq, D]."""
        indexable(self.tensor(queries[0]))[: queries.shape[0]].index_copy_(1, rows,
                                                                           indexable(queries).index_select(1, tokens))

    def window(self, offset: int, size: int) -> torch.Tensor:
        """One request's rows of every layer [L, size, Hq, D] (a view)."""
        return self.rows[:, offset: offset + size]

    def shift(self, offset: int, size: int, step: int) -> None:
        """Rows [offset + step, offset + size) move to [offset, offset + size - step), in every layer."""
        if self.rows is not None:
            self.rows[:, offset: offset + size - step] = self.rows[:, offset + step: offset + size].clone()


def indexable(x: torch.Tensor) -> torch.Tensor:
    """x, or the bytes of fp8 queries (an fp8 cache): CUDA has no fp8 index_select / index_copy."""
    return x.view(torch.uint8) if x.dtype in (torch.float8_e4m3fn, torch.float8_e5m2) else x


@dataclass
class WorkerEviction(FollowsSchedule):
    req_id: str
    spec: RequestEviction
    schedule: CompactionSchedule         # the request's compaction points (the scheduler walks the same)
    page_size: int
    blocks: int = 0                     # F: fresh blocks a one-shot compaction writes (scheduler.plan_eviction)
    q_window: torch.Tensor | None = None  # [L, w, Hq, D] by layer index (its WindowStore rows), set to compact
    window: int = 0                     # w (read once: the policy's default or the request's override)
    window_offset: int = -1             # its rows in the worker's WindowStore (-1: none)
    layers: dict[int, LayerCompaction] = field(default_factory=dict)  # filled during the compaction step
    stacked: tuple | None = None        # per_head.stacked_counts: all layers' page counts, once per layout
    done: int = 0                       # compactions finished (counted from the step after each)
    shift: int = 0                      # semantic minus physical positions once compacted
    prompt_block_ids: list[int] = field(default_factory=list)  # the blocks read by the compaction step
    fresh_blocks: list[int] = field(default_factory=list)  # the blocks it writes (set for that step)
    positions: dict[int, torch.Tensor] = field(default_factory=dict)  # layer -> [H, n] original positions, kept first (random)
    positions_at: int = 0               # tokens written when `positions` was recorded (then all later ones held)
    serial: int = field(default_factory=lambda: next(_SERIALS))  # unique per layout (cache keys)
    failed: bool = False                # its compaction raised: it runs as stock until the scheduler ends it
    used_blocks: "HostCopy | None" = None  # Ada-KV under TP: the F' <= F fresh blocks its layout spans
    most_kept: "HostCopy | None" = None    # per-head layout: the most tokens a head kept at the last point
    fullest_offset: int | None = None      # most_kept less the last point's position, once on the host

    def __post_init__(self) -> None:
        self.blocks = self.blocks or (self.pages or 0)

    @property
    def deferred(self) -> bool:
        """Ada-KV under TP at a one-shot point: its layout spans F' <= F blocks, known once every layer is
        selected (compaction.py)."""
        return not self.point.in_place and self.blocks > self.pages

    @classmethod
    def for_prompt(cls, req_id: str, spec: RequestEviction, num_prompt_tokens: int, page_size: int,
                   **fields) -> "WorkerEviction":
        return cls(req_id=req_id, spec=spec, schedule=CompactionSchedule(spec, num_prompt_tokens, page_size),
                   page_size=page_size, window=spec.config.window_size(), **fields)


    @property
    def prompt_blocks(self) -> int:
        """cdiv(E, page_size): prompt blocks before the F fresh ones of a one-shot compaction."""
        return -(-self.evict_at // self.page_size)

    @property
    def held(self) -> int:
        """Tokens the request holds per head at its next compaction point."""
        return self.point.held

    @property
    def last_at(self) -> int:
        """Tokens written when its last point ran (0 before the first)."""
        return self.schedule.point(self.done - 1).at if self.done else 0

    @property
    def gathered_tokens(self) -> int:
        """Tokens per head its next compaction gathers: what each head holds, or in per-head layout what the
        fullest head holds (read off the last compaction's copy, done long since: no wait)."""
        if self.stock_layout:
            return self.point.held
        return self.fullest_head(self.point.at, wait=True)

    def advance(self, windows: WindowStore | None = None) -> None:
        """The compaction at the next point has run: positions shift by that point minus what it holds, and
        the window rows the next point shares with this one move to their new rows."""
        point = self.point
        self.shift = point.at - (point.kept if point.in_place else self.blocks * self.page_size)
        if point.in_place:  # its layout now spans the blocks its kept tokens fill
            self.blocks = -(-point.kept // self.page_size)
        if point.evicts and not self.stock_layout:  # a new per-head layout (stacked by `kept_most`): new tables
            self.serial = next(_SERIALS)
        self.done += 1
        self.q_window, self.fullest_offset = None, None  # last_at moved
        following = self.point
        step = self.window if following is None else following.at - point.at
        if step < self.window and windows is not None and self.window_offset >= 0:
            windows.shift(self.window_offset, self.window, step)

    def kept_most(self) -> None:
        """After a compaction into per-head layout: stack its page counts for the tables, and copy the most
        tokens a head kept to the host (the next point gathers up to that head)."""
        from vllm_evict.engine.per_head import stacked_counts

        self.stacked = None
        _, kept = stacked_counts(self, next(iter(self.layers.values())).kept.device)
        self.most_kept, self.fullest_offset = HostCopy(kept.amax()), None

    def fullest_head(self, written: int, wait: bool = False) -> int | None:
        """Tokens the fullest head holds with `written` tokens written (per-head layout): what it kept at the
        last point plus the tokens since. Without `wait`, None until that copy has reached the host."""
        if self.fullest_offset is None and self.most_kept is not None and (wait or self.most_kept.ready()):
            self.fullest_offset = self.most_kept.read() - self.last_at
        return None if self.fullest_offset is None else self.fullest_offset + written

    @property
    def stock_layout(self) -> bool:
        """Uniform allocation lays the kept pages out exactly like vLLM (compaction.py): after compaction
        the request is a stock request whose positions are shifted by `shift`. So is a request that has not
        been compacted yet (its points so far evicted nothing), and a failed compaction (no per-head layout
        to read) until the scheduler finishes the request with an error."""
        return self.failed or self.spec.config.allocation == "uniform" or not self.layers


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
    shift: torch.Tensor | None = None        # the same on the device, for a hybrid model's evicted group only

    @property
    def per_head(self) -> bool:
        return bool(self.per_head_rows)

    @property
    def needs_per_head_graph(self) -> bool:
        """A decode step of this plan replays a per-head FULL graph, not vLLM's: one with per-head rows, or one
        that records window queries (the per-head graph stages every layer's queries) or compacts (after the
        forward, from the staged queries)."""
        return bool(self.per_head_rows or self.captures or self.compacting)


@dataclass(frozen=True)
class PerHeadDecodeBatch(BatchDescriptor):
    """The key of a FULL decode graph whose attention runs per (request, KV head): a distinct key from
    the stock graph of the same size (dataclass equality compares classes), its fields plus whether the
    graph's FlashAttention calls may split a virtual sequence's KV (per_head.split_kv; two graphs per size
    where FlashAttention can split)."""

    split_kv: bool = False


def per_head_graph_step() -> PerHeadDecodeBatch | None:
    """The per-head FULL decode graph this forward runs in (being captured: the plan is not read), or None."""
    if not is_forward_context_available():
        return None
    desc = get_forward_context().batch_descriptor
    return desc if isinstance(desc, PerHeadDecodeBatch) else None


class WorkerEvictionState:
    """All eviction state of one worker process."""

    def __init__(self) -> None:
        self.requests: dict[str, WorkerEviction] = {}
        self.arrived: list[str] = []             # new or resumed since the last plan
        self.pending_strip: dict[str, WorkerEviction] = {}
        self.plan: StepPlan | None = None
        self.latency = CompactionTimer()
        self.failed: dict[str, str] = {}         # request id -> why its compaction failed (not yet sent)
        self.trimmed: dict[str, int] = {}        # request id -> F' <= F fresh blocks it keeps (not yet sent)
        self.step_cache: dict = {}               # per_head's cross-step cache (StepPlan.cache)
        self.capturing: PerHeadDecodeBatch | None = None  # the per-head graph being captured
        self.num_sms = 0                         # the GPU's SMs (per_head.split_kv; 0: not CUDA)
        self.num_kv_heads = 0                    # this rank's KV heads per layer
        self.heads: KVHeadGroup | None = None    # this rank's KV heads (set with `layers`)
        self.windows = WindowStore(0)            # every request's window queries (one per runner)
        self.layers: tuple | None = None         # (runner, attention_layers), set by its first plan
        self.group = None                        # layout.EvictedGroup: the KV cache group compacted (None: none)
        self.evicted_layers: frozenset = frozenset()  # its layers' names (their metadata builders carry the plan)

    def attach_report(self, output):
        """Send compaction latencies, failures and trimmed fresh blocks to the scheduler on a
        ModelRunnerOutput (attributes survive the pickling between worker and engine core). vLLM's shared
        empty output is never touched."""
        from vllm.v1.outputs import EMPTY_MODEL_RUNNER_OUTPUT

        if output is None or output is EMPTY_MODEL_RUNNER_OUTPUT or not (self.latency.pending or self.failed
                                                                          or self.trimmed):
            return output

        def annotate(real):
            latency = self.latency.collect()
            if latency:
                setattr(real, LATENCY_ATTR, latency)
            if self.failed:
                setattr(real, FAILED_ATTR, self.failed)
                self.failed = {}
            if self.trimmed:
                setattr(real, TRIMMED_ATTR, self.trimmed)
                self.trimmed = {}
            return real

        if hasattr(output, "get_output"):  # async scheduling: the real output is built later
            get_output = output.get_output
            output.get_output = lambda: annotate(get_output())
            return output
        return annotate(output)

    def _new_state(self, runner, req_id: str) -> WorkerEviction | None:
        req = runner.requests.get(req_id)
        extra_args = (req.sampling_params.extra_args if req and req.sampling_params else None) or {}
        if PLAN_KEY not in extra_args:  # the scheduler found nothing to evict
            return None
        evict_at, pages, chunk, blocks, num_prompt_tokens = extra_args[PLAN_KEY]
        spec = parse_request(extra_args)  # the scheduler read it, so it is readable
        page_size = runner.cache_config.block_size
        state = WorkerEviction.for_prompt(req_id, spec, num_prompt_tokens, page_size, blocks=blocks)
        assert (state.schedule.evict_at, state.pages or 0, state.chunk) == (evict_at, pages, chunk), "plan mismatch"
        if state.window:
            state.window_offset = self.windows.allocate(state.window)
        return state

    def _forget(self, req_id: str) -> None:
        state = self.requests.pop(req_id, None)
        self.pending_strip.pop(req_id, None)
        if state is not None and state.window_offset >= 0:
            self.windows.release(state.window_offset, state.window)

    def before_update_states(self, runner, scheduler_output) -> None:
        for req_id in scheduler_output.finished_req_ids:
            self._forget(req_id)
        self.arrived.extend(req.req_id for req in scheduler_output.scheduled_new_reqs)
        cached = scheduler_output.scheduled_cached_reqs
        for req_id in getattr(cached, "resumed_req_ids", ()) or ():
            self._forget(req_id)   # preempted: blocks are new, the recompute evicts again
            self.arrived.append(req_id)
        for req_id, state in self.pending_strip.items():
            req = runner.requests.get(req_id)
            if req is None:
                continue
            # the blocks the scheduler kept: the first ones the kept tokens fill (compacted in place) or all
            # after the prompt's
            g = self.group.index
            blocks, point = req.block_ids[g], state.point
            blocks = blocks[: -(-point.kept // state.page_size)] if point.in_place else blocks[state.prompt_blocks:]
            if state.used_blocks is not None:  # Ada-KV under TP: drop the fresh blocks its layout left empty
                used = state.used_blocks.read()
                blocks = blocks[:used] + blocks[state.blocks:]
                self.trimmed[req_id] = used  # the scheduler frees the same blocks on this report
                state.blocks, state.used_blocks = used, None
            req.block_ids = req.block_ids[:g] + (blocks,) + req.block_ids[g + 1:]
            row = runner.input_batch.req_id_to_index.get(req_id)
            if row is not None:
                runner.input_batch.block_table.add_row(req.block_ids, row)
            state.advance(self.windows)
        self.pending_strip.clear()

    def set_kv_cache_groups(self, runner, kv_cache_config) -> None:
        """The KV cache group compaction works on (layout.py), before the runner builds its metadata
        builders (they read `evicted_layers`); None where the model cannot evict."""
        from vllm_evict.engine.layout import evicted_group, model_refusal

        group, reason = evicted_group(kv_cache_config)
        if reason is None:
            reason = model_refusal(runner.model_config, runner.vllm_config.scheduler_config)
        self.group = None if reason else group
        self.evicted_layers = frozenset() if reason else frozenset(
            kv_cache_config.kv_cache_groups[group.index].layer_names)
        self.layers = None

    def build_plan(self, runner, scheduler_output) -> None:
        """The step's plan, in O(number of evicting requests); None (stock step) when there are none."""
        self.plan = None
        if self.group is None:  # the scheduler evicts nothing on such a model
            return
        self.attention_layers(runner)
        for req_id in self.arrived:
            state = self._new_state(runner, req_id)
            if state is not None:
                self.requests[req_id] = state
        self.arrived.clear()
        self.plan = None
        if not self.requests:
            return
        batch = runner.input_batch
        num_reqs = batch.num_reqs
        token_starts = runner.query_start_loc.np
        rows = []
        for req_id, state in self.requests.items():
            row = batch.req_id_to_index.get(req_id)
            if row is not None and row < num_reqs and req_id in scheduler_output.num_scheduled_tokens:
                rows.append((row, state))
        if not rows:
            return
        rows.sort(key=lambda item: item[0])
        states: list[WorkerEviction | None] = [None] * num_reqs
        captures: list[Capture] = []
        compacting: list[int] = []
        compacted_rows: list[int] = []
        per_head_rows: list[int] = []
        per_head_tokens: list[int] = []
        for row, state in rows:
            states[row] = state
            token_start = int(token_starts[row])
            count = int(token_starts[row + 1]) - token_start
            if state.compacted:
                compacted_rows.append(row)
                if not state.stock_layout:
                    per_head_rows.append(row)
                    per_head_tokens.extend(range(token_start, token_start + count))
            point = state.next_point
            if point is None or state.failed:
                continue
            computed = int(batch.num_computed_tokens_cpu[row])
            lo = max(computed, point - state.window)
            hi = min(computed + count, point)
            if hi > lo:
                captures.append(Capture(state, token_start + lo - computed, hi - lo, lo - (point - state.window)))
            if computed + count == point:
                self.pending_strip[state.req_id] = state
                current = state.point
                if not current.evicts:  # a point that evicts nothing: it only advances
                    continue
                compacting.append(row)
                blocks = runner.requests[state.req_id].block_ids[self.group.index]
                if current.in_place:  # from the blocks it holds into the first ones its kept tokens fill
                    state.prompt_block_ids = list(blocks[: -(-current.held // state.page_size)])
                    state.fresh_blocks = list(blocks[: -(-current.kept // state.page_size)])
                else:
                    state.prompt_block_ids = list(blocks[: state.prompt_blocks])
                    state.fresh_blocks = list(blocks[state.prompt_blocks: state.prompt_blocks + state.blocks])
            elif computed + count > point:
                self._passed_point(state)
                if not state.compacted:
                    del self.requests[state.req_id]
                    states[row] = None
        if captures:  # one gather and one scatter per layer (attention.py)
            from vllm_evict.engine.per_head import host_to_device

            tokens = [c.token_start + i for c in captures for i in range(c.count)]
            rows = [c.state.window_offset + c.window_offset + i for c in captures for i in range(c.count)]
            device = runner.seq_lens.device
            capture_tokens, capture_rows = host_to_device(tokens, device), host_to_device(rows, device)
        else:
            capture_tokens = capture_rows = None
        plan = StepPlan(num_reqs=num_reqs, states=states, captures=captures, compacting=compacting,
                        capture_tokens=capture_tokens, capture_rows=capture_rows,
                        compacted_rows=compacted_rows, per_head_rows=per_head_rows,
                        per_head_tokens=per_head_tokens, page_size=runner.cache_config.block_size,
                        cache=self.step_cache, windows=self.windows)
        if plan.per_head:
            row_blocks = batch.block_table[self.group.index].num_blocks_per_row[:num_reqs]
            plan.row_blocks = row_blocks.tolist()
            plan.max_blocks = max(int(row_blocks.max()), 1)
        if compacted_rows:
            shift_positions(runner, plan, self.group)
        if plan.needs_per_head_graph and self.num_sms:
            plan.split_kv = self._split_kv(runner, plan)
        self.plan = plan

    def _split_kv(self, runner, plan: StepPlan) -> bool:
        """per_head.split_kv for this step's virtual sequences, from host-known lengths: every head of a row
        at the row's (shifted) length, except a per-head row's fullest head: what it kept at the last point
        (once that copy has arrived; until then the row's length) plus the tokens written since."""
        from vllm_evict.engine.per_head import split_kv

        num_reqs = plan.num_reqs
        starts = runner.query_start_loc.np[: num_reqs + 1]
        written = runner.input_batch.num_computed_tokens_cpu[:num_reqs] + (starts[1:] - starts[:-1])
        lengths = written - plan.row_shift if plan.row_shift is not None else written
        longest = int(lengths.max())
        written = written.tolist()
        for row in plan.per_head_rows:
            fullest = plan.states[row].fullest_head(written[row])
            if fullest is not None and fullest > longest:
                longest = fullest
        return split_kv(longest, int(lengths.sum()) * self.num_kv_heads, self.num_sms)

    def _passed_point(self, state: WorkerEviction) -> None:
        """A chunk ran past an eviction point (the scheduler cuts chunks there; this is a bug). A request
        not yet compacted runs on without eviction; a compacted one cannot: it fails."""
        logger.error("vllm-evict: request %s passed its eviction point without a chunk boundary there; %s",
                     state.req_id, "failing it" if state.compacted else "not evicting it")
        if state.compacted:
            state.failed = True
            self.failed[state.req_id] = "a prefill chunk passed its eviction point"

    def after_forward(self, runner) -> None:
        """After the model forward: record the window queries a per-head FULL graph staged (an eager
        attention call recorded its own), then compact the requests that reached their point."""
        plan = self.plan
        if plan is None:
            return
        if plan.capture_tokens is not None and per_head_graph_step():
            self.windows.capture_all(staged_queries(), plan.capture_tokens, plan.capture_rows)
        if plan.compacting:
            self.compact(runner, plan)

    def compact(self, runner, plan: StepPlan) -> None:
        """Compact every request whose chunk ended at its point, all layers at once, requests of one batch
        key together (one timed span per batch, shared among its requests)."""
        layers, scale = self.attention_layers(runner)
        cache = layers[0][1]
        states = [plan.states[row] for row in plan.compacting]
        for batch in compaction_batches(states, len(layers), cache.num_heads, cache.head_dim, cache.gathered_itemsize):
            for state in batch:
                if state.window:
                    state.q_window = self.windows.window(state.window_offset, state.window)
            started = self.latency.start(cache.device)
            try:
                with torch.profiler.record_function("vllm_evict.compact"):  # a named range in torch profiles
                    used = compact_one(batch, layers, scale, self.heads)
                if used is not None:
                    batch[0].used_blocks = HostCopy(used)
                for state in batch:
                    if not state.stock_layout:
                        state.kept_most()
            except Exception as exc:  # one batch's failure must not take the others or the engine down
                logger.exception("vllm-evict: compaction of requests %s failed", [s.req_id for s in batch])
                for state in batch:
                    state.failed = True
                    self.failed[state.req_id] = f"{type(exc).__name__}: {exc}"
            self.latency.stop([state.req_id for state in batch], started)

    def attention_layers(self, runner) -> tuple[list, float]:
        """(layer index, paged cache adapter) of every attention layer that writes its own KV cache, in layer
        order, and their softmax scale: read once per runner off the model's layers (its caches never move).
        Another engine in this process has caches, a window store and KV heads of its own."""
        if self.layers is None or self.layers[0] is not runner:
            modules = runner.vllm_config.compilation_config.static_forward_context.values()
            impls = [m for m in modules if hasattr(getattr(m, "impl", None), "_cached_paged_cache")
                     and m.impl.kv_sharing_target_layer_name is None and m.layer_name in self.evicted_layers]
            layers = sorted(((extract_layer_index(m.layer_name), m.impl._cached_paged_cache(m, m.kv_cache))
                             for m in impls), key=lambda item: item[0])
            self.layers = (runner, layers, impls[0].impl.scale)
            self.windows = WindowStore(num_layers=layers[-1][0] + 1)
            self.heads = kv_head_group(runner)
            cache = layers[0][1]
            self.num_kv_heads = cache.num_heads
            self.num_sms = (torch.cuda.get_device_properties(cache.device).multi_processor_count
                            if cache.device.type == "cuda" else 0)
        return self.layers[1:]

    def end_step(self) -> None:
        self.plan = None


def shift_positions(runner, plan: StepPlan, group) -> None:
    """Attention sees compacted rows at their physical length: seq_lens and the KV slots of their tokens
    use positions lowered by their shift (RoPE keeps the semantic positions in runner.positions).

    For stock-layout rows this is all eviction needs, and it works inside vLLM's FULL CUDA graphs (both
    tensors are the runner's persistent buffers, rewritten in place before the graph replays). A hybrid
    model's other KV cache groups keep the semantic lengths and slots: only the evicted group's slots are
    recomputed, and its metadata builder lowers its own copy of seq_lens (attention.py, plan.shift)."""
    import numpy as np

    from vllm_evict.engine.per_head import host_to_device

    num_reqs = plan.num_reqs
    row_shift = np.zeros(num_reqs, dtype=np.int64)
    for row in plan.compacted_rows:
        row_shift[row] = plan.states[row].shift
    device = runner.seq_lens.device
    plan.row_shift = row_shift
    shift = host_to_device(row_shift.tolist(), device)
    tables = runner.input_batch.block_table
    if group.hybrid:
        plan.shift = shift.to(runner.seq_lens.dtype)
        tables = tables[group.index]
    else:
        runner.seq_lens[:num_reqs] -= shift.to(runner.seq_lens.dtype)
    num_tokens = int(runner.query_start_loc.np[num_reqs])
    positions = runner.positions[:num_tokens] - shift[runner.req_indices.gpu[:num_tokens]]
    tables.compute_slot_mapping(num_reqs, runner.query_start_loc.gpu[: num_reqs + 1], positions)


def compact_one(states: list[WorkerEviction], layers: list, scale: float,
                heads: KVHeadGroup = KVHeadGroup()) -> torch.Tensor | None:
    """compact_requests with the requests' block ids on the cache's device (one pinned copy, no sync)."""
    from vllm_evict.engine.per_head import host_to_device

    ids = host_to_device([b for s in states for b in (*s.prompt_block_ids, *s.fresh_blocks)], layers[0][1].device)
    requests, start = [], 0
    for state in states:
        read, written = len(state.prompt_block_ids), len(state.fresh_blocks)
        requests.append((state, ids[start: start + read], ids[start + read: start + read + written]))
        start += read + written
    return compact_requests(requests, layers, scale, heads)


def staged_queries() -> torch.Tensor:
    """Every layer's queries [L, rows, Hq, D] of the per-head FULL decode graph that just ran."""
    metadata = get_forward_context().attn_metadata
    return next(md.per_head_decode.queries for md in metadata.values() if getattr(md, "per_head_decode", None))


class HostCopy:
    """A device scalar copied to the host without a stream sync; `read` waits for that copy only."""

    def __init__(self, value: torch.Tensor):
        self.event = None
        if value.device.type != "cuda":
            self.host = value
            return
        self.host = torch.empty((), dtype=value.dtype, pin_memory=True)
        self.host.copy_(value, non_blocking=True)
        self.event = torch.cuda.Event()
        self.event.record()

    def ready(self) -> bool:
        if self.event is not None and self.event.query():
            self.event = None  # arrived: later calls read the host copy without asking the stream
        return self.event is None

    def read(self) -> int:
        if self.event is not None:
            self.event.synchronize()
        return int(self.host)


def kv_head_group(runner) -> KVHeadGroup:
    """This worker's KV heads among a layer's (tensor parallelism)."""
    world = runner.parallel_config.tensor_parallel_size
    if world == 1:
        return KVHeadGroup()
    from vllm.distributed import get_tensor_model_parallel_rank

    return KVHeadGroup(rank=get_tensor_model_parallel_rank(), world=world,
                       total=runner.model_config.get_total_num_kv_heads())


def warm_up_scoring(runner) -> None:
    """At engine start (vLLM's kernel warm-up, CUDA only): compile every kernel of the compaction path
    before the first request, for the engine's cache dtype (docs/OPERATIONS.md)."""
    if runner.device.type != "cuda":
        return
    from vllm_evict.engine.cuda_backend import CudaPagedCache, query_dtype

    model, parallel, cache_dtype = runner.model_config, runner.parallel_config, runner.cache_config.cache_dtype
    head_dim = model.get_head_size()
    one = torch.ones((), dtype=torch.float32, device=runner.device)  # the layers' default k/v/q scales
    start = time.perf_counter()
    warm_up(lambda kv_cache: CudaPagedCache(kv_cache, head_dim, cache_dtype, one, one, one, model.dtype),
            runner.device, model.get_num_attention_heads(parallel), model.get_num_kv_heads(parallel), head_dim,
            model.dtype, runner.cache_config.block_size, query_dtype(cache_dtype, model.dtype),
            is_quantized_kv_cache(cache_dtype))
    logger.info("vllm-evict: scoring kernels ready in %.1f s", time.perf_counter() - start)


def warm_up(make_cache, device: torch.device, num_q_heads: int, num_kv_heads: int, head_dim: int,
            dtype: torch.dtype, page: int, q_dtype: torch.dtype | None = None, fp8_cache: bool = False
            ) -> list[WorkerEviction]:
    """Run the engine's compaction path (compact_one) for every policy and allocation once on a short
    prompt in two scratch layers of this head shape (make_cache: the backend's paged-cache adapter of a
    [blocks, H_kv, page, 2*D] cache of `dtype`, or of fp8 bytes), so that every kernel is compiled with the
    argument types the engine passes (none specialises on the prompt length or the layer count); window
    queries of `q_dtype` (default: dtype). Ada-KV states then compact again in place at a decode point, the
    path that scores uneven heads. Returns the compacted states."""
    from vllm_evict.policies import ALLOCATIONS, POLICIES
    from vllm_evict.policies.config import EvictionConfig

    gen = torch.Generator(device=device).manual_seed(0)
    n, num_blocks = 16 * page, 32  # 16 prompt blocks and room for as many fresh ones (P <= 16)

    def scratch(*shape, to):
        values = torch.randn(*shape, generator=gen, device=device)
        return values.to(torch.float8_e4m3fn).view(torch.uint8) if to == "fp8 bytes" else values.to(to)

    layers = [(i, make_cache(scratch(num_blocks, num_kv_heads, page, 2 * head_dim,
                                     to="fp8 bytes" if fp8_cache else dtype))) for i in range(2)]
    states = []
    for policy in POLICIES:
        for allocation in ALLOCATIONS:
            config = EvictionConfig.from_dict({"policy": policy, "budget": 4 * page, "allocation": allocation})
            again = config.allocation == "adakv"
            spec = RequestEviction(config, decode_budget=4 * page if again else None, decode_every=page)
            window, pages = config.window_size(), config.num_pages(n, page)
            state = WorkerEviction.for_prompt("warm-up", spec, n, page, prompt_block_ids=list(range(16)),
                                              fresh_blocks=list(range(16, 16 + pages)))
            for _ in range(2 if again else 1):
                if window:
                    state.q_window = scratch(len(layers), window, num_q_heads, head_dim, to=q_dtype or dtype)
                compact_one([state], layers, head_dim ** -0.5)
                if again:  # next: the decode point one page later, in place over the layout and that page
                    state.kept_most()
                    state.advance()
                    state.prompt_block_ids = list(range(16, 17 + pages))
                    state.fresh_blocks = list(range(16, 16 + -(-state.point.kept // page)))
            states.append(state)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return states


class CompactionTimer:
    """Scoring + compaction time per request: CUDA events around each layer's work (device time, read
    once the events completed, so never a sync), or host time on CPU where the work is synchronous."""

    def __init__(self) -> None:
        self.pending: dict[str, list] = {}

    def start(self, device: torch.device):
        if device.type != "cuda":
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def stop(self, req_ids: list[str], started) -> None:
        """End the span of a batch of requests compacted together: each is charged an equal share."""
        share = 1 / len(req_ids)
        if isinstance(started, float):
            span = (time.perf_counter() - started) * 1e3 * share
        else:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            span = (started, end, share)
        for req_id in req_ids:
            self.pending.setdefault(req_id, []).append(span)

    def collect(self) -> dict[str, float]:
        """Milliseconds per request whose events all completed; the others stay pending."""
        done: dict[str, float] = {}
        for req_id, spans in list(self.pending.items()):
            if all(isinstance(s, float) or s[1].query() for s in spans):
                done[req_id] = sum(s if isinstance(s, float) else s[0].elapsed_time(s[1]) * s[2] for s in spans)
                del self.pending[req_id]
        return done


LATENCY_ATTR = "vllm_evict_latency_ms"
FAILED_ATTR = "vllm_evict_failed"  # {request id: reason} of compactions that raised
TRIMMED_ATTR = "vllm_evict_trimmed"  # {request id: F'} of Ada-KV compactions under TP (F - F' blocks left empty)
STATE = WorkerEvictionState()


def install_runner_hooks() -> None:
    from vllm.config import CUDAGraphMode
    from vllm.v1.cudagraph_dispatcher import CudagraphDispatcher
    from vllm.v1.worker.block_table import MultiGroupBlockTable
    from vllm.v1.worker import gpu_worker
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    if getattr(GPUModelRunner, "_vllm_evict_hooked", False):
        return

    orig_update = GPUModelRunner._update_states
    orig_prepare = GPUModelRunner._prepare_inputs
    orig_execute = GPUModelRunner.execute_model
    orig_model_forward = GPUModelRunner._model_forward
    orig_sample = GPUModelRunner.sample_tokens
    orig_block_table_init = MultiGroupBlockTable.__init__
    orig_dispatch = CudagraphDispatcher.dispatch
    orig_init_keys = CudagraphDispatcher.initialize_cudagraph_keys
    orig_warmup_and_capture = GPUModelRunner._warmup_and_capture
    orig_kernel_warmup = gpu_worker.kernel_warmup
    orig_initialize_kv_cache = GPUModelRunner.initialize_kv_cache

    def initialize_kv_cache(self, kv_cache_config, *args, **kwargs):
        STATE.set_kv_cache_groups(self, kv_cache_config)
        return orig_initialize_kv_cache(self, kv_cache_config, *args, **kwargs)

    def _update_states(self, scheduler_output):
        STATE.before_update_states(self, scheduler_output)
        return orig_update(self, scheduler_output)

    def _prepare_inputs(self, scheduler_output, *args, **kwargs):
        result = orig_prepare(self, scheduler_output, *args, **kwargs)
        STATE.build_plan(self, scheduler_output)
        return result

    def _model_forward(self, *args, **kwargs):
        output = orig_model_forward(self, *args, **kwargs)
        STATE.after_forward(self)
        return output

    def execute_model(self, *args, **kwargs):
        try:
            return STATE.attach_report(orig_execute(self, *args, **kwargs))
        finally:
            STATE.end_step()

    def sample_tokens(self, *args, **kwargs):
        return STATE.attach_report(orig_sample(self, *args, **kwargs))

    def block_table_init(self, *args, **kwargs):
        # During the compaction step a row of the evicted group holds the prompt blocks plus the P fresh ones.
        # Only that group's rows widen: a linear-attention group reads its state index off column 0 and
        # needs rows of its own width. (Before the KV cache groups are known, every group: one group then.)
        group = STATE.group

        def widened(widths):
            return [2 * n if group is None or i == group.index else n for i, n in enumerate(widths)]

        if "max_num_blocks" in kwargs:
            kwargs["max_num_blocks"] = widened(kwargs["max_num_blocks"])
        else:
            args = list(args)
            args[6] = widened(args[6])
        orig_block_table_init(self, *args, **kwargs)

    def dispatch(self, *args, invalid_modes=None, **kwargs):
        # A step with per-head rows, window captures or compactions replays a per-head FULL graph if vLLM
        # picked a FULL decode graph, else runs PIECEWISE or eager (the attention call does the work). Every
        # other step keeps vLLM's choice.
        # The split or unsplit graph as the plan chose, else the one this size has.
        plan, capturing = STATE.plan, STATE.capturing
        per_head = capturing is not None or (plan is not None and plan.needs_per_head_graph)
        mode, desc = orig_dispatch(self, *args, invalid_modes=invalid_modes, **kwargs)
        if per_head and mode == CUDAGraphMode.FULL:
            split = capturing.split_kv if capturing is not None else plan.split_kv
            for choice in (split, not split):
                per_head_desc = PerHeadDecodeBatch(**dataclasses.asdict(desc), split_kv=choice)
                if per_head_desc in self.cudagraph_keys[CUDAGraphMode.FULL]:
                    return mode, per_head_desc
            invalid_modes = set(invalid_modes or ()) | {CUDAGraphMode.FULL}
            return orig_dispatch(self, *args, invalid_modes=invalid_modes, **kwargs)
        return mode, desc

    def initialize_cudagraph_keys(self, *args, **kwargs):
        from vllm_evict.engine.per_head import MAX_SPLIT_SEQUENCES

        orig_init_keys(self, *args, **kwargs)
        num_heads = self.vllm_config.model_config.get_num_kv_heads(self.vllm_config.parallel_config)
        for desc in list(self.cudagraph_keys[CUDAGraphMode.FULL]):
            if desc.uniform and self.uniform_decode_query_len == 1:  # one token per row (per_head.py)
                fields = dataclasses.asdict(desc)
                self.add_cudagraph_key(CUDAGraphMode.FULL, PerHeadDecodeBatch(**fields))
                if desc.num_tokens * num_heads <= MAX_SPLIT_SEQUENCES:
                    self.add_cudagraph_key(CUDAGraphMode.FULL, PerHeadDecodeBatch(**fields, split_kv=True))

    def _warmup_and_capture(self, desc, *args, **kwargs):
        STATE.capturing = desc if isinstance(desc, PerHeadDecodeBatch) else None
        try:
            return orig_warmup_and_capture(self, desc, *args, **kwargs)
        finally:
            STATE.capturing = None

    def kernel_warmup(worker):
        orig_kernel_warmup(worker)
        warm_up_scoring(worker.model_runner)

    GPUModelRunner._update_states = _update_states
    GPUModelRunner.initialize_kv_cache = initialize_kv_cache
    GPUModelRunner._prepare_inputs = _prepare_inputs
    GPUModelRunner.execute_model = execute_model
    GPUModelRunner._model_forward = _model_forward
    GPUModelRunner.sample_tokens = sample_tokens
    MultiGroupBlockTable.__init__ = block_table_init
    CudagraphDispatcher.dispatch = dispatch
    CudagraphDispatcher.initialize_cudagraph_keys = initialize_cudagraph_keys
    GPUModelRunner._warmup_and_capture = _warmup_and_capture
    gpu_worker.kernel_warmup = kernel_warmup
    GPUModelRunner._vllm_evict_hooked = True
