"""A request's eviction parameters as the API process resolves them and the engine reads them.

The API process resolves a request once (`resolve_request`, canonical nested form in
`extra_args["vllm_evict"]`). The scheduler parses it when the request arrives, derives the eviction point
E and the pages per head P once, and hands both to the workers with the request (`extra_args[PLAN_KEY]`),
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
# Written by the scheduler for the workers: [E, P] of a request that evicts (absent: it evicts nothing).
PLAN_KEY = "vllm_evict_plan"
# Engine-level default for requests that say nothing (e.g. `{"policy": "snapkv", "budget": 0.2}` as JSON).
DEFAULT_ENV = "VLLM_EVICT_DEFAULT"


@dataclass(frozen=True)
class RequestEviction:
    """What one request asked for. `evict_at` = tokens of the prompt prefix to compress (None = whole prompt):
    the rest of the prompt (e.g. a question) is prefilled after eviction and attends to the kept cache."""

    config: EvictionConfig
    evict_at: int | None = None

    def eviction_point(self, num_prompt_tokens: int) -> int:
        if self.evict_at is None:
            return num_prompt_tokens
        return min(self.evict_at, num_prompt_tokens)

    def to_dict(self) -> dict[str, Any]:
        """The nested request form (`_from_mapping(to_dict())` == self)."""
        d = self.config.to_dict()
        if self.evict_at is not None:
            d["evict_at"] = self.evict_at
        return d


def _from_mapping(spec: Mapping[str, Any]) -> RequestEviction | None:
    if not isinstance(spec, Mapping):
        raise ValueError(f"{EXTRA_ARGS_KEY} must be an object, got {type(spec).__name__}")
    spec = dict(spec)
    evict_at = spec.pop("evict_at", None)
    if evict_at is not None:
        evict_at = check_int("evict_at", evict_at, minimum=1)  # prompt tokens
    config = EvictionConfig.from_dict(spec)
    if config is not None and config.chunked:
        # SPEC §4.3's block-wise KeyDiff needs repeated eviction during prefill; the engine evicts once.
        raise ValueError("chunked=true (block-wise keydiff) is not supported by the engine yet; "
                         "use chunked=false (one-shot keydiff at the end of the prompt)")
    return None if config is None else RequestEviction(config, evict_at)


def flat_request(extra_args: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """The eviction object given as flat `eviction_*` keys (values typed, `eviction_evict_at` included),
    or None when there are none. The fields may be partial (the OpenAI server merges its defaults)."""
    flat = dict(extra_args or {})
    if not any(str(k).startswith("eviction_") for k in flat):
        return None
    evict_at = flat.pop("eviction_evict_at", None)
    fields = EvictionConfig.flat_fields(flat)
    if evict_at is not None:  # typed like the config's integer fields; _from_mapping validates it
        fields["evict_at"] = parse_int_field("evict_at", evict_at)
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
