"""Scheduler / KV-cache-manager side of end-of-prefill eviction.

Accounting (no worker report needed): a request that evicts at prompt position E with P pages per KV
head keeps exactly P*H_kv head-pages per layer, i.e. exactly P blocks, because a block holds one page
of every KV head. So after compaction it needs `F + cdiv(tokens after E, block_size)` blocks, F = P.
Ada-KV under tensor parallelism is the exception: a rank's heads may win more than their P*H_kv/TP
pages, so it is given F = min(P*H_kv/H, cdiv(E, block_size)) fresh blocks, the most any rank can need
(compaction.py; H = the KV heads of one rank). The workers lay the kept pages out over the F' <= F
blocks the fullest rank fills and report F' (TRIMMED_ATTR); the scheduler then frees the other F - F'
(`trim`), which the workers never wrote and dropped from their block tables already. Its in-place
compactions (evicting again) write over the request's first blocks in the same way
(CompactionSchedule.written_blocks).

Life of an evicting request, as the scheduler sees it:
1. Prefix-cache hits are capped at E - max(w, 1) so a chunk ends at E and the worker computes the
   window queries itself.
2. Prefill chunks are cut so one chunk ends exactly at E.
3. When that chunk is scheduled, F fresh (never hashed, never shared) blocks are allocated with it and
   sent to the worker after the prompt blocks; the worker compacts the kept pages into them at the end
   of that step, layer by layer. The scheduler then immediately swaps the request's block list to the
   fresh blocks and frees the prompt blocks (they stay valid prefix-cache entries: compaction never
   writes them). Later steps run after this one, so a freed block is reused only after it was read.
4. From then on the evicted group's manager sees the request with `removed = E - F*block_size` fewer
   tokens (CompactedGroupManager; positions and RoPE stay semantic on the worker) and never hashes its
   blocks again.
Preemption frees everything; the recompute evicts again at the same point.

Hybrid models (layout.py): only the full-attention KV cache group is compacted, and every block count
above is that group's. The other groups (sliding window, linear attention) keep vLLM's handling through
the same coordinator; admission and the never-fit check add what they hold (layout.other_group_blocks).

Evicting again (DESIGN.md §4.8): block-wise eviction (chunked=true) and decode-time eviction (decode_budget)
repeat step 3 at every point of the request's CompactionSchedule and compact in place: the kept tokens
are written into the request's first blocks (the worker gathers the held tokens into a buffer first) and
the rest are freed. A request whose first compaction is in place takes no prefix hits and caches nothing,
because its blocks are rewritten. Its peak over the schedule, not its whole sequence, is what admission
checks, beside the growth to their peaks of the running requests that compact in place: a pool that holds
fewer peaks than requests then runs as many as it holds and never preempts one of them for another.
"""

from __future__ import annotations

import inspect
import os
from dataclasses import dataclass, field
from typing import Any

from vllm.logger import init_logger
from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.core.single_type_kv_cache_manager import SingleTypeKVCacheManager
from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs
from vllm.v1.request import RequestStatus

from vllm_evict.engine.request_config import (DEFAULT_ENV, EXTRA_ARGS_KEY, PLAN_KEY, CompactionSchedule, FollowsSchedule,
                                              RequestEviction,
                                              long_prompts_allowed, parse_request)
from vllm_evict.engine.host_gc import relax_full_collections
from vllm_evict.engine.layout import EvictedGroup, evicted_group, model_refusal, other_group_blocks
from vllm_evict.engine.worker import FAILED_ATTR, LATENCY_ATTR, TRIMMED_ATTR

logger = init_logger(__name__)


