"""Scheduler / KV-cache-manager side of end-of-prefill eviction.

Accounting (no worker report needed): a request that evicts at prompt position E with P pages per KV
head keeps exactly P*H_kv head-pages per layer, i.e. exactly P blocks, because a block holds one page
of every KV head. So after compaction it needs `F + cdiv(tokens after E, block_size)` blocks, F = P.
Ada-KV under tensor parallelism is the exception: a rank's heads may win more than their P*H_kv/TP
pages, so it is given F = min(P*H_kv/H, cdiv(E, block_size)) fresh blocks, the most any rank can need
(compaction.py; H = the KV heads of one rank). The workers lay the kept pages out over the F' <= F
blocks the fullest rank fills and report F' (TRIMMED_ATTR); the scheduler then frees the other F - F'
(`free_unused_fresh`), which the workers never wrote and dropped from their block tables already.

Life of an evicting request, as the scheduler sees it:
1. Prefix-cache hits are capped at E - max(w, 1) so a chunk ends at E and the worker computes the
   window queries itself.
2. Prefill chunks are cut so one chunk ends exactly at E.
3. When that chunk is scheduled, F fresh (never hashed, never shared) blocks are allocated with it and
   sent to the worker after the prompt blocks; the worker compacts the kept pages into them at the end
   of that step, layer by layer. The scheduler then immediately swaps the request's block list to the
   fresh blocks and frees the prompt blocks (they stay valid prefix-cache entries: compaction never
   writes them). Later steps run after this one, so a freed block is reused only after it was read.
4. From then on the manager sees the request with `removed = E - F*block_size` fewer computed tokens
   (positions and RoPE stay semantic on the worker) and never hashes its blocks again.
Preemption frees everything; the recompute evicts again at the same point.

Block-wise eviction (keydiff chunked=true, SPEC §4.3) repeats step 3 at every eviction point
(request_config.eviction_points) and compacts in place: the kept pages are written into the request's
first P blocks (the worker gathers the held tokens into a buffer first) and the rest are freed. Its
blocks never enter the prefix cache, in either direction, because they are rewritten. So it never
holds more than P + chunk/block_size blocks, and that, not the whole prompt, is what admission checks.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

from vllm.logger import init_logger
from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs
from vllm.v1.kv_cache_interface import FullAttentionSpec
from vllm.v1.request import RequestStatus

from vllm_evict.engine.request_config import (EXTRA_ARGS_KEY, PLAN_KEY, RequestEviction, eviction_points,
                                              long_prompts_allowed, parse_request)
from vllm_evict.engine.worker import FAILED_ATTR, LATENCY_ATTR, TRIMMED_ATTR

logger = init_logger(__name__)


@dataclass
class SchedulerEviction:
    request: RequestEviction
    points: list[int]      # eviction points, the last is E (one point unless block-wise)
    pages: int             # P
    blocks: int            # F: fresh blocks it is given at compaction (P, or more for Ada-KV under TP)
    window: int            # w: window queries the worker must compute itself
    chunk: int = 0         # block-wise chunk in tokens (0: one-shot)
    done: int = 0          # eviction points already scheduled
    swap_pending: bool = False
    removed: int = 0       # last eviction point - F*block_size once compacted
    blocks_before: int = 0  # the most blocks held at a compaction
    prompt_tokens: int = 0
    unused: int | None = None  # of the F, blocks the layout left empty and were freed (None: not yet known)
    latency_ms: float | None = None  # scoring + compaction, reported by the worker
    reported: bool = False           # the report went out on a step's output (before the request ends)

    @property
    def evict_at(self) -> int:
        return self.points[-1]

    @property
    def next_point(self) -> int | None:
        return self.points[self.done] if self.done < len(self.points) else None

    @property
    def compacted(self) -> bool:
        return self.done > 0

    @property
    def in_place(self) -> bool:
        return self.chunk > 0

    def __post_init__(self) -> None:
        self.reset()

    @property
    def held_blocks(self) -> int:
        """Blocks of the kept prefix once compacted (F, less those found unused)."""
        return self.blocks - (self.unused or 0)

    def reset(self) -> None:
        """Before any compaction, and again when preempted (everything was freed; the recompute evicts again
        at the same points)."""
        self.done, self.swap_pending, self.removed = 0, False, 0
        self.unused = None if self.blocks > self.pages else 0


# vLLM's allocate_slots parameters after (self, request, num_new_tokens), and their defaults: passed through,
# never copied into our signature.
_ALLOCATE_SLOTS_DEFAULTS = {p.name: p.default for p in
                            list(inspect.signature(KVCacheManager.allocate_slots).parameters.values())[3:]}


class EvictionKVCacheManager(KVCacheManager):
    """KVCacheManager that knows which requests evict. Installed on the scheduler's manager instance."""

    evictions: dict[str, SchedulerEviction]
    page_size: int

    def get_computed_blocks(self, request):
        blocks, num_hits, *rest = super().get_computed_blocks(request)
        ev = self.evictions.get(request.request_id)
        if ev is None or ev.compacted or num_hits == 0:
            return (blocks, num_hits, *rest)
        if ev.in_place:  # compaction rewrites its blocks: they must be its own
            return (self.empty_kv_cache_blocks, 0, *rest)
        # At least one token (and all w window tokens) before E must be computed here, so that a chunk
        # ends at E and the worker sees the window queries.
        limit = max(0, ev.evict_at - max(ev.window, 1)) // self.page_size * self.page_size
        if num_hits > limit:
            keep = limit // self.page_size
            blocks = KVCacheBlocks(tuple(list(group[:keep]) for group in blocks.blocks))
            num_hits = limit
        return (blocks, num_hits, *rest)

    def allocate_slots(self, request, num_new_tokens, *args, **kwargs):
        ev = self.evictions.get(request.request_id)
        if ev is None:
            return super().allocate_slots(request, num_new_tokens, *args, **kwargs)
        if args:  # vLLM passes keywords; positional ones are named by its signature (checked by surface.py)
            kwargs.update(zip(_ALLOCATE_SLOTS_DEFAULTS, args))
        given = {**_ALLOCATE_SLOTS_DEFAULTS, **kwargs}
        chunk_end = (request.num_computed_tokens + given["num_new_computed_tokens"]
                     + given["num_external_computed_tokens"] + num_new_tokens)
        evicts = chunk_end == ev.next_point
        if ev.in_place or ev.compacted:  # never hashed: compacted blocks, or blocks compaction rewrites
            kwargs["delay_cache_blocks"] = True
        if ev.in_place and given["full_sequence_must_fit"]:  # admission: its peak, not its prompt, must fit
            kwargs["full_sequence_must_fit"] = False
            if self._blocks_short(request, ev):
                return None
        if ev.compacted:  # physical accounting: the manager sees the compacted length
            request.num_computed_tokens -= ev.removed
            try:
                new_blocks = super().allocate_slots(request, num_new_tokens, **kwargs)
            finally:
                request.num_computed_tokens += ev.removed
        elif evicts and not ev.in_place:
            # The chunk that ends at E: allocate it together with F fresh destination blocks.
            kwargs["reserved_blocks"] = given["reserved_blocks"] + ev.blocks
            new_blocks = super().allocate_slots(request, num_new_tokens, **kwargs)
            if new_blocks is None:
                return None
            fresh = self.block_pool.get_new_blocks(ev.blocks)
            manager = self.coordinator.single_type_managers[0]
            manager.req_to_blocks[request.request_id].extend(fresh)
            new_blocks = KVCacheBlocks((list(new_blocks.blocks[0]) + list(fresh),))
        else:
            new_blocks = super().allocate_slots(request, num_new_tokens, **kwargs)
        if evicts and new_blocks is not None:
            ev.swap_pending = True  # swapped in _update_after_schedule, once this step's block ids are sent
        return new_blocks

    def free_unused_fresh(self, request_id: str, ev: SchedulerEviction, used: int) -> None:
        """Free the fresh blocks F' .. F-1 of a compacted request (Ada-KV under TP), which its layout left
        empty: it now holds F' blocks before its tail, and its compacted length drops by the same pages.
        Tail blocks were allocated at the same block boundaries in either view, so nothing else moves."""
        manager = self.coordinator.single_type_managers[0]
        blocks = manager.req_to_blocks[request_id]
        unused = blocks[used: ev.blocks]
        manager.req_to_blocks[request_id] = blocks[:used] + blocks[ev.blocks:]
        manager.num_cached_block[request_id] -= len(unused)
        self.block_pool.free_blocks(reversed(unused))
        ev.removed += len(unused) * self.page_size
        ev.unused = len(unused)

    def _blocks_short(self, request, ev: SchedulerEviction) -> bool:
        """Whether the free pool lacks what a block-wise request holds at its prefill peak (P pages and a
        chunk); vLLM's own check asks the same of a request's whole prompt."""
        peak = peak_blocks(request.num_prompt_tokens, self.page_size, ev)
        held = len(self.coordinator.single_type_managers[0].req_to_blocks.get(request.request_id, ()))
        return peak - held > self.block_pool.get_num_free_blocks()

    def swap_to_compacted(self, request_id: str, ev: SchedulerEviction) -> None:
        """After a compaction step was scheduled: keep the F blocks that hold the kept pages (the fresh ones,
        or the first P when compacting in place), free the rest.

        Freed now, read by the worker in the step just scheduled; any reuse happens in a later step."""
        manager = self.coordinator.single_type_managers[0]
        blocks = manager.req_to_blocks[request_id]
        if ev.in_place:
            kept, freed = blocks[: ev.blocks], blocks[ev.blocks:]
            ev.blocks_before = max(ev.blocks_before, len(blocks))
        else:
            kept, freed = blocks[-ev.blocks:], blocks[: -ev.blocks]
            ev.blocks_before = len(freed)
        manager.req_to_blocks[request_id] = kept
        manager.num_cached_block[request_id] = len(kept)
        self.block_pool.free_blocks(reversed(freed))
        ev.removed = ev.next_point - ev.blocks * self.page_size
        ev.done += 1
        ev.swap_pending = False


