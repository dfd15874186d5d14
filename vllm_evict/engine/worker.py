"""The worker's eviction state (`STATE`, one per worker process): its evicting requests, each step's plan
(built while vLLM prepares the step's inputs), the compaction after the forward, and the reports to the
scheduler. runner_hooks.py calls it from vLLM's model runner; request_state.py holds one request's state,
step.py what a step evicts."""

from __future__ import annotations

import dataclasses
import os

import torch
from vllm.forward_context import get_forward_context
from vllm.logger import init_logger
from vllm.model_executor.models.utils import extract_layer_index

from vllm_evict.engine.compaction import (GROUP_BYTES, KVHeadGroup, compact_requests, compaction_batches,
                                          group_bytes, token_head_bytes)
from vllm_evict.engine.compaction_graphs import CompactionGraphs, graphs_allowed
from vllm_evict.engine.request_config import PLAN_KEY, parse_request
from vllm_evict.engine.request_state import HostCopy, WorkerEviction, kept_most
from vllm_evict.engine.step import BUILD, Capture, StepPlan, staging_graph_step
from vllm_evict.engine.timing import CompactionTimer
from vllm_evict.engine.window_store import WindowStore

logger = init_logger(__name__)


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
        self.capturing = None                    # the per-head or staged FULL graph being captured (step.py)
        self.num_sms = 0                         # the GPU's SMs (per_head.split_kv; 0: not CUDA)
        self.num_kv_heads = 0                    # this rank's KV heads per layer
        self.heads: KVHeadGroup | None = None    # this rank's KV heads (set with `layers`)
        self.rotation: torch.Tensor | None = None  # expected attention's mean RoPE move (set with `layers`)
        self.windows = WindowStore(0)            # every request's window queries (one per runner)
        self.layers: tuple | None = None         # (runner, attention_layers), set by its first plan
        self.group = None                        # layout.EvictedGroup: the KV cache group compacted (None: none)
        self.followers: dict[int, list] = {}     # a draft model's layers, keyed by the layer whose tokens they keep
        self.sampling_plan: StepPlan | None = None  # with a drafter: the step's plan until its drafts are proposed
        self.group_bytes = GROUP_BYTES           # gathered K/V of one compaction batch (size_batches)
        self.graphs = CompactionGraphs(False)    # captured decode-point batches (set with `layers`)

    def size_batches(self, worker) -> None:
        """At engine start, once vLLM profiled the forward: the gathered K/V one compaction batch may hold."""
        self.group_bytes = group_bytes(getattr(worker, "peak_activation_memory", None))
        logger.info("vllm-evict: compaction batches gather up to %.2f GiB of K/V", self.group_bytes / 2**30)

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
        evict_at, pages, chunk, blocks, num_prompt_tokens, spread = extra_args[PLAN_KEY]
        spec = parse_request(extra_args)  # the scheduler read it, so it is readable
        page_size = runner.cache_config.block_size
        state = WorkerEviction.for_prompt(req_id, spec, num_prompt_tokens, page_size, blocks=blocks, spread=spread)
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
            blocks, written = req.block_ids[g], state.written_blocks
            blocks = blocks[:written] if state.point.in_place else blocks[state.prompt_blocks:]
            if state.used_blocks is not None:  # Ada-KV under TP: drop the blocks its layout left empty
                used = state.used_blocks.read()
                blocks = blocks[:used] + blocks[written:]
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
        builders (they read its layers' names off step.BUILD); None where the model cannot evict."""
        from vllm_evict.engine.layout import evicted_group, model_refusal

        group, reason = evicted_group(kv_cache_config)
        if reason is None:
            config = runner.vllm_config
            reason = model_refusal(runner.model_config, config.scheduler_config, config.speculative_config)
        self.group = None if reason else group
        BUILD.evicted_layers = frozenset() if reason else frozenset(
            kv_cache_config.kv_cache_groups[group.index].layer_names)
        BUILD.hybrid = bool(self.group and self.group.hybrid)
        BUILD.staged_queries = None  # this engine's builders make their own
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
        index, scheduled = batch.req_id_to_index, scheduler_output.num_scheduled_tokens
        rows = []
        for req_id, state in self.requests.items():
            row = index.get(req_id)
            if row is not None and row < num_reqs and req_id in scheduled:
                rows.append((row, state))
        if not rows:
            return
        rows.sort(key=lambda item: item[0])
        # every evicting row, every step: host lists, not numpy scalars, and a row before its next point's
        # window costs a few comparisons
        token_starts = runner.query_start_loc.np[: num_reqs + 1].tolist()
        computed_tokens = batch.num_computed_tokens_cpu[:num_reqs].tolist()
        states: list[WorkerEviction | None] = [None] * num_reqs
        captures: list[Capture] = []
        compacting: list[int] = []
        compacted_rows: list[int] = []
        per_head_rows: list[int] = []
        per_head_tokens: list[int] = []
        for row, state in rows:
            states[row] = state
            token_start = token_starts[row]
            count = token_starts[row + 1] - token_start
            if state.done:  # compacted
                compacted_rows.append(row)
                if not state.stock_layout:
                    per_head_rows.append(row)
                    per_head_tokens.extend(range(token_start, token_start + count))
            computed = computed_tokens[row]
            end = computed + count
            if end <= state.quiet_until:  # before its next point's window (or past its last point)
                continue
            point = state.schedule.point(state.done)
            if point is None or state.failed:
                continue
            point = point.at
            lo = max(computed, point - state.window)
            hi = min(end, point)
            if hi > lo:
                captures.append(Capture(state, token_start + lo - computed, hi - lo, lo - (point - state.window)))
            if end == point:
                self.pending_strip[state.req_id] = state
                current = state.point
                if not current.evicts:  # a point that evicts nothing: it only advances
                    continue
                compacting.append(row)
                blocks = runner.requests[state.req_id].block_ids[self.group.index]
                if current.in_place:  # from the blocks it holds (at - shift tokens) into its first ones
                    state.prompt_block_ids = list(blocks[: -(-(current.at - state.shift) // state.page_size)])
                    state.fresh_blocks = list(blocks[: state.written_blocks])
                else:
                    state.prompt_block_ids = list(blocks[: state.prompt_blocks])
                    state.fresh_blocks = list(blocks[state.prompt_blocks: state.prompt_blocks + state.blocks])
            elif end > point:
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
        if plan.per_head and self.num_sms:
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
        """After the model forward: record the window queries a FULL graph staged (an eager attention call
        recorded its own), then compact the requests that reached their point."""
        plan = self.plan
        if plan is None:
            return
        if plan.capture_tokens is not None and staging_graph_step():
            self.windows.capture_all(staged_queries(), plan.capture_tokens, plan.capture_rows)
        if self.followers:  # a draft model's layers: compact once the drafter has written this step's tokens
            self.sampling_plan = plan
        elif plan.compacting:
            self.compact(runner, plan)

    def after_drafts(self, runner) -> None:
        """After the step's sampling and draft proposals (a drafter with KV layers of its own): compact the
        requests that reached their point, the draft layers keeping what their target layer keeps."""
        plan, self.sampling_plan = self.sampling_plan, None
        if plan is not None and plan.compacting:
            self.compact(runner, plan)

    def draft_shift(self, num_rows: int) -> torch.Tensor | None:
        """[num_rows] positions each row of the step being drafted is shifted by (None: none is)."""
        plan = self.sampling_plan
        if plan is None or plan.shift is None:
            return None
        return self.shift_rows(plan, num_rows)

    @staticmethod
    def shift_rows(plan: StepPlan, num_rows: int) -> torch.Tensor:
        """[num_rows] of plan.shift: rows past the plan's are not shifted."""
        shift = plan.shift[:num_rows]
        return torch.nn.functional.pad(shift, (0, num_rows - shift.shape[0]))

    def draft_lengths(self, metadata):
        """The drafter's common attention metadata of this step (vLLM's, or None), with seq_lens at the
        compacted rows' physical lengths when its layers sit in a hybrid model's evicted group (followers):
        there the runner's seq_lens stay semantic for the other groups (shift_positions), and the drafter
        reads them, then raises them by one per draft step. A dense model's are lowered in place already."""
        plan = self.plan
        if metadata is None or plan is None or plan.shift is None or not self.followers or not self.group.hybrid:
            return metadata
        shift = self.shift_rows(plan, metadata.seq_lens.shape[0])
        return dataclasses.replace(metadata, seq_lens=metadata.seq_lens - shift.to(metadata.seq_lens.dtype))

    def compact(self, runner, plan: StepPlan) -> None:
        """Compact every request whose chunk ended at its point, all layers at once, requests of one batch
        key together (one timed span per batch, shared among its requests)."""
        layers, scale = self.attention_layers(runner)
        device = layers[0][1].device
        states = [plan.states[row] for row in plan.compacting]
        for batch in compaction_batches(states, len(layers), self.num_kv_heads, self.token_head_bytes,
                                        self.group_bytes):
            for state in batch:
                if state.window:
                    state.q_window = self.windows.window(state.window_offset, state.window)
            started = self.latency.start(device)
            try:
                with torch.profiler.record_function("vllm_evict.compact"):  # a named range in torch profiles
                    used = None
                    if not self.graphs.run(batch, layers, scale, self.heads, self.rotation, self.followers,
                                           self.group_bytes):
                        used = compact_one(batch, layers, scale, self.heads, self.rotation, self.followers,
                                           self.group_bytes)
                if used is not None:
                    batch[0].used_blocks = HostCopy(used)
                per_head_states = [state for state in batch if not state.stock_layout]
                if per_head_states:
                    kept_most(per_head_states)
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
            evicted = [m for m in modules if hasattr(getattr(m, "impl", None), "_cached_paged_cache")
                       and m.impl.kv_sharing_target_layer_name is None and m.layer_name in BUILD.evicted_layers]
            drafts = draft_layer_names(runner)
            impls = [m for m in evicted if m.layer_name not in drafts]
            layers = sorted(((extract_layer_index(m.layer_name), m.impl._cached_paged_cache(m, m.kv_cache))
                             for m in impls), key=lambda item: item[0])
            # a draft model's layers share the target's block table: they keep the last target layer's tokens
            self.followers = {layers[-1][0]: [(extract_layer_index(m.layer_name),
                                               m.impl._cached_paged_cache(m, m.kv_cache))
                                              for m in evicted if m.layer_name in drafts]} if drafts else {}
            self.layers = (runner, layers, impls[0].impl.scale)
            self.windows = WindowStore(num_layers=layers[-1][0] + 1)
            self.heads = kv_head_group(runner)
            self.rotation = future_rotation(runner.get_model(), impls[0].layer_name, layers[0][1].device)
            cache = layers[0][1]
            self.num_kv_heads = cache.num_heads
            self.token_head_bytes = token_head_bytes(layers)
            self.num_sms = (torch.cuda.get_device_properties(cache.device).multi_processor_count
                            if cache.device.type == "cuda" else 0)
            from vllm.config import CUDAGraphMode

            eager = (runner.vllm_config.compilation_config.cudagraph_mode == CUDAGraphMode.NONE
                     or os.environ.get("VLLM_EVICT_COMPACTION_GRAPHS", "1") == "0")
            caches = [c for _, c in layers] + [c for group in self.followers.values() for _, c in group]
            self.graphs = CompactionGraphs(cache.device.type == "cuda" and not eager and graphs_allowed(caches))
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
    row_shift, states = [0] * num_reqs, plan.states  # every step: host lists, no numpy scalars
    for row in plan.compacted_rows:
        row_shift[row] = states[row].shift
    device = runner.seq_lens.device
    plan.row_shift = np.array(row_shift, dtype=np.int64)
    shift = plan.shift = host_to_device(row_shift, device)
    tables = runner.input_batch.block_table
    if group.hybrid:
        tables = tables[group.index]
    else:
        runner.seq_lens[:num_reqs] -= shift.to(runner.seq_lens.dtype)
    num_tokens = int(runner.query_start_loc.np[num_reqs])
    positions = runner.positions[:num_tokens] - shift[runner.req_indices.gpu[:num_tokens]]
    tables.compute_slot_mapping(num_reqs, runner.query_start_loc.gpu[: num_reqs + 1], positions)


def future_rotation(model, layer_name: str, device) -> torch.Tensor | None:
    """expected_attention.mean_rotation over the FUTURE_POSITIONS offsets after a window query, from the RoPE
    module beside an evicted attention layer (its cos/sin cache, YaRN's scale divided out), or None for a
    model without one there. The full-attention layers of one model share their RoPE."""
    from vllm_evict.policies.expected_attention import FUTURE_POSITIONS, mean_rotation

    parent = layer_name.rsplit(".", 1)[0]
    rope = getattr(model.get_submodule(parent), "rotary_emb", None) if parent else None
    cache = getattr(rope, "cos_sin_cache", None)
    if cache is None:
        logger.info("vllm-evict: no RoPE module beside %s: expected-attention scores at the window's positions",
                    layer_name)
        return None
    half = rope.rotary_dim // 2
    cache = cache[: FUTURE_POSITIONS + 1].to(torch.float64)
    norm = cache[0, :half]  # cos(0) times the cache's scale
    return mean_rotation(cache[1:, :half] / norm, cache[1:, half:] / norm, rope.head_size,
                         rope.is_neox_style).to(device)


def draft_layer_names(runner) -> set[str]:
    """The attention layers of the runner's draft model (EAGLE, MTP, a draft model: they write a KV cache of
    their own in the target's KV cache groups); empty without one (n-gram speculation has no model)."""
    model = getattr(getattr(runner, "drafter", None), "model", None)
    if not isinstance(model, torch.nn.Module):
        return set()
    return {m.layer_name for m in model.modules() if isinstance(getattr(m, "layer_name", None), str)}


def compact_one(states: list[WorkerEviction], layers: list, scale: float,
                heads: KVHeadGroup = KVHeadGroup(), rotation: torch.Tensor | None = None,
                followers: dict[int, list] | None = None, group_bytes: int = GROUP_BYTES) -> torch.Tensor | None:
    """compact_requests with the requests' block ids on the cache's device (one pinned copy, no sync)."""
    from vllm_evict.engine.per_head import host_to_device

    ids = host_to_device([b for s in states for b in (*s.prompt_block_ids, *s.fresh_blocks)], layers[0][1].device)
    requests, start = [], 0
    for state in states:
        read, written = len(state.prompt_block_ids), len(state.fresh_blocks)
        requests.append((state, ids[start: start + read], ids[start + read: start + read + written]))
        start += read + written
    return compact_requests(requests, layers, scale, heads, rotation, followers, group_bytes)


def staged_queries() -> torch.Tensor:
    """Every layer's queries [L, rows, Hq, D] of the per-head FULL decode graph that just ran."""
    metadata = get_forward_context().attn_metadata
    return next(md.per_head_decode.queries for md in metadata.values() if getattr(md, "per_head_decode", None))


def kv_head_group(runner) -> KVHeadGroup:
    """This worker's KV heads among a layer's (tensor parallelism), and the pipeline's stages."""
    world, stages = runner.parallel_config.tensor_parallel_size, runner.parallel_config.pipeline_parallel_size
    if world == 1:
        return KVHeadGroup(stages=stages)
    from vllm.distributed import get_tensor_model_parallel_rank

    return KVHeadGroup(rank=get_tensor_model_parallel_rank(), world=world,
                       total=runner.model_config.get_total_num_kv_heads(), stages=stages)


LATENCY_ATTR = "vllm_evict_latency_ms"
FAILED_ATTR = "vllm_evict_failed"  # {request id: reason} of compactions that raised
TRIMMED_ATTR = "vllm_evict_trimmed"  # {request id: F'} of Ada-KV compactions under TP (F - F' blocks left empty)
STATE = WorkerEvictionState()