@dataclass
class SchedulerEviction(FollowsSchedule):
    request: RequestEviction
    schedule: CompactionSchedule  # the request's compaction points (shared with the workers)
    blocks: int            # F: fresh blocks a one-shot compaction writes (P, or more for Ada-KV under TP)
    window: int            # w: window queries the worker must compute itself
    spread: int = 1        # H_kv / H for Ada-KV under TP (a rank's heads may win more than their share), else 1
    peak: int = 0          # blocks it holds at its peak, alone (admission, never-fit check)
    other_blocks: int = 0  # blocks the other KV cache groups of a hybrid model hold for its whole sequence
    done: int = 0          # compaction points already scheduled
    swap_pending: bool = False
    removed: int = 0       # semantic minus physical length once compacted
    blocks_before: int = 0  # the most blocks held at a prompt compaction
    held_after_prompt: int = 0  # blocks held after the last prompt compaction
    unused: int | None = None  # of the F, blocks the layout left empty and were freed (None: not yet known)
    trimming: int | None = None  # blocks the last compaction wrote whose F' the workers have yet to report
    decode_compactions: int = 0  # decode points that evicted
    decode_evicted: int = 0      # tokens per head evicted at them
    decode_blocks_freed: int = 0
    latency_ms: float | None = None  # scoring + compaction, reported by the worker
    reported: int = 0                # compactions whose report went out on a step's output
    rewrites_blocks: bool = field(init=False)
    bounded: bool = field(init=False)  # it compacts in place again and again: its peak, not its sequence, must fit

    @property
    def prompt_compacted(self) -> bool:
        return self.done > 0 and self.done >= self.schedule.prompt_points > 0

    def __post_init__(self) -> None:
        # Its first compaction rewrites the blocks it prefilled (block-wise, or a decode budget without a prompt
        # eviction): they must be its own, so it takes no prefix hits and caches nothing. Read every step: a field.
        first = self.schedule.point(0)
        self.rewrites_blocks = first is not None and first.in_place
        self.bounded = bool(self.chunk or self.schedule.decode_every)
        self.reset()

    @property
    def held_blocks(self) -> int:
        """Blocks of the kept prefix once compacted at the prompt (F, less those found unused)."""
        return self.blocks - (self.unused or 0)

    def reset(self) -> None:
        """Before any compaction, and again when preempted (everything was freed; the recompute evicts again
        at the same points)."""
        self.done, self.swap_pending, self.removed, self.trimming = 0, False, 0, None
        self.decode_compactions = self.decode_evicted = self.decode_blocks_freed = 0
        self.unused = None if self.pages is not None and self.blocks > self.pages else 0


# vLLM's allocate_slots parameters after (self, request, num_new_tokens), and their defaults: passed through,
# never copied into our signature.
_ALLOCATE_SLOTS_DEFAULTS = {p.name: p.default for p in
                            list(inspect.signature(KVCacheManager.allocate_slots).parameters.values())[3:]}


def _argument(kwargs: dict[str, Any], name: str) -> Any:
    """An allocate_slots argument as vLLM passed it, or its default."""
    return kwargs.get(name, _ALLOCATE_SLOTS_DEFAULTS[name])


class CompactedGroupManager(SingleTypeKVCacheManager):
    """Mixed into the evicted group's single-type manager (installed on the instance): it counts a
    compacted request's tokens physically, `removed` fewer than the request's semantic count, so vLLM's
    coordinator sizes that group's blocks by what it holds while the other groups see every token.

    Its methods run for every running request of every step, so the instance has this class only while some
    request has tokens removed (EvictionKVCacheManager.set_removed). `remove_skipped_blocks` needs no override:
    the evicted group is full attention, which skips no tokens whatever their count (install_group_manager
    checks)."""

    removed: dict[str, int]

    def get_num_blocks_to_allocate(self, request_id, num_tokens, new_computed_blocks, total_computed_tokens,
                                   num_local_computed_tokens, num_tokens_main_model, *args, **kwargs):
        r = self.removed.get(request_id, 0)
        return super().get_num_blocks_to_allocate(request_id, num_tokens - r, new_computed_blocks,
                                                  total_computed_tokens - r, num_local_computed_tokens - r,
                                                  num_tokens_main_model - r, *args, **kwargs)

    def allocate_new_blocks(self, request_id, num_tokens, num_tokens_main_model, *args, **kwargs):
        r = self.removed.get(request_id, 0)
        return super().allocate_new_blocks(request_id, num_tokens - r, num_tokens_main_model - r, *args, **kwargs)