def peak_blocks(num_tokens: int, block_size: int, ev: SchedulerEviction | None) -> int:
    """The most blocks a request of `num_tokens` (prompt + max_tokens) holds when it runs alone: its
    whole sequence; with one-shot eviction, F fresh blocks next to the prompt up to E, or F and the tokens
    after E; block-wise, P and a chunk, or P and the tokens after the prompt."""
    if ev is None:
        return -(-num_tokens // block_size)
    after = -(-(num_tokens - ev.evict_at) // block_size)
    return ev.blocks + max(ev.chunk // block_size if ev.in_place else -(-ev.evict_at // block_size), after)


def kv_head_groups(vllm_config) -> int:
    """H_kv / H: how many ranks' worth of distinct KV heads a layer has (1 without tensor parallelism)."""
    model = vllm_config.model_config
    return model.get_total_num_kv_heads() // model.get_num_kv_heads(vllm_config.parallel_config)


def plan_eviction(spec: RequestEviction, num_prompt_tokens: int, block_size: int,
                  head_groups: int = 1) -> SchedulerEviction | None:
    """A request's eviction points, P and F (None if it evicts nothing); head_groups: kv_head_groups."""
    evict_at = spec.eviction_point(num_prompt_tokens)
    pages = spec.config.num_pages(evict_at, block_size)
    if pages is None:
        return None
    blocks = pages
    if spec.config.allocation == "adakv" and head_groups > 1:  # a rank's heads may win all P*H_kv pages
        blocks = min(pages * head_groups, -(-evict_at // block_size))
    chunk = spec.chunk_tokens(block_size)
    return SchedulerEviction(request=spec, points=eviction_points(evict_at, pages, block_size, chunk), pages=pages,
                             blocks=blocks, window=spec.config.window_size(), chunk=chunk,
                             prompt_tokens=num_prompt_tokens)


def never_fit_reason(num_tokens: int, block_size: int, num_blocks: int, ev: SchedulerEviction | None) -> str | None:
    """Why a request of `num_tokens` (prompt + max_tokens) could never run in a cache of `num_blocks` blocks,
    not even alone (it would wait, or be preempted and recomputed, forever), or None if it can."""
    if ev is None and not long_prompts_allowed():
        return None  # vLLM's start-up check made --max-model-len fit the cache
    usable = num_blocks - 1  # less vLLM's null block
    peak = peak_blocks(num_tokens, block_size, ev)
    if peak <= usable:
        return None
    return (f"the request can never fit the KV cache: it holds {peak} blocks of {block_size} tokens at its peak "
            f"(prompt + max_tokens = {num_tokens} tokens), the cache has {usable}; shorten it, lower max_tokens "
            f"or evict block-wise (keydiff chunked=true)")


class _EvictionSchedulerMixin:
    """Adds eviction bookkeeping to vLLM's Scheduler (sync) or AsyncScheduler."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        groups = self.kv_cache_config.kv_cache_groups
        self.eviction_enabled = len(groups) == 1 and isinstance(groups[0].kv_cache_spec, FullAttentionSpec) \
            and getattr(groups[0].kv_cache_spec, "sliding_window", None) is None
        if not self.eviction_enabled:
            logger.warning("vllm-evict: eviction disabled (needs one full-attention KV cache group)")
        self.evictions: dict[str, SchedulerEviction] = {}
        self.failed: list = []  # finished with an error (unreadable settings, failed compaction), output pending
        manager = self.kv_cache_manager
        manager.__class__ = EvictionKVCacheManager
        manager.evictions = self.evictions
        manager.page_size = self.block_size
        # Chunk boundaries at the eviction point go through vLLM's block-aligned-split hook.
        self._vllm_needs_mamba_split = self.need_mamba_block_aligned_split
        self.need_mamba_block_aligned_split = True

    # -- request lifecycle -------------------------------------------------------------------------
    def add_request(self, request) -> None:
        super().add_request(request)
        if not self.eviction_enabled or request.sampling_params is None:
            return
        try:
            spec = parse_request(request.sampling_params.extra_args)
        except ValueError as exc:  # the API process validates; only a client that bypasses it gets here
            logger.error("vllm-evict: request %s rejected: %s", request.request_id, exc)
            self._fail(request)
            return
        ev = None if spec is None else self._plan(request, spec)
        # the API process refuses these at arrival (plugin._install_request_validation); this catches the rest
        reason = never_fit_reason(request.num_prompt_tokens + request.max_tokens, self.block_size,
                                  self.kv_cache_manager.block_pool.num_gpu_blocks, ev)
        if reason is not None:
            logger.error("vllm-evict: request %s: %s", request.request_id, reason)
            self._fail(request)

    def _plan(self, request, spec: RequestEviction) -> SchedulerEviction | None:
        """The request's eviction points, P and F, also handed to the workers; None if it evicts nothing."""
        ev = plan_eviction(spec, request.num_prompt_tokens, self.block_size, kv_head_groups(self.vllm_config))
        if ev is None:
            return None
        params = request.sampling_params
        params.extra_args = {**(params.extra_args or {}),
                             PLAN_KEY: [ev.evict_at, ev.pages, ev.chunk, ev.blocks]}  # for the workers
        self.evictions[request.request_id] = ev
        return ev

    def _mamba_block_aligned_split(self, request, num_new_tokens, num_new_local_computed_tokens=0,
                                   num_external_computed_tokens=0):
        if self._vllm_needs_mamba_split:
            num_new_tokens = super()._mamba_block_aligned_split(
                request, num_new_tokens, num_new_local_computed_tokens, num_external_computed_tokens)
        ev = self.evictions.get(request.request_id)
        if ev is None or ev.swap_pending or ev.next_point is None:
            return num_new_tokens
        start = request.num_computed_tokens + num_new_local_computed_tokens + num_external_computed_tokens
        return min(num_new_tokens, ev.next_point - start) if start < ev.next_point else num_new_tokens

    def _preempt_request(self, request, timestamp) -> None:
        super()._preempt_request(request, timestamp)
        ev = self.evictions.get(request.request_id)
        if ev is not None:
            ev.reset()

    def _update_after_schedule(self, scheduler_output) -> None:
        super()._update_after_schedule(scheduler_output)
        for req_id in scheduler_output.num_scheduled_tokens:
            ev = self.evictions.get(req_id)
            if ev is not None and ev.swap_pending:
                self.kv_cache_manager.swap_to_compacted(req_id, ev)

    def update_from_output(self, scheduler_output, model_runner_output):
        latency = getattr(model_runner_output, LATENCY_ATTR, None) or {}
        for req_id, ms in latency.items():
            ev = self.evictions.get(req_id)
            if ev is not None:
                ev.latency_ms = (ev.latency_ms or 0.0) + ms
        trimmed = getattr(model_runner_output, TRIMMED_ATTR, None) or {}
        for req_id, used in trimmed.items():
            ev = self.evictions.get(req_id)
            if ev is not None and ev.compacted and ev.unused is None:  # else preempted or finished since
                self.kv_cache_manager.free_unused_fresh(req_id, ev, used)
        # reported once its last compaction's latency and block count are both known
        ready = [req_id for req_id in {**latency, **trimmed} if (ev := self.evictions.get(req_id)) is not None
                 and ev.next_point is None and not ev.reported and ev.latency_ms is not None and ev.unused is not None]
        outputs = super().update_from_output(scheduler_output, model_runner_output)
        if ready:
            self._send_reports(ready, outputs)
        for req_id, reason in (getattr(model_runner_output, FAILED_ATTR, None) or {}).items():
            request = self.requests.get(req_id)
            if request is not None and not request.is_finished():  # its KV is not usable any more
                logger.error("vllm-evict: request %s ends with an error: its compaction failed (%s)", req_id, reason)
                self._fail(request)
        if self.failed:
            self._send_failures(outputs)
        return outputs

    def _fail(self, request) -> None:
        self.finish_requests(request.request_id, RequestStatus.FINISHED_ERROR)
        self.failed.append(request)

    def _send_failures(self, outputs) -> None:
        """The final output (finish reason "error") of each failed request, as vLLM sends it for a request
        whose grammar failed to compile; the OpenAI server answers it with an internal-error response."""
        for request in self.failed:
            output = EngineCoreOutput(request_id=request.request_id, new_token_ids=[],
                                      finish_reason=request.get_finished_reason(), events=request.take_events(),
                                      trace_headers=request.trace_headers)
            outputs.setdefault(request.client_index, EngineCoreOutputs()).outputs.append(output)
        self.failed.clear()

    def _send_reports(self, req_ids, outputs) -> None:
        """The report of a finished compaction, on the request's output of this step: the API process
        keeps it even if it ends the request itself (a stop string) or the client goes away. The final
        output carries it again (`_free_request`), for offline use."""
        pending = {req_id: self.evictions[req_id] for req_id in req_ids if req_id in self.evictions}
        for engine_outputs in outputs.values():
            for output in engine_outputs.outputs:
                ev = pending.pop(output.request_id, None)
                if ev is not None:
                    output.kv_transfer_params = {**(output.kv_transfer_params or {}), EXTRA_ARGS_KEY: self._report(ev)}
                    ev.reported = True

    def _free_request(self, request, delay_free_blocks: bool = False):
        kv_xfer_params, ec_xfer_params = super()._free_request(request, delay_free_blocks)
        ev = self.evictions.pop(request.request_id, None)
        if ev is not None and ev.compacted:
            kv_xfer_params = dict(kv_xfer_params or {})
            kv_xfer_params[EXTRA_ARGS_KEY] = self._report(ev)
        return kv_xfer_params, ec_xfer_params

    def _report(self, ev: SchedulerEviction) -> dict[str, Any]:
        config = ev.request.config
        return {
            "policy": config.policy,
            "allocation": config.allocation,
            "budget": config.budget,
            "prompt_tokens": ev.prompt_tokens,
            "evicted_prefix_tokens": ev.evict_at,
            "pages_per_head": ev.pages,
            # Average over layers and heads: every layer holds exactly P*H_kv pages; a head keeps whole
            # pages unless it keeps its whole prefix, so this is exact up to that partial last page.
            "kept_tokens_per_head": min(ev.pages * self.block_size, ev.evict_at),
            "blocks_before": ev.blocks_before,
            "blocks_after": ev.held_blocks,
            "blocks_freed": ev.blocks_before - ev.held_blocks,
            **({"chunk_size": ev.chunk, "compactions": ev.done} if ev.in_place else {}),
            **({"latency_ms": round(ev.latency_ms, 3)} if ev.latency_ms is not None else {}),
        }


class EvictionScheduler(_EvictionSchedulerMixin, Scheduler):
    pass


class AsyncEvictionScheduler(_EvictionSchedulerMixin, AsyncScheduler):
    pass
