"""A request's eviction parameters as the API process resolves them and the engine reads them.

The API process resolves a request once (`resolve_request`, canonical nested form in
`extra_args["vllm_evict"]`). The scheduler parses it when the request arrives, derives the eviction point
E, the pages per head P and the fresh blocks F once, and hands them to the workers with the request (`extra_args[PLAN_KEY]`),
so the workers never derive them again and the scheduler never waits for a report from a worker.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Mapping

from vllm_evict.policies import EvictionConfig
from vllm_evict.policies._validate import check_int
from vllm_evict.policies.config import parse_int_field

EXTRA_ARGS_KEY = "vllm_evict"
# Written by the scheduler for the workers: [E, P, C, F] of a request that evicts (absent: it evicts nothing);
# C = 0 for one-shot eviction at E, else the chunk of block-wise eviction in tokens (whole pages); F: the
# fresh blocks it holds once compacted (scheduler.plan_eviction).
PLAN_KEY = "vllm_evict_plan"
DEFAULT_CHUNK_SIZE = 128  # SPEC §4.3: the paper's block size
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
    `chunk_size` (only with chunked=true, SPEC §4.3): prompt tokens per chunk of block-wise eviction."""

    config: EvictionConfig
    evict_at: int | None = None
    chunk_size: int | None = None

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
        return d


def eviction_points(evict_at: int, pages: int, page_size: int, chunk: int) -> list[int]:
    """The prompt positions at which a request compacts, in order; the last is E.

    One-shot (chunk 0): [E]. Block-wise (SPEC §4.3): the prompt runs in chunks of `chunk` tokens, and a
    chunk end at which the request holds more than P pages compacts it back to P pages: the first chunk
    end past P*page_size, every chunk end after it (P pages plus a chunk), and E."""
    if not chunk:
        return [evict_at]
    first = (pages * page_size // chunk + 1) * chunk
    return [*range(first, evict_at, chunk), evict_at]


def _from_mapping(spec: Mapping[str, Any]) -> RequestEviction | None:
    if not isinstance(spec, Mapping):
        raise ValueError(f"{EXTRA_ARGS_KEY} must be an object, got {type(spec).__name__}")
    spec = dict(spec)
    evict_at = spec.pop("evict_at", None)
    if evict_at is not None:
        evict_at = check_int("evict_at", evict_at, minimum=1)  # prompt tokens
    chunk_size = spec.pop("chunk_size", None)
    if chunk_size is not None:
        chunk_size = check_int("chunk_size", chunk_size, minimum=1)
        if chunk_size > MAX_CHUNK_SIZE:
            raise ValueError(f"chunk_size must be at most {MAX_CHUNK_SIZE}, got {chunk_size}")
    config = EvictionConfig.from_dict(spec)
    if config is None:
        return None
    if chunk_size is not None and not config.chunked:
        raise ValueError(f"chunk_size={chunk_size} needs chunked=true (block-wise keydiff)")
    if config.chunked and evict_at is not None:
        raise ValueError("chunked=true evicts block-wise over the whole prompt; it cannot be combined with "
                         f"evict_at={evict_at}")
    return RequestEviction(config, evict_at, chunk_size)


def flat_request(extra_args: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """The eviction object given as flat `eviction_*` keys (values typed, `eviction_evict_at` included),
    or None when there are none. The fields may be partial (the OpenAI server merges its defaults)."""
    flat = dict(extra_args or {})
    if not any(str(k).startswith("eviction_") for k in flat):
        return None
    engine_fields = {name: flat.pop("eviction_" + name) for name in ("evict_at", "chunk_size")
                     if "eviction_" + name in flat}
    fields = EvictionConfig.flat_fields(flat)
    for name, value in engine_fields.items():  # typed like the config's integer fields; _from_mapping validates
        fields[name] = parse_int_field(name, value)
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