def install_group_manager(manager) -> None:
    """Prepare `manager` (a single-type manager instance) to become a CompactedGroupManager of its own class
    (the mixin derives from vLLM's base so that the instance's layout stays that of its class)."""
    cls = type(manager)
    if cls.get_num_skipped_tokens is not SingleTypeKVCacheManager.get_num_skipped_tokens:
        raise TypeError(f"vllm-evict compacts full-attention KV cache groups only, not {cls.__name__}'s")
    manager.classes = (cls, type(f"Compacted{cls.__name__}", (CompactedGroupManager, cls), {}))
    manager.removed = {}


class EvictionKVCacheManager(KVCacheManager):
    """KVCacheManager that knows which requests evict. Installed on the scheduler's manager instance."""

    evictions: dict[str, SchedulerEviction]
    pending_swaps: set[str]  # requests whose compaction step allocate_slots scheduled, until swapped
    growth: int | None       # blocks the running bounded requests have yet to take (None: not counted this step)
    page_size: int
    group: EvictedGroup

    @property
    def evicted(self):
        """The single-type manager of the group eviction compacts."""
        return self.coordinator.single_type_managers[self.group.index]

    def set_removed(self, request_id: str, ev: SchedulerEviction | None) -> None:
        """Record what the evicted group's manager subtracts for a request (None: it is gone)."""
        manager = self.evicted
        if ev is not None and ev.removed:
            manager.removed[request_id] = ev.removed
        else:
            manager.removed.pop(request_id, None)
        manager.__class__ = manager.classes[bool(manager.removed)]

    def get_computed_blocks(self, request):
        blocks, num_hits, *rest = super().get_computed_blocks(request)
        ev = self.evictions.get(request.request_id)
        if ev is None or ev.compacted or num_hits == 0:
            return (blocks, num_hits, *rest)
        if ev.rewrites_blocks or not self.group.hits_cut_at_pages:  # rewritten blocks must be its own; a
            return (self.empty_kv_cache_blocks, 0, *rest)           # linear-attention state has no cut
        # At least one token (and all w window tokens) before E must be computed here, so that a chunk
        # ends at E and the worker sees the window queries.
        limit = max(0, ev.evict_at - max(ev.window, 1)) // self.page_size * self.page_size
        if num_hits > limit:
            keep = limit // self.page_size
            blocks = KVCacheBlocks(tuple(list(group[:keep]) for group in blocks.blocks))
            num_hits = limit
            # a sliding-window group's hit holds only its last window (null blocks before it): cut shorter,
            # the window before the cut may be gone, and then the request takes no hit
            if any(block.is_null for group in blocks.blocks for block in group[max(0, keep - self.group.window_blocks):]):
                return (self.empty_kv_cache_blocks, 0, *rest)
        return (blocks, num_hits, *rest)

    def allocate_slots(self, request, num_new_tokens, *args, **kwargs):
        ev = self.evictions.get(request.request_id)
        if ev is None:
            return super().allocate_slots(request, num_new_tokens, *args, **kwargs)
        if args:  # vLLM passes keywords; positional ones are named by its signature (checked by surface.py)
            kwargs.update(zip(_ALLOCATE_SLOTS_DEFAULTS, args))
        # every running request, every step: the arguments read where given, no merged dict of the defaults
        chunk_end = (request.num_computed_tokens + _argument(kwargs, "num_new_computed_tokens")
                     + _argument(kwargs, "num_external_computed_tokens") + num_new_tokens)
        point = ev.schedule.point(ev.done)  # no properties
        evicts = point is not None and chunk_end == point.at
        compacted = ev.done > 0
        never_cached = compacted or ev.rewrites_blocks  # never hashed: compacted blocks, or blocks it rewrites
        if never_cached:
            kwargs["delay_cache_blocks"] = True
        # admission: its peak, not its sequence, must fit, beside what the running bounded requests will grow to
        admitting = _argument(kwargs, "full_sequence_must_fit") and ev.bounded
        if admitting:
            kwargs["full_sequence_must_fit"] = False
            if self._blocks_short(request, ev):
                return None
        if evicts and not point.in_place and not compacted:
            # The chunk that ends at E: allocate it together with F fresh destination blocks.
            kwargs["reserved_blocks"] = _argument(kwargs, "reserved_blocks") + ev.blocks
            new_blocks = super().allocate_slots(request, num_new_tokens, **kwargs)
            if new_blocks is None:
                return None
            fresh = self.block_pool.get_new_blocks(ev.blocks)
            self.evicted.req_to_blocks[request.request_id].extend(fresh)
            g = self.group.index
            new_blocks = KVCacheBlocks(tuple(list(blocks) + (list(fresh) if i == g else [])
                                             for i, blocks in enumerate(new_blocks.blocks)))
        else:  # a compacted request: the evicted group's manager counts it physically (CompactedGroupManager)
            new_blocks = super().allocate_slots(request, num_new_tokens, **kwargs)
        if never_cached and new_blocks is not None and request.request_id not in self.evicted.num_cached_block:
            # vLLM's managers size a request's next blocks by a shortcut only once they track its cached
            # blocks, which they start doing when they cache some: track these, none cached, from here on
            for manager in self.coordinator.single_type_managers:
                manager.num_cached_block.setdefault(request.request_id, 0)
        if admitting and new_blocks is not None:
            self.growth += self._growth(ev, self._held(request.request_id))
        if evicts and new_blocks is not None:
            ev.swap_pending = True  # swapped in _update_after_schedule, once this step's block ids are sent
            self.pending_swaps.add(request.request_id)
        return new_blocks

    def trim(self, request_id: str, ev: SchedulerEviction, used: int) -> None:
        """Free the blocks F' .. F-1 that the last compaction of a request (Ada-KV under TP) wrote over but
        its layout left empty: it now holds F' blocks before its tail, and its compacted length drops by the
        same pages. Tail blocks were allocated at the same block boundaries in either view, so nothing else
        moves."""
        manager, written = self.evicted, ev.trimming
        blocks = manager.req_to_blocks[request_id]
        unused = blocks[used: written]
        manager.req_to_blocks[request_id] = blocks[:used] + blocks[written:]
        manager.num_cached_block[request_id] -= len(unused)
        self.block_pool.free_blocks(reversed(unused))
        ev.removed += len(unused) * self.page_size
        self.set_removed(request_id, ev)
        ev.trimming = None
        point = ev.schedule.point(ev.done - 1)
        if point.decode:
            ev.decode_blocks_freed += len(unused)
        else:
            ev.held_after_prompt -= len(unused)
        if not point.in_place:
            ev.unused = len(unused)

    def _held(self, request_id: str) -> int:
        """Blocks a request holds in every group, counted for every running request at every admission step: the
        evicted group (full attention) holds no null blocks, so its length; a hybrid model's other groups put
        null blocks in place of those that left the window or state, mostly before the ones they hold, so
        their trailing run of held blocks (quick, and where nulls sit elsewhere it falls short: more reserved)."""
        held = len(self.evicted.req_to_blocks.get(request_id, ()))
        if self.group.hybrid:
            for manager in self.coordinator.single_type_managers:
                if manager is not self.evicted:
                    for block in reversed(manager.req_to_blocks.get(request_id, ())):
                        if block.is_null:
                            break
                        held += 1
        return held

    @staticmethod
    def _growth(ev: SchedulerEviction, held: int) -> int:
        """Blocks a request that compacts in place and holds `held` has yet to take before its peak (block-wise:
        P pages and a chunk; a decode budget: P_d pages and C_d tokens; a hybrid model's other groups: its whole
        sequence)."""
        return max(0, ev.peak + ev.other_blocks - held)

    def _blocks_short(self, request, ev: SchedulerEviction) -> bool:
        """Whether the free pool lacks a waiting request's growth to its peak (vLLM's own check asks the same of
        its whole sequence) beside the growth of every running request that compacts in place. Admitting it
        otherwise would preempt one of them once they grow, and a preempted one recomputes its whole sequence
        (its points included): a pool that holds fewer peaks than requests would preempt again and again.
        Requests that grow without bound (no eviction, or one-shot) keep vLLM's admission: they are not
        counted, as vLLM counts no growth."""
        if self.growth is None:  # once per scheduling step (reset in _update_after_schedule), then per admission
            growth, running, hybrid = 0, self.evicted.req_to_blocks, self.group.hybrid
            for req_id, each in self.evictions.items():  # running: it holds blocks from its first chunk on
                if each.bounded and (blocks := running.get(req_id)) and req_id != request.request_id:
                    growth += self._growth(each, self._held(req_id) if hybrid else len(blocks))
            self.growth = growth
        return self._growth(ev, self._held(request.request_id)) + self.growth > self.block_pool.get_num_free_blocks()

    def swap_to_compacted(self, request_id: str, ev: SchedulerEviction) -> None:
        """After a compaction step was scheduled: keep the blocks that hold the kept pages (the F fresh ones,
        or, compacting in place, the first ones its kept tokens fill), free the rest.

        Freed now, read by the worker in the step just scheduled; any reuse happens in a later step."""
        manager = self.evicted
        blocks = manager.req_to_blocks[request_id]
        point = ev.point
        if point.in_place:  # the first blocks it writes (request_config.CompactionSchedule.written_blocks)
            count, trims = ev.schedule.written_blocks(ev.done, ev.spread)
            kept, freed = blocks[:count], blocks[count:]
            ev.removed = point.at - ev.schedule.held_after(ev.done, ev.spread)
        else:
            count, trims = ev.blocks, ev.blocks > ev.pages
            kept, freed = blocks[-ev.blocks:], blocks[: -ev.blocks]
            ev.removed = point.at - ev.blocks * self.page_size
        ev.trimming = count if trims else None
        if point.decode:
            ev.decode_compactions += point.evicts
            ev.decode_evicted += point.held - point.kept
            ev.decode_blocks_freed += len(freed)
        else:
            ev.blocks_before = max(ev.blocks_before, len(blocks) if point.in_place else len(freed))
            ev.held_after_prompt = len(kept)
        manager.req_to_blocks[request_id] = kept
        manager.num_cached_block[request_id] = len(kept)
        self.block_pool.free_blocks(reversed(freed))
        self.set_removed(request_id, ev)
        ev.done += 1
        ev.swap_pending = False


