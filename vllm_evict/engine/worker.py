"""Worker side: per-request eviction state, the per-step plan the attention backend reads, and the
model-runner hooks that keep the runner's block table in step with the scheduler's block swap.

The runner hooks wrap three `GPUModelRunner` methods (the CPU runner inherits them):
- `_update_states`: drop state of finished/resumed requests; after a compaction step, strip the
  prompt blocks from the request's block-table row (the scheduler already freed them).
- `_prepare_inputs`: build the StepPlan for this batch (row order is final here).
- `execute_model`: clear the plan when the forward is done.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import torch
from vllm.logger import init_logger

from vllm_evict.engine.compaction import LayerCompaction
from vllm_evict.engine.request_config import RequestEviction, parse_request_or_none

logger = init_logger(__name__)


@dataclass
class WorkerEviction:
    req_id: str
    spec: RequestEviction
    evict_at: int                       # E
    pages: int                          # P
    window: int                         # w
    q_window: dict[int, torch.Tensor] = field(default_factory=dict)   # layer -> [w, Hq, D]
    layers: dict[int, LayerCompaction] = field(default_factory=dict)  # filled during the compaction step
    stacked: tuple | None = None        # per_head.stacked_layers: all layers' pages, built once
    compacted: bool = False             # True from the step after compaction
    prompt_blocks: int = 0              # cdiv(E, page_size): prompt blocks before the P fresh ones
    fresh_blocks: list[int] = field(default_factory=list)  # the P fresh block ids (set for the compaction step)
    serial: int = field(default_factory=itertools.count().__next__)  # unique per eviction (cache keys)


@dataclass
class Capture:
    state: WorkerEviction
    token_start: int     # first batch token to copy
    count: int
    window_offset: int   # row in q_window


@dataclass
class StepPlan:
    num_reqs: int
    states: list[WorkerEviction | None]     # per batch row
    captures: list[Capture]
    compacting: list[int]                    # rows whose chunk ends at their eviction point
    compacted_rows: list[int]                # rows already compacted (per-head attention needed)
    page_size: int
    max_blocks: int                          # widest block-table row this step needs
    row_blocks: list[int]                    # blocks in each row's block-table row
    compacted_tokens: list[int]              # batch indices of the compacted rows' scheduled tokens
    cache: dict = field(default_factory=dict)  # kept across steps (per_head reuses row stacks)
    tables: object | None = None             # per_head.StepTables, built by the first layer

    @property
    def per_head(self) -> bool:
        return bool(self.compacted_rows)


class WorkerEvictionState:
    """All eviction state of one worker process."""

    def __init__(self) -> None:
        self.requests: dict[str, WorkerEviction] = {}
        self.unevicting: set[str] = set()
        self.pending_strip: dict[str, WorkerEviction] = {}
        self.plan: StepPlan | None = None
        self.latency_ms: dict[str, float] = {}   # scoring + compaction time, until sent to the scheduler
        self.step_cache: dict = {}               # per_head's cross-step cache (StepPlan.cache)

    def add_latency(self, req_id: str, ms: float) -> None:
        self.latency_ms[req_id] = self.latency_ms.get(req_id, 0.0) + ms

    def attach_report(self, output):
        """Send compaction latencies to the scheduler on a ModelRunnerOutput (an attribute survives
        the pickling between worker and engine core). vLLM's shared empty output is never touched."""
        from vllm.v1.outputs import EMPTY_MODEL_RUNNER_OUTPUT

        if not self.latency_ms or output is None or output is EMPTY_MODEL_RUNNER_OUTPUT:
            return output
        latency, self.latency_ms = self.latency_ms, {}
        if hasattr(output, "get_output"):  # async scheduling: the real output is built later
            get_output = output.get_output

            def get_output_with_report():
                real = get_output()
                setattr(real, LATENCY_ATTR, latency)
                return real

            output.get_output = get_output_with_report
        else:
            setattr(output, LATENCY_ATTR, latency)
        return output

    def _state_for(self, runner, req_id: str) -> WorkerEviction | None:
        if req_id in self.unevicting:
            return None
        state = self.requests.get(req_id)
        if state is not None:
            return state
        req = runner.requests[req_id]
        spec = parse_request_or_none(req.sampling_params.extra_args if req.sampling_params else None)
        page_size = runner.cache_config.block_size
        num_prompt = req.num_prompt_tokens
        pages = spec.pages_per_head(num_prompt, page_size) if spec is not None else None
        if pages is None:
            self.unevicting.add(req_id)
            return None
        evict_at = spec.eviction_point(num_prompt)
        state = WorkerEviction(req_id=req_id, spec=spec, evict_at=evict_at, pages=pages, window=spec.config.window_size(),
                               prompt_blocks=-(-evict_at // page_size))
        self.requests[req_id] = state
        return state

    def _forget(self, req_id: str) -> None:
        self.requests.pop(req_id, None)
        self.unevicting.discard(req_id)
        self.pending_strip.pop(req_id, None)

    def before_update_states(self, runner, scheduler_output) -> None:
        for req_id in scheduler_output.finished_req_ids:
            self._forget(req_id)
        cached = scheduler_output.scheduled_cached_reqs
        for req_id in getattr(cached, "resumed_req_ids", ()) or ():
            self._forget(req_id)   # preempted: blocks are new, the recompute evicts again
        for req_id, state in self.pending_strip.items():
            req = runner.requests.get(req_id)
            if req is None:
                continue
            req.block_ids = (req.block_ids[0][state.prompt_blocks:],) + tuple(req.block_ids[1:])
            row = runner.input_batch.req_id_to_index.get(req_id)
            if row is not None:
                runner.input_batch.block_table.add_row(req.block_ids, row)
            state.compacted = True
            state.q_window.clear()
        self.pending_strip.clear()

    def build_plan(self, runner, scheduler_output) -> None:
        batch = runner.input_batch
        num_reqs = batch.num_reqs
        states: list[WorkerEviction | None] = []
        captures: list[Capture] = []
        compacting: list[int] = []
        compacted_rows: list[int] = []
        token_start = 0
        page_size = runner.cache_config.block_size
        max_blocks = 1
        row_blocks: list[int] = []
        compacted_tokens: list[int] = []
        for row, req_id in enumerate(batch.req_ids[:num_reqs]):
            count = scheduler_output.num_scheduled_tokens[req_id]
            state = self._state_for(runner, req_id)
            states.append(state)
            if state is not None:
                computed = int(batch.num_computed_tokens_cpu[row])
                if state.compacted:
                    compacted_rows.append(row)
                    compacted_tokens.extend(range(token_start, token_start + count))
                else:
                    lo = max(computed, state.evict_at - state.window)
                    hi = min(computed + count, state.evict_at)
                    if hi > lo:
                        captures.append(Capture(state, token_start + lo - computed, hi - lo,
                                                lo - (state.evict_at - state.window)))
                    if computed + count == state.evict_at:
                        compacting.append(row)
                        blocks = runner.requests[req_id].block_ids[0]
                        state.fresh_blocks = list(blocks[state.prompt_blocks: state.prompt_blocks + state.pages])
                        self.pending_strip[req_id] = state
                    elif computed + count > state.evict_at:
                        logger.error("vllm-evict: request %s passed its eviction point without a chunk "
                                     "boundary there; not evicting it", req_id)
                        self.requests.pop(req_id)
                        self.unevicting.add(req_id)
                        states[-1] = None
            token_start += count
            row_blocks.append(len(runner.requests[req_id].block_ids[0]))
            max_blocks = max(max_blocks, row_blocks[-1])
        self.plan = StepPlan(num_reqs=num_reqs, states=states, captures=captures, compacting=compacting,
                             compacted_rows=compacted_rows, page_size=page_size, max_blocks=max_blocks,
                             row_blocks=row_blocks, compacted_tokens=compacted_tokens, cache=self.step_cache)

    def end_step(self) -> None:
        self.plan = None


LATENCY_ATTR = "vllm_evict_latency_ms"
STATE = WorkerEvictionState()


def install_runner_hooks() -> None:
    from vllm.v1.worker.block_table import MultiGroupBlockTable
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    if getattr(GPUModelRunner, "_vllm_evict_hooked", False):
        return

    orig_update = GPUModelRunner._update_states
    orig_prepare = GPUModelRunner._prepare_inputs
    orig_execute = GPUModelRunner.execute_model
    orig_sample = GPUModelRunner.sample_tokens
    orig_block_table_init = MultiGroupBlockTable.__init__

    def _update_states(self, scheduler_output):
        STATE.before_update_states(self, scheduler_output)
        return orig_update(self, scheduler_output)

    def _prepare_inputs(self, scheduler_output, *args, **kwargs):
        result = orig_prepare(self, scheduler_output, *args, **kwargs)
        STATE.build_plan(self, scheduler_output)
        return result

    def execute_model(self, *args, **kwargs):
        try:
            return STATE.attach_report(orig_execute(self, *args, **kwargs))
        finally:
            STATE.end_step()

    def sample_tokens(self, *args, **kwargs):
        return STATE.attach_report(orig_sample(self, *args, **kwargs))

    def block_table_init(self, *args, **kwargs):
        # During the compaction step a row holds the prompt blocks plus the P fresh ones.
        if "max_num_blocks" in kwargs:
            kwargs["max_num_blocks"] = [2 * n for n in kwargs["max_num_blocks"]]
        else:
            args = list(args)
            args[6] = [2 * n for n in args[6]]
        orig_block_table_init(self, *args, **kwargs)

    GPUModelRunner._update_states = _update_states
    GPUModelRunner._prepare_inputs = _prepare_inputs
    GPUModelRunner.execute_model = execute_model
    GPUModelRunner.sample_tokens = sample_tokens
    MultiGroupBlockTable.__init__ = block_table_init
    GPUModelRunner._vllm_evict_hooked = True
