"""A worker's state of one evicting request: its compaction schedule, where its kept pages are, and the
host copies it reads without a device sync."""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field

import torch

from vllm_evict.engine.compaction import LayerLayouts
from vllm_evict.engine.request_config import CompactionSchedule, FollowsSchedule, RequestEviction
from vllm_evict.engine.window_store import WindowStore

_SERIALS = itertools.count()


@dataclass
class WorkerEviction(FollowsSchedule):
    req_id: str
    spec: RequestEviction
    schedule: CompactionSchedule         # the request's compaction points (the scheduler walks the same)
    page_size: int
    blocks: int = 0                     # F: fresh blocks a one-shot compaction writes (scheduler.plan_eviction)
    spread: int = 1                     # H_kv / H for Ada-KV under TP (scheduler.SchedulerEviction.spread)
    q_window: torch.Tensor | None = None  # [L, w, Hq, D] by layer index (its WindowStore rows), set to compact
    window: int = 0                     # w (read once: the policy's default or the request's override)
    window_offset: int = -1             # its rows in the worker's WindowStore (-1: none)
    layers: LayerLayouts = field(default_factory=LayerLayouts)  # filled during the compaction step
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
    # tokens written up to which a step has nothing to record or compact: its next point less its window
    # (build_plan's test for every evicting row, every step)
    quiet_until: float = field(init=False, default=math.inf)

    def __post_init__(self) -> None:
        self.blocks = self.blocks or (self.pages or 0)
        self.uniform = self.spec.config.allocation == "uniform"
        self._watch_next_point()

    def _watch_next_point(self) -> None:
        point = self.point
        self.quiet_until = math.inf if point is None else point.at - max(self.window, 1)

    @property
    def deferred(self) -> bool:
        """Ada-KV under TP: its layout spans the F' blocks the fullest rank fills of those it writes, known
        once every layer is selected (compaction.py)."""
        if self.point.in_place:
            return self.schedule.written_blocks(self.done, self.spread)[1]
        return self.blocks > self.pages

    @property
    def written_blocks(self) -> int:
        """Blocks its next compaction writes: F fresh ones, or in place the first ones (written_blocks)."""
        if self.point.in_place:
            return self.schedule.written_blocks(self.done, self.spread)[0]
        return self.blocks

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
        if point.in_place:  # its layout now spans the blocks it wrote (F' of them once trimmed: set already)
            written, trims = self.schedule.written_blocks(self.done, self.spread)
            if trims:
                self.shift = point.at - self.blocks * self.page_size
            else:
                self.blocks = written
                self.shift = point.at - self.schedule.held_after(self.done, self.spread)
        else:
            self.shift = point.at - self.blocks * self.page_size
        if point.evicts and not self.stock_layout:  # a new per-head layout (stacked by `kept_most`): new tables
            self.serial = next(_SERIALS)
        self.done += 1
        self._watch_next_point()
        self.q_window, self.fullest_offset = None, None  # last_at moved
        following = self.point
        step = self.window if following is None else following.at - point.at
        if step < self.window and windows is not None and self.window_offset >= 0:
            windows.shift(self.window_offset, self.window, step)

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
        return self.failed or self.uniform or not self.layers


def kept_most(states: list) -> None:
    """After a compaction of requests into per-head layout: stack each one's page counts for the tables, and
    copy the most tokens a head of each kept to the host (the next point gathers up to that head), one copy
    for all of them."""
    from vllm_evict.engine.per_head import stacked_counts

    for state in states:
        state.stacked = None
    device = next(iter(states[0].layers.values())).kept.device
    kept = torch.stack([stacked_counts(state, device)[1] for state in states])              # [R, L, H]
    for state, most in zip(states, HostCopy(kept.flatten(1).amax(dim=1)).items()):
        state.most_kept, state.fullest_offset = most, None


class HostCopy:
    """A device tensor copied to the host without a stream sync; `read` waits for that copy only."""

    def __init__(self, value: torch.Tensor):
        self.event = None
        if value.device.type != "cuda":
            self.host = value
            return
        self.host = torch.empty(value.shape, dtype=value.dtype, pin_memory=True)
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

    def items(self) -> list["HostCopy"]:
        """A HostCopy of each element of a copied vector, all waiting on its one copy."""
        elements = []
        for host in self.host.unbind():
            element = HostCopy.__new__(HostCopy)
            element.host, element.event = host, self.event
            elements.append(element)
        return elements
