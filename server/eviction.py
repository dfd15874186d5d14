"""Per-request eviction settings and the `usage.eviction` block of responses.

Resolution of a request's `eviction` object:

* absent / null -> the server defaults (`--default-eviction-*`), or no eviction without defaults;
* an object -> keys it lacks are filled from the server defaults (policy, budget, allocation), so
  `{"budget": 0.2}` uses the default policy; `{"policy": "none"}` disables eviction;
* the merged dict is validated by the engine's own parser, `request_config.parse_request` (ValueError -> 400).
"""

from __future__ import annotations

import math
import numbers
from typing import Any

from vllm_evict.engine import EXTRA_ARGS_KEY


class EvictionFieldError(ValueError):
    """Invalid `eviction` field (becomes a 400 with `param="eviction"`)."""


def _eviction_config_cls():
    from vllm_evict.policies import EvictionConfig

    return EvictionConfig


def parse_budget(text: str) -> int | float:
    """CLI budget: "0.1" -> ratio 0.1, "2048" -> 2048 tokens."""
    s = str(text).strip()
    try:
        return int(s)
    except ValueError:
        pass
    try:
        return float(s)
    except ValueError:
        raise ValueError(f"budget must be a number (ratio like 0.1 or token count like 2048), got {text!r}")


def build_defaults(policy: str | None, budget: int | float | str | None, allocation: str | None
                   ) -> dict[str, Any]:
    """Server-wide default eviction fields from the CLI (only those given)."""
    d: dict[str, Any] = {}
    if policy is not None:
        d["policy"] = policy
    if budget is not None:
        d["budget"] = parse_budget(budget) if isinstance(budget, str) else budget
    if allocation is not None:
        d["allocation"] = allocation
    return d


def validate_defaults(defaults: dict[str, Any]) -> Any:
    """Check the CLI defaults once at startup (a full config, or fields to merge into requests)."""
    if not defaults:
        return None
    if "policy" not in defaults:
        return None  # budget / allocation only: requests must name the policy
    return _eviction_config_cls().from_dict(dict(defaults))


def resolve(request_eviction: Any, defaults: dict[str, Any]) -> Any:
    """The request's resolved eviction (WithEngineFields), or None for no eviction. Raises EvictionFieldError."""
    if request_eviction is None:
        if not defaults or "policy" not in defaults:
            return None
        merged = dict(defaults)
    elif isinstance(request_eviction, dict):
        merged = {**defaults, **request_eviction}
    else:  # pragma: no cover - the pydantic model already enforces an object
        raise EvictionFieldError(f"eviction must be an object, got {type(request_eviction).__name__}")
    if merged.get("policy") in ("none", None) and "policy" in merged:
        return None
    if "policy" not in merged:
        raise EvictionFieldError("eviction.policy is required (no server default policy is configured)")
    from vllm_evict.engine.request_config import EXTRA_ARGS_KEY as KEY, parse_request

    try:  # the engine's own parser: policy fields, evict_at / chunk_size and engine-level limits, validated once
        spec = parse_request({KEY: merged})
    except (ValueError, TypeError) as exc:
        raise EvictionFieldError(f"invalid eviction: {exc}") from exc
    if spec is None:
        return None
    return WithEngineFields(spec)


class WithEngineFields:
    """An EvictionConfig plus its request's engine-level fields (`evict_at`: compress only the first k
    prompt tokens; `chunk_size`: the chunk of block-wise eviction)."""

    def __init__(self, spec: Any) -> None:
        self.spec = spec

    def __getattr__(self, name: str) -> Any:
        return getattr(self.spec.config, name)

    def to_dict(self) -> dict[str, Any]:
        return self.spec.to_dict()


def to_extra_args(cfg: Any) -> dict[str, Any]:
    """`SamplingParams.extra_args` entry for a resolved config; None (no eviction) says so explicitly, so
    that no engine-level default applies to the request."""
    return {EXTRA_ARGS_KEY: cfg.to_dict() if cfg is not None else {"policy": "none"}}


def _jsonable(x: Any) -> Any:
    if hasattr(x, "tolist"):
        x = x.tolist()
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, bool) or x is None or isinstance(x, str):
        return x
    if isinstance(x, numbers.Integral):
        return int(x)
    if isinstance(x, numbers.Real):
        f = float(x)
        return f if math.isfinite(f) else None
    return str(x)


def _mean(x: Any) -> float | None:
    from vllm_evict.server.metrics import _num

    return _num(x)


def summarize_report(report: dict[str, Any]) -> dict[str, Any]:
    """One engine report plus derived `kept_tokens` (mean per layer/KV head) and `compression_ratio`."""
    out = _jsonable(dict(report))
    out["evicted"] = True
    kept = _mean(report.get("kept_tokens_per_head"))
    prompt = _mean(report.get("prompt_tokens"))
    if kept is not None:
        out["kept_tokens"] = round(kept, 3)
        if prompt:
            out["compression_ratio"] = round(kept / prompt, 6)
    if "blocks_freed" not in out:
        before, after = _mean(report.get("blocks_before")), _mean(report.get("blocks_after"))
        if before is not None and after is not None:
            out["blocks_freed"] = int(before - after)
    return out


def usage_block(cfg: Any, reports: list[dict[str, Any]], num_sequences: int = 1) -> dict[str, Any]:
    """`usage.eviction` of a response: what the engine reported; never invented numbers.

    * no eviction requested: `{"policy": "none", "evicted": false}`
    * requested, engine reported nothing: the requested settings and `"evicted": false`
    * one sequence: that report (`evicted: true`, `kept_tokens`, `compression_ratio`, `blocks_freed`...)
    * several sequences (n > 1 or several prompts): summed token / block counts, plus `sequences`
    """
    if cfg is None:
        return {"policy": "none", "evicted": False}
    requested = _jsonable(cfg.to_dict())
    if not reports:
        return {**requested, "evicted": False}
    summaries = [summarize_report(r) for r in reports]
    if len(summaries) == 1 and num_sequences == 1:
        return summaries[0]
    agg: dict[str, Any] = {k: requested[k] for k in ("policy", "allocation", "budget") if k in requested}
    agg["evicted"] = True
    agg["evicted_sequences"] = len(summaries)
    agg["num_sequences"] = num_sequences
    for key in ("prompt_tokens", "kept_tokens", "blocks_before", "blocks_after", "blocks_freed", "latency_ms",
                "decode_compactions", "decode_evicted_tokens", "decode_blocks_freed", "blocks_held"):
        vals = [s[key] for s in summaries if isinstance(s.get(key), (int, float)) and not isinstance(s[key], bool)]
        if vals:
            total = sum(vals)
            agg[key] = round(total, 3) if isinstance(total, float) else total
    if agg.get("prompt_tokens") and "kept_tokens" in agg:
        agg["compression_ratio"] = round(agg["kept_tokens"] / agg["prompt_tokens"], 6)
    agg["sequences"] = summaries
    return agg
