"""A request's eviction parameters as the API process resolves them and the engine reads them, and the
compaction points they give (DESIGN.md §4.8).

The API process resolves a request once (`resolve_request`, canonical nested form in
`extra_args["vllm_evict"]`). The scheduler parses it when the request arrives, derives the eviction point
E, the pages per head P and the fresh blocks F once, and hands them to the workers with the request
(`extra_args[PLAN_KEY]`). Both then walk the same `CompactionSchedule`: where the request compacts, how
many tokens each head holds there and after it, so the scheduler never waits for a report from a worker.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Any, Mapping

from vllm_evict.policies import EvictionConfig, check_budget, get_policy
from vllm_evict.policies._validate import check_int
from vllm_evict.policies.config import parse_bool_field, parse_int_field, parse_number

EXTRA_ARGS_KEY = "vllm_evict"
# Written by the scheduler for the workers: [E, P, C, F, n] of a request that evicts (absent: it evicts
# nothing); P = 0 without prompt eviction (a decode budget only); C = 0 for one-shot eviction at E, else the
# chunk of block-wise eviction in tokens (whole pages); F: the fresh blocks a one-shot compaction writes
# (scheduler.plan_eviction); n: the prompt length.
PLAN_KEY = "vllm_evict_plan"
DEFAULT_CHUNK_SIZE = 128  # DESIGN.md §4.3: the paper's block size
DEFAULT_DECODE_EVERY = 128  # DESIGN.md §4.8 c
# Block-wise cuts before the last (DESIGN.md §4.8 b): at this multiple of the budget, by a question-agnostic policy
# (a key-only request policy is one already, and scores them itself). KeyDiff kept the needles best of those
# measured in that role (docs/QUALITY.md).
DEFAULT_CHUNK_POLICY = "keydiff"
DEFAULT_CHUNK_BUDGET_FACTOR = 4
MAX_CHUNK_SIZE = 1 << 20
# Engine-level default for requests that say nothing (e.g. `{"policy": "snapkv", "budget": 0.2}` as JSON).
DEFAULT_ENV = "VLLM_EVICT_DEFAULT"
# Set (to 1) by `vllm-evict serve --allow-long-prompts`: --max-model-len may exceed the KV cache (plugin.py).
LONG_PROMPTS_ENV = "VLLM_EVICT_ALLOW_LONG_PROMPTS"


def long_prompts_allowed() -> bool:
    return os.environ.get(LONG_PROMPTS_ENV, "") not in ("", "0")


@dataclass(frozen=True)
class RequestEviction:
    """What one request asked for. `evict_at` = tokens of the prompt prefix to compress (None = whole prompt):
    the rest of the prompt (e.g. a question) is prefilled after eviction and attends to the kept cache.
    `chunk_size` (only with chunked=true, DESIGN.md §4.3): prompt tokens per chunk of block-wise eviction.
    `chunk_budget`, `chunk_policy` (only with chunked=true, DESIGN.md §4.8 b): the budget and policy of the
    cuts before the last one (defaults: DEFAULT_CHUNK_BUDGET, DEFAULT_CHUNK_POLICY); the cut at the end of
    the prompt applies the request's own policy and budget.
    `decode_budget` K_d, `decode_every` C_d, `protect_prompt` (DESIGN.md §4.8 c): evict again while decoding;
    `decode_policy` (only with decode_budget): the policy of the decode points (default: the request's)."""

    config: EvictionConfig
    evict_at: int | None = None
    chunk_size: int | None = None
    decode_budget: int | None = None
    decode_every: int | None = None
    protect_prompt: bool = False
    chunk_budget: int | float | None = None
    chunk_policy: str | None = None
    decode_policy: str | None = None

    def chunk_config(self) -> EvictionConfig:
        """The config of block-wise cuts before the last (DESIGN.md §4.8 b): the request's, with the chunk
        policy and budget; its window is the request's (the same window queries score both)."""
        budget = self.chunk_budget if self.chunk_budget is not None else default_chunk_budget(self.config.budget)
        policy = self.chunk_policy or (DEFAULT_CHUNK_POLICY if self.config.needs_queries() else self.config.policy)
        return self._with_policy("chunk_policy", policy, budget=budget)

    def decode_config(self) -> EvictionConfig:
        """The config of the decode points (DESIGN.md §4.8 c): the request's, with its decode policy."""
        if self.decode_policy is None:
            return self.config
        config = self._with_policy("decode_policy", self.decode_policy)
        if config.allocation != self.config.allocation:  # a decode point's geometry follows its allocation
            raise ValueError(f"decode_policy {self.decode_policy!r} has no allocation {self.config.allocation!r} "
                             "(the request's): use allocation 'uniform' or another decode_policy")
        return config

    def _with_policy(self, field: str, policy: str, **changes) -> EvictionConfig:
        """The request's config scored by `policy` instead, with the request's window (the same window queries
        score every point)."""
        window = self.config.window_size()
        if get_policy(policy).needs_queries and not window:
            raise ValueError(f"{field} {policy!r} reads window queries, and policy {self.config.policy!r} "
                             "keeps none: give the request a window (e.g. window=32)")
        return dataclasses.replace(self.config, policy=policy, **changes,
                                   window=window if window or self.config.window is not None else None)

    def decode_tokens(self, page_size: int) -> int:
        """C_d rounded up to whole pages; 0 without a decode budget."""
        if self.decode_budget is None:
            return 0
        return -(-(self.decode_every or DEFAULT_DECODE_EVERY) // page_size) * page_size

    def check_page_size(self, page_size: int) -> None:
        """The checks that need the engine's page size (DESIGN.md §6: decode_budget >= bs)."""
        if self.decode_budget is not None and self.decode_budget < page_size:
            raise ValueError(f"decode_budget must be at least the page size ({page_size} tokens), "
                             f"got {self.decode_budget}")

    def eviction_point(self, num_prompt_tokens: int) -> int:
        if self.evict_at is None:
            return num_prompt_tokens
        return min(self.evict_at, num_prompt_tokens)

    def chunk_tokens(self, page_size: int) -> int:
        """The chunk of block-wise eviction rounded up to whole pages; 0 for one-shot eviction."""
        if not self.config.chunked:
            return 0
        return -(-(self.chunk_size or DEFAULT_CHUNK_SIZE) // page_size) * page_size

    def to_dict(self) -> dict[str, Any]:
        """The nested request form (`_from_mapping(to_dict())` == self)."""
        d = self.config.to_dict()
        if self.evict_at is not None:
            d["evict_at"] = self.evict_at
        if self.chunk_size is not None:
            d["chunk_size"] = self.chunk_size
        if self.decode_budget is not None:
            d["decode_budget"] = self.decode_budget
        if self.decode_every is not None:
            d["decode_every"] = self.decode_every
        if self.protect_prompt:
            d["protect_prompt"] = True
        if self.chunk_budget is not None:
            d["chunk_budget"] = self.chunk_budget
        if self.chunk_policy is not None:
            d["chunk_policy"] = self.chunk_policy
        if self.decode_policy is not None:
            d["decode_policy"] = self.decode_policy
        return d


def default_chunk_budget(budget: int | float) -> int | float:
    """The budget of block-wise cuts before the last, unless the request names one (DESIGN.md §4.8 b)."""
    return min(1.0, DEFAULT_CHUNK_BUDGET_FACTOR * budget) if isinstance(budget, float) else \
        DEFAULT_CHUNK_BUDGET_FACTOR * budget


def eviction_points(evict_at: int, pages: int, page_size: int, chunk: int) -> list[int]:
    """The prompt positions at which a request compacts, in order; the last is E.

    One-shot (chunk 0): [E]. Block-wise (DESIGN.md §4.3): the prompt runs in chunks of `chunk` tokens, and a
    chunk end at which the request holds more than P pages compacts it back to P pages: the first chunk
    end past P*page_size, every chunk end after it (P pages plus a chunk), and E."""
    if not chunk:
        return [evict_at]
    first = (pages * page_size // chunk + 1) * chunk
    return [*range(first, evict_at, chunk), evict_at]


@dataclass(frozen=True)
class Point:
    """One compaction point of a request (DESIGN.md §4.8 d). Counts are per head under uniform allocation; under
    Ada-KV they are the averages the blocks follow (each head holds its own number, compaction.py), and
    `kept` is whole pages, since the per-head layout fills whole blocks."""

    index: int          # c: the request's compaction index
    at: int             # tokens written when it runs (right after the forward that writes token at-1)
    held: int           # tokens each head holds there
    kept: int           # tokens each head holds after it (== held: it evicts nothing)
    fixed: int          # leading held tokens that are not candidates (protect_prompt at a decode point)
    pages: int          # budget pages per head of the candidates: P (prompt points) or P_d (decode points)
    window: int         # protected last candidates (query-based: their queries score), w clamped to them
    sink: int           # protected first candidates each head holds (DESIGN.md §4.8 a)
    decode: bool
    in_place: bool      # written into the request's own first blocks (else into F fresh ones: one-shot)
    config: EvictionConfig  # what scores and selects there: the request's, or its chunk config (block-wise cuts
                            # before the last)

    @property
    def evicts(self) -> bool:
        return self.kept < self.held


class CompactionSchedule:
    """Where a request compacts and what each head holds (DESIGN.md §4.8): prompt points (one-shot at E, or
    block-wise), then a decode point every C_d generated tokens (none without a decode budget). The
    scheduler and the workers walk the same schedule; `point(c)` extends it lazily (decode points never end)."""

    def __init__(self, spec: RequestEviction, num_prompt_tokens: int, page_size: int):
        self.spec, self.page_size, self.num_prompt_tokens = spec, page_size, num_prompt_tokens
        config = spec.config
        self.evict_at = spec.eviction_point(num_prompt_tokens)
        self.pages = config.num_pages(self.evict_at, page_size)  # P, None: the prompt is not evicted
        self.chunk = spec.chunk_tokens(page_size) if self.pages else 0
        self.decode_every = spec.decode_tokens(page_size)
        self.decode_config = spec.decode_config()
        # block-wise cuts before the last keep P_c >= P pages, scored by the chunk config (DESIGN.md §4.8 b)
        self.chunk_config = chunk_config = spec.chunk_config() if self.chunk else config
        chunk_pages = chunk_config.num_pages(self.evict_at, page_size)  # None: those cuts would keep everything
        self.chunk_pages = -(-self.evict_at // page_size) if chunk_pages is None else max(chunk_pages, self.pages or 0)
        prompt_points = eviction_points(self.evict_at, self.chunk_pages, page_size, self.chunk) if self.pages else []
        self._points: list[Point] = []
        held = at = 0
        for index, point in enumerate(prompt_points):
            held += point - at
            at = point
            final = point == self.evict_at
            point_config, pages = (config, self.pages) if final else (chunk_config, self.chunk_pages)
            self._points.append(Point(index, point, held, pages * page_size, 0, pages,
                                      min(point_config.window_size(), held), point_config.sink_size(),
                                      decode=False, in_place=self.chunk > 0, config=point_config))
            held = pages * page_size
        self.prompt_points = len(self._points)
        # tokens each head holds of the prompt once it is prefilled (the candidates exclude them under protect_prompt)
        self.prompt_held = held + num_prompt_tokens - at

    @property
    def evicts(self) -> bool:
        return bool(self.prompt_points or self.decode_every)

    def point(self, index: int) -> Point | None:
        """Point c, or None past the last (never with a decode budget)."""
        while len(self._points) <= index:
            if not self.decode_every:
                return None
            self._points.append(self._decode_point(len(self._points)))
        return self._points[index]

    def _decode_point(self, index: int) -> Point:
        k = index - self.prompt_points + 1
        at = self.num_prompt_tokens + k * self.decode_every
        if index:
            prev = self._points[index - 1]
            held = prev.kept + at - prev.at
        else:
            held = at
        config, bs = self.decode_config, self.page_size
        fixed = self.prompt_held if self.spec.protect_prompt else 0
        candidates = held - fixed
        # sink: the first candidates each head holds; under protect_prompt those whose original position is
        # below it (generated tokens start at position n)
        sink = max(0, config.sink_size() - self.num_prompt_tokens) if fixed else config.sink_size()
        window = min(config.window_size(), candidates)
        protected = min(candidates, min(sink, candidates) + window)
        pages = max(-(-self.spec.decode_budget // bs), -(-max(protected, 1) // bs))  # P_d
        if -(-candidates // bs) <= pages:
            kept = held
        elif config.allocation == "adakv":  # the held prompt's pages, then P_d pages per head on average
            kept = -(-fixed // bs) * bs + pages * bs
        else:
            kept = fixed + pages * bs
        return Point(index, at, held, kept, fixed, pages, window, sink, decode=True, in_place=True, config=config)

    def written_blocks(self, index: int, spread: int = 1) -> tuple[int, bool]:
        """Blocks in-place point `index` writes its kept pages into, and whether its layout may end short of
        them. spread: H_kv / H for Ada-KV under tensor parallelism (scheduler.kv_head_groups), else 1.

        The kept pages fill ceil(kept / page) blocks, except under spread: one rank's heads may win up to
        spread times their share, and no head more than it holds, so the point writes over
        min(spread * ceil(kept / page), ceil(held / page)) blocks, which the request holds there. The layout
        then spans the F' of them the fullest rank fills and the rest are freed once the workers report F'
        (trimmed), unless another prompt point may follow in the next step, before that report arrives:
        then it spans them all (compaction.py)."""
        point, bs = self.point(index), self.page_size
        kept = -(-point.kept // bs)
        if spread == 1:
            return kept, False
        written = min(spread * kept, -(-point.held // bs))
        following = self.point(index + 1)
        return written, written > kept and (following is None or following.decode)

    def held_after(self, index: int, spread: int = 1) -> int:
        """Tokens per head in-place point `index` leaves the request holding physically, before any trim: its
        kept tokens, or the blocks it wrote over where they are more (written_blocks)."""
        point, bs = self.point(index), self.page_size
        written = self.written_blocks(index, spread)[0]
        return point.kept if written == -(-point.kept // bs) else written * bs

    def peak_blocks(self, num_tokens: int, fresh_blocks: int, spread: int = 1) -> int:
        """The most blocks the request holds when it runs alone to `num_tokens` (prompt + max_tokens): at each
        point before it compacts (a one-shot point also holds its F fresh blocks there), and at the end. Under
        spread (written_blocks) it counts the blocks a point writes, before any are trimmed."""
        bs, peak, at, physical = self.page_size, 0, 0, 0
        index = 0
        while (point := self.point(index)) is not None and point.at < num_tokens:
            peak = max(peak, -(-(physical + point.at - at) // bs) + (0 if point.in_place else fresh_blocks))
            at = point.at
            physical = self.held_after(index, spread) if point.in_place else fresh_blocks * bs
            index += 1
        return max(peak, -(-(physical + num_tokens - at) // bs))


class FollowsSchedule:
    """What the scheduler's and a worker's view of a request read off its CompactionSchedule, given the
    number of points `done` (both define `schedule` and `done`)."""

    schedule: CompactionSchedule
    done: int

    @property
    def pages(self) -> int | None:
        return self.schedule.pages

    @property
    def evict_at(self) -> int:
        return self.schedule.evict_at

    @property
    def chunk(self) -> int:
        return self.schedule.chunk

    @property
    def point(self) -> Point | None:
        """The next compaction point, None past the last."""
        return self.schedule.point(self.done)

    @property
    def next_point(self) -> int | None:
        point = self.point
        return None if point is None else point.at

    @property
    def compacted(self) -> bool:
        return self.done > 0


# Request fields the engine reads besides the policy's (EvictionConfig)
ENGINE_FIELDS = ("evict_at", "chunk_size", "chunk_budget", "chunk_policy", "decode_budget", "decode_every",
                 "decode_policy", "protect_prompt")


def _token_count(spec: dict, name: str) -> int | None:
    """Pop an optional token count in [1, MAX_CHUNK_SIZE] (chunk_size, decode_every)."""
    value = spec.pop(name, None)
    if value is None:
        return None
    value = check_int(name, value, minimum=1)
    if value > MAX_CHUNK_SIZE:
        raise ValueError(f"{name} must be at most {MAX_CHUNK_SIZE}, got {value}")
    return value


def _from_mapping(spec: Mapping[str, Any]) -> RequestEviction | None:
    if not isinstance(spec, Mapping):
        raise ValueError(f"{EXTRA_ARGS_KEY} must be an object, got {type(spec).__name__}")
    spec = dict(spec)
    evict_at = spec.pop("evict_at", None)
    if evict_at is not None:
        evict_at = check_int("evict_at", evict_at, minimum=1)  # prompt tokens
    chunk_size = _token_count(spec, "chunk_size")
    decode_budget = spec.pop("decode_budget", None)
    if decode_budget is not None:
        decode_budget = check_int("decode_budget", decode_budget, minimum=1)  # >= page size: check_page_size
    decode_every = _token_count(spec, "decode_every")
    chunk_budget = spec.pop("chunk_budget", None)
    if chunk_budget is not None:
        chunk_budget = check_budget(chunk_budget)
    chunk_policy = spec.pop("chunk_policy", None)
    if chunk_policy is not None:
        get_policy(chunk_policy)
    decode_policy = spec.pop("decode_policy", None)
    if decode_policy is not None:
        get_policy(decode_policy)
    protect_prompt = spec.pop("protect_prompt", False)
    if not isinstance(protect_prompt, bool):
        raise ValueError(f"protect_prompt must be a bool, got {protect_prompt!r}")
    config = EvictionConfig.from_dict(spec, budget_required=decode_budget is None)
    if config is None:
        return None
    if decode_budget is None and (decode_every is not None or protect_prompt or decode_policy is not None):
        raise ValueError("decode_every, decode_policy and protect_prompt need a decode_budget")
    if protect_prompt and config.allocation == "adakv" and config.budget is not None:
        # an Ada-KV prompt eviction leaves every head a different number of prompt tokens to protect
        raise ValueError("protect_prompt with allocation 'adakv' needs the prompt unevicted in this version "
                         "(omit budget, or use allocation 'uniform')")
    for name, value in (("chunk_size", chunk_size), ("chunk_budget", chunk_budget), ("chunk_policy", chunk_policy)):
        if value is not None and not config.chunked:
            raise ValueError(f"{name}={value!r} needs chunked=true (block-wise eviction)")
    if chunk_budget is not None and type(chunk_budget) is type(config.budget) and chunk_budget < config.budget:
        raise ValueError(f"chunk_budget={chunk_budget!r} must be at least budget={config.budget!r}: it bounds the "
                         "cuts before the last one")
    if config.chunked and evict_at is not None:
        raise ValueError("chunked=true evicts block-wise over the whole prompt; it cannot be combined with "
                         f"evict_at={evict_at}")
    spec = RequestEviction(config, evict_at, chunk_size, decode_budget, decode_every, protect_prompt, chunk_budget,
                           chunk_policy, decode_policy)
    if config.chunked and config.budget is not None:
        spec.chunk_config()  # validated here, not at the request's first cut
    spec.decode_config()
    return spec


def flat_request(extra_args: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """The eviction object given as flat `eviction_*` keys (values typed, `eviction_evict_at` included),
    or None when there are none. The fields may be partial (the OpenAI server merges its defaults)."""
    flat = dict(extra_args or {})
    if not any(str(k).startswith("eviction_") for k in flat):
        return None
    engine_fields = {name: flat.pop("eviction_" + name) for name in ENGINE_FIELDS if "eviction_" + name in flat}
    fields = EvictionConfig.flat_fields(flat)
    for name, value in engine_fields.items():  # typed like the config's fields; _from_mapping validates
        if name == "protect_prompt":
            fields[name] = parse_bool_field(name, value)
        elif name == "chunk_budget":
            fields[name] = parse_number(name, value)
        else:
            fields[name] = value if name in ("chunk_policy", "decode_policy") else parse_int_field(name, value)
    return fields


def parse_request(extra_args: Mapping[str, Any] | None) -> RequestEviction | None:
    """Eviction requested by `SamplingParams.extra_args` (nested or flat `eviction_*` keys), else the
    engine default from $VLLM_EVICT_DEFAULT, else None. Raises ValueError naming the bad field."""
    extra_args = extra_args or {}
    if EXTRA_ARGS_KEY in extra_args:
        return _from_mapping(extra_args[EXTRA_ARGS_KEY])
    flat = flat_request(extra_args)
    if flat is not None:
        return None if flat.get("policy") in (None, "none") else _from_mapping(flat)
    default = os.environ.get(DEFAULT_ENV)
    if default:
        import json

        return _from_mapping(json.loads(default))
    return None


def resolve_request(extra_args: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """The API process's one resolution of a request's eviction: `extra_args` with the eviction (nested or
    flat keys, else $VLLM_EVICT_DEFAULT) replaced by its canonical nested form, `{"policy": "none"}` when it
    evicts nothing. The engine core and the workers then read exactly this, never the environment.
    Returns extra_args unchanged when there is nothing to resolve; raises ValueError naming the bad field."""
    spec = parse_request(extra_args)
    if spec is None and not extra_args and not os.environ.get(DEFAULT_ENV):
        return extra_args  # a plain request with no default: nothing the engine could read differently
    out = {k: v for k, v in (extra_args or {}).items() if not str(k).startswith("eviction_") and k != EXTRA_ARGS_KEY}
    out[EXTRA_ARGS_KEY] = {"policy": "none"} if spec is None else spec.to_dict()
    return out