def peak_blocks(num_tokens: int, block_size: int, ev: SchedulerEviction | None) -> int:
    """The most blocks a request of `num_tokens` (prompt + max_tokens) holds when it runs alone: its
    whole sequence, or what its compaction schedule holds at its fullest (CompactionSchedule.peak_blocks)."""
    if ev is None:
        return -(-num_tokens // block_size)
    return ev.schedule.peak_blocks(num_tokens, ev.blocks, ev.spread)


def kv_head_groups(vllm_config) -> int:
    """H_kv / H: how many ranks' worth of distinct KV heads a layer has (1 without tensor parallelism)."""
    model = vllm_config.model_config
    return model.get_total_num_kv_heads() // model.get_num_kv_heads(vllm_config.parallel_config)


def plan_eviction(spec: RequestEviction, num_prompt_tokens: int, block_size: int, head_groups: int = 1,
                  max_tokens: int = 0) -> SchedulerEviction | None:
    """A request's compaction schedule, F and peak (None if it evicts nothing); head_groups: kv_head_groups.
    Raises ValueError for settings this page size refuses."""
    spec.check_page_size(block_size)
    schedule = CompactionSchedule(spec, num_prompt_tokens, block_size)
    if not schedule.evicts:
        return None
    blocks = pages = schedule.pages or 0
    spread = head_groups if spec.config.allocation == "adakv" else 1
    if pages and spread > 1:  # a rank's heads may win all P*H_kv pages (compaction.py)
        blocks = min(pages * spread, -(-schedule.evict_at // block_size))
    ev = SchedulerEviction(request=spec, schedule=schedule, blocks=blocks, window=spec.config.window_size(),
                           spread=spread)
    ev.peak = peak_blocks(num_prompt_tokens + max_tokens, block_size, ev)
    return ev


def never_fit_reason(num_tokens: int, block_size: int, num_blocks: int, ev: SchedulerEviction | None,
                     other_blocks: int = 0) -> str | None:
    """Why a request of `num_tokens` (prompt + max_tokens) could never run in a cache of `num_blocks` blocks,
    not even alone (it would wait, or be preempted and recomputed, forever), or None if it can.
    other_blocks: what the groups eviction leaves alone hold for it (a hybrid model's; layout.py)."""
    if ev is None and not long_prompts_allowed():
        return None  # vLLM's start-up check made --max-model-len fit the cache
    usable = num_blocks - 1  # less vLLM's null block
    peak = peak_blocks(num_tokens, block_size, ev) + other_blocks
    if peak <= usable:
        return None
    return (f"the request can never fit the KV cache: it holds {peak} blocks of {block_size} tokens at its peak "
            f"(prompt + max_tokens = {num_tokens} tokens), the cache has {usable}; shorten it, lower max_tokens "
            f"or evict again (chunked=true, decode_budget)")


class _EvictionSchedulerMixin:
    """Adds eviction bookkeeping to vLLM's Scheduler (sync) or AsyncScheduler."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        relax_full_collections()  # the engine core's process holds every request's token lists
        group, reason = evicted_group(self.kv_cache_config)
        # a page: one block of the evicted group (a hybrid model's other groups may use other block sizes)
        self.page_size = self.kv_cache_config.kv_cache_groups[group.index].kv_cache_spec.block_size \
            if group is not None else self.block_size
        config = self.vllm_config
        reason = model_refusal(config.model_config, config.scheduler_config, config.speculative_config) or reason
        self.refusal = reason  # why this model cannot evict (None: it can); requests that ask are failed
        self.evictions: dict[str, SchedulerEviction] = {}
        self.pending_swaps: set[str] = set()
        self.failed: list = []  # finished with an error (unreadable settings, failed compaction), output pending
        # Chunk boundaries at the eviction point go through vLLM's block-aligned-split hook.
        self._vllm_needs_mamba_split = self.need_mamba_block_aligned_split
        self.need_mamba_block_aligned_split = True
        if reason is not None:
            if os.environ.get(DEFAULT_ENV):  # the server was told to evict every request: refuse to start
                raise ValueError(f"vllm-evict: a default eviction is set, but this model cannot evict: {reason}")
            logger.warning("vllm-evict: this model cannot evict: %s; requests that ask for eviction fail", reason)
            return
        manager = self.kv_cache_manager
        manager.__class__ = EvictionKVCacheManager
        manager.evictions = self.evictions
        manager.pending_swaps = self.pending_swaps
        manager.growth = None
        manager.page_size = self.page_size
        manager.group = group
        install_group_manager(manager.evicted)
        if group.hybrid:
            logger.info("vllm-evict: hybrid model: eviction compacts KV cache group %d of %d (%d full-attention "
                        "layers); the others keep vLLM's handling", group.index, group.num_groups,
                        len(self.kv_cache_config.kv_cache_groups[group.index].layer_names))

    # -- request lifecycle -------------------------------------------------------------------------
    def add_request(self, request) -> None:
        super().add_request(request)
        if request.sampling_params is None:
            return
        try:
            spec = parse_request(request.sampling_params.extra_args)
            if spec is not None and self.refusal is not None:
                raise ValueError(f"this model cannot evict: {self.refusal}")
            ev = None if spec is None else self._plan(request, spec)
        except ValueError as exc:  # the API process validates; only a client that bypasses it gets here
            logger.error("vllm-evict: request %s rejected: %s", request.request_id, exc)
            self._fail(request)
            return
        # the API process refuses these at arrival (plugin._install_request_validation); this catches the rest
        num_tokens = request.num_prompt_tokens + request.max_tokens
        reason = never_fit_reason(num_tokens, self.page_size, self.kv_cache_manager.block_pool.num_gpu_blocks, ev,
                                  ev.other_blocks if ev is not None else 0)
        if reason is not None:
            logger.error("vllm-evict: request %s: %s", request.request_id, reason)
            self._fail(request)

    def _plan(self, request, spec: RequestEviction) -> SchedulerEviction | None:
        """The request's compaction schedule and F, also handed to the workers; None if it evicts nothing."""
        ev = plan_eviction(spec, request.num_prompt_tokens, self.page_size, kv_head_groups(self.vllm_config),
                           request.max_tokens)
        if ev is None:
            return None
        manager = self.kv_cache_manager
        if manager.group.hybrid:
            ev.other_blocks = other_group_blocks(self.kv_cache_config, manager.group,
                                                 request.num_prompt_tokens + request.max_tokens)
        params = request.sampling_params
        params.extra_args = {**(params.extra_args or {}),  # for the workers
                             PLAN_KEY: [ev.evict_at, ev.pages or 0, ev.chunk, ev.blocks, request.num_prompt_tokens,
                                       ev.spread]}
        self.evictions[request.request_id] = ev
        return ev

    def _mamba_block_aligned_split(self, request, num_new_tokens, num_new_local_computed_tokens=0,
                                   num_external_computed_tokens=0):
        if self._vllm_needs_mamba_split:
            num_new_tokens = super()._mamba_block_aligned_split(
                request, num_new_tokens, num_new_local_computed_tokens, num_external_computed_tokens)
        if num_new_tokens <= 1:  # one token never passes a point: every running request's decode step
            return num_new_tokens
        ev = self.evictions.get(request.request_id)
        if ev is None or ev.swap_pending:
            return num_new_tokens
        point = ev.schedule.point(ev.done)
        if point is None:
            return num_new_tokens
        start = request.num_computed_tokens + num_new_local_computed_tokens + num_external_computed_tokens
        to_point = point.at - start
        if to_point <= 0 or num_new_tokens < to_point:
            return num_new_tokens
        if to_point > 1 and start >= request.num_prompt_tokens:
            # a decode step's tokens after its first are draft tokens (speculative decoding), which may be
            # rejected: it stops a token short of the point, which a step of one verified token then reaches
            return to_point - 1
        return min(num_new_tokens, to_point)

    def _preempt_request(self, request, timestamp) -> None:
        super()._preempt_request(request, timestamp)
        ev = self.evictions.get(request.request_id)
        if ev is not None:
            ev.reset()
            self.kv_cache_manager.set_removed(request.request_id, ev)

    def _update_after_schedule(self, scheduler_output) -> None:
        super()._update_after_schedule(scheduler_output)
        if self.refusal is None:
            self.kv_cache_manager.growth = None  # the running requests grow in the next step
        if not self.pending_swaps:
            return
        scheduled = scheduler_output.num_scheduled_tokens
        for req_id in list(self.pending_swaps):
            ev = self.evictions.get(req_id)
            if ev is None or not ev.swap_pending:  # finished or preempted since
                self.pending_swaps.discard(req_id)
            elif req_id in scheduled:
                self.kv_cache_manager.swap_to_compacted(req_id, ev)
                self.pending_swaps.discard(req_id)

    def update_from_output(self, scheduler_output, model_runner_output):
        latency = getattr(model_runner_output, LATENCY_ATTR, None) or {}
        for req_id, ms in latency.items():
            ev = self.evictions.get(req_id)
            if ev is not None:
                ev.latency_ms = (ev.latency_ms or 0.0) + ms
        trimmed = getattr(model_runner_output, TRIMMED_ATTR, None) or {}
        for req_id, used in trimmed.items():
            ev = self.evictions.get(req_id)
            if ev is not None and ev.compacted and ev.trimming is not None:  # else preempted or finished since
                self.kv_cache_manager.trim(req_id, ev, used)
        # reported once its prompt compactions' latency and block count are known, again after each decode one
        ready = [req_id for req_id in {**latency, **trimmed} if (ev := self.evictions.get(req_id)) is not None
                 and ev.done >= ev.schedule.prompt_points and ev.done > ev.reported and ev.latency_ms is not None
                 and ev.trimming is None]
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
                    report = self._report(ev, self.requests.get(output.request_id))
                    output.kv_transfer_params = {**(output.kv_transfer_params or {}), EXTRA_ARGS_KEY: report}
                    ev.reported = ev.done

    def _free_request(self, request, delay_free_blocks: bool = False):
        kv_xfer_params, ec_xfer_params = super()._free_request(request, delay_free_blocks)
        ev = self.evictions.pop(request.request_id, None)
        if ev is not None:
            self.kv_cache_manager.set_removed(request.request_id, None)
        if ev is not None and ev.compacted:
            kv_xfer_params = dict(kv_xfer_params or {})
            kv_xfer_params[EXTRA_ARGS_KEY] = self._report(ev, request)
        return kv_xfer_params, ec_xfer_params

    def _report(self, ev: SchedulerEviction, request) -> dict[str, Any]:
        config, spec, schedule = ev.request.config, ev.request, ev.schedule
        report = {"policy": config.policy, "allocation": config.allocation, "budget": config.budget,
                  "prompt_tokens": schedule.num_prompt_tokens}
        if ev.prompt_compacted:
            report.update({
                "evicted_prefix_tokens": ev.evict_at,
                "pages_per_head": ev.pages,
                # Average over layers and heads: every layer holds exactly P*H_kv pages; a head keeps whole
                # pages unless it keeps its whole prefix, so this is exact up to that partial last page.
                "kept_tokens_per_head": min(ev.pages * self.page_size, ev.evict_at),
                "blocks_before": ev.blocks_before,
                "blocks_after": ev.held_after_prompt,
                "blocks_freed": ev.blocks_before - ev.held_after_prompt,
                **({"chunk_size": ev.chunk, "compactions": min(ev.done, schedule.prompt_points),
                    "chunk_policy": schedule.chunk_config.policy, "chunk_budget": schedule.chunk_config.budget,
                    "chunk_pages_per_head": schedule.chunk_pages} if ev.chunk else {}),
            })
        if schedule.decode_every:
            report.update({
                "decode_budget": spec.decode_budget,
                "decode_every": schedule.decode_every,
                "decode_policy": schedule.decode_config.policy,
                "protect_prompt": spec.protect_prompt,
                "decode_compactions": ev.decode_compactions,
                "decode_evicted_tokens": ev.decode_evicted,
                "decode_blocks_freed": ev.decode_blocks_freed,
            })
            if request is not None:  # its physical length's blocks, now
                report["blocks_held"] = -(-(request.num_computed_tokens - ev.removed) // self.page_size)
        if ev.latency_ms is not None:
            report["latency_ms"] = round(ev.latency_ms, 3)
        # which data-parallel engine served it, when not the first (the metrics' `engine` label): vLLM keeps
        # the index there (a dense model's engines each run as data_parallel_size 1)
        engine = getattr(self.vllm_config.parallel_config, "data_parallel_index", 0)
        if engine:
            report["engine"] = engine
        return report


class EvictionScheduler(_EvictionSchedulerMixin, Scheduler):
    pass


class AsyncEvictionScheduler(_EvictionSchedulerMixin, AsyncScheduler):
    pass
