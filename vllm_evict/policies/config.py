"""EvictionConfig: one request's eviction parameters (DESIGN.md §6), validated.

Request form: SamplingParams.extra_args["vllm_evict"] = {"policy": ..., "budget": ..., ...} -> from_dict;
vLLM's vllm_xargs flat form: {"eviction_policy": ..., "eviction_budget": ..., "eviction_<option>": ...}
-> from_flat. policy "none" (or absent in the flat form) means no eviction: both return None.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from typing import Any, Mapping

from ._validate import check_gqa, check_int, check_pool_kernel, is_int, is_real
from .budget import ALLOCATIONS, check_budget, num_pages
from .caote import check_base
from .pooling import protected_count as _protected_count
from .registry import POLICIES, get_policy

FLAT_PREFIX = "eviction_"
_INT_RE = re.compile(r"^[+-]?\d+$")


@dataclass(frozen=True)
class EvictionConfig:
    """Validated eviction request. Construct with from_dict / from_flat (or directly; validated either way).

    Notes: for policy "streaming" the allocation is always uniform (DESIGN.md §3.4), so allocation is stored as
    "uniform" whatever was asked. window=0 is only allowed for key-only policies (keydiff, knorm, streaming).
    """

    policy: str
    budget: int | float | None  # None: no prompt eviction (a request with only a decode budget, DESIGN.md §4.8 c)
    allocation: str = "uniform"
    window: int | None = None
    pool_kernel: int | None = None
    sink: int | None = None
    gqa: str = "mean"
    alpha: float = 0.2
    caote_base: str = "snapkv"
    chunked: bool = False
    seed: int | None = None  # random policy (DESIGN.md §4.8 e); None: 0

    def __post_init__(self) -> None:
        get_policy(self.policy)
        if self.budget is not None:
            object.__setattr__(self, "budget", check_budget(self.budget))
        if self.allocation not in ALLOCATIONS:
            raise ValueError(f"allocation must be one of {ALLOCATIONS}, got {self.allocation!r}")
        check_base(self.caote_base)
        if self.window is not None:
            window = check_int("window", self.window, minimum=0)
            if window == 0 and self._effective().needs_queries:
                raise ValueError(f"window must be >= 1 for query-based policy {self.policy!r}, got {self.window!r}")
            object.__setattr__(self, "window", window)
        if self.pool_kernel is not None:
            object.__setattr__(self, "pool_kernel", check_pool_kernel(self.pool_kernel))
        if self.sink is not None:
            object.__setattr__(self, "sink", check_int("sink", self.sink, minimum=0))
        check_gqa(self.gqa)
        if not is_real(self.alpha) or not (0.0 <= float(self.alpha) <= 1.0):
            raise ValueError(f"alpha must be a number in [0, 1], got {self.alpha!r}")
        object.__setattr__(self, "alpha", float(self.alpha))
        if not isinstance(self.chunked, bool):
            raise ValueError(f"chunked must be a bool, got {self.chunked!r}")
        if self.seed is not None:
            object.__setattr__(self, "seed", check_int("seed", self.seed))
        if not POLICIES[self.policy].supports_adakv:
            object.__setattr__(self, "allocation", "uniform")

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_dict(cls, d: Mapping[str, Any], budget_required: bool = True) -> "EvictionConfig | None":
        """Validate a request dict (DESIGN.md §6). Returns None for policy "none" (no eviction).

        Raises ValueError naming the offending field and value: unknown policy or key, missing policy/budget
        (a request with a decode budget may omit it: budget_required=False), bad
        budget/allocation/window/pool_kernel/sink/gqa/alpha/caote_base/chunked/seed.
        """
        if not isinstance(d, Mapping):
            raise ValueError(f"eviction parameters must be a dict, got {d!r}")
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(k for k in d if k not in fields)
        if unknown:
            raise ValueError(f"unknown eviction parameter(s) {unknown}; known: {sorted(fields)}")
        if "policy" not in d:
            raise ValueError(f"eviction parameters need a 'policy', got {dict(d)!r}")
        if d["policy"] is None or d["policy"] == "none":
            return None
        if "budget" not in d and budget_required:
            raise ValueError(f"eviction parameters need a 'budget', got {dict(d)!r}")
        return cls(**{"budget": None, **d})

    @classmethod
    def flat_fields(cls, extra_args: Mapping[str, Any] | None) -> dict[str, Any]:
        """The fields of flat vllm_xargs keys eviction_policy / eviction_budget / eviction_allocation /
        eviction_<option>, typed: values may be strings ("0.1" -> 0.1, "2048" -> 2048, "true"/"1" -> True
        for chunked). Other keys (not starting with "eviction_") are ignored; unknown eviction_ keys raise."""
        flat = {k[len(FLAT_PREFIX):]: v for k, v in (extra_args or {}).items()
                if isinstance(k, str) and k.startswith(FLAT_PREFIX)}
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(FLAT_PREFIX + k for k in flat if k not in fields)
        if unknown:
            raise ValueError(f"unknown eviction parameter(s) {unknown}")
        d: dict[str, Any] = {}
        for key, value in flat.items():
            if key in ("budget", "alpha"):
                d[key] = parse_number(key, value)
            elif key in ("window", "pool_kernel", "sink", "seed"):
                d[key] = parse_int_field(key, value)
            elif key == "chunked":
                d[key] = parse_bool_field(key, value)
            else:
                d[key] = value
        return d

    @classmethod
    def from_flat(cls, extra_args: Mapping[str, Any] | None) -> "EvictionConfig | None":
        """The config of flat vllm_xargs keys (`flat_fields`); None if eviction_policy is absent or "none"."""
        d = cls.flat_fields(extra_args)
        if d.get("policy") in (None, "none"):
            return None
        return cls.from_dict(d)

    def to_dict(self) -> dict[str, Any]:
        """The request dict (from_dict(to_dict()) == self); unset optional overrides are omitted."""
        return {k: v for k, v in dataclasses.asdict(self).items() if v is not None}

    def to_flat(self) -> dict[str, Any]:
        """The flat vllm_xargs form (from_flat(to_flat()) == self)."""
        return {FLAT_PREFIX + k: v for k, v in self.to_dict().items()}

    # ------------------------------------------------------------------ derived values
    def _effective(self):
        if self.policy in ("caote", "fastcaote"):
            return get_policy(self.caote_base)
        return get_policy(self.policy)

    def needs_queries(self) -> bool:
        """Whether the engine must keep window queries (query-based policies, incl. caote/fastcaote)."""
        return self._effective().needs_queries

    def window_size(self) -> int:
        """w: the window override or the policy default (the base's for caote); 0 for key-only without window."""
        if self.window is not None:
            return self.window
        return self._effective().default_window

    def pool_kernel_size(self) -> int:
        if self.policy == "streaming":
            return 1
        return self.pool_kernel if self.pool_kernel is not None else self._effective().default_pool_kernel

    def sink_size(self) -> int:
        return self.sink if self.sink is not None else self._effective().default_sink

    def protected_count(self, n: int) -> int:
        """r of DESIGN.md §1 for a prompt of n tokens: |{0..sink-1} ∪ {n-w..n-1}| (clamped to n)."""
        return _protected_count(n, sink=self.sink_size(), window=self.window_size())

    def num_pages(self, n: int, page_size: int = 16) -> int | None:
        """P of DESIGN.md §3.2 (pages per KV head), or None when nothing is evicted (n <= P*bs, or no budget)."""
        if self.budget is None:
            return None
        return num_pages(n, self.budget, page_size, self.protected_count(n))

    def score_options(self) -> dict[str, Any]:
        """kwargs for score_tokens (besides scale, which the engine takes from the model)."""
        opts: dict[str, Any] = {"gqa": self.gqa}
        w = self.window_size()
        if w > 0 or self.window is not None:
            opts["window"] = w
        if self.pool_kernel is not None:
            opts["pool_kernel"] = self.pool_kernel
        if self.sink is not None:
            opts["sink"] = self.sink
        if self.policy in ("caote", "fastcaote"):
            opts["caote_base"] = self.caote_base
        return opts

    def select_options(self) -> dict[str, Any]:
        """kwargs for select_tokens / allocate_pages besides budget and page_size."""
        return {"allocation": self.allocation, "alpha": self.alpha}


def parse_number(key: str, value: Any) -> Any:
    if isinstance(value, str):
        s = value.strip()
        if _INT_RE.match(s):
            return int(s)
        try:
            return float(s)
        except ValueError:
            raise ValueError(f"{key} must be a number, got {value!r}") from None
    return value


def parse_int_field(key: str, value: Any) -> Any:
    """An integer field as a request may send it ("300", 300.0 -> 300); anything else is returned as is,
    for the field's own validation to reject."""
    value = parse_number(key, value)
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


def parse_bool_field(key: str, value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if is_int(value) and int(value) in (0, 1):
        return bool(int(value))
    if isinstance(value, str) and value.strip().lower() in ("true", "1", "yes", "false", "0", "no"):
        return value.strip().lower() in ("true", "1", "yes")
    raise ValueError(f"{key} must be a bool (true/false/1/0), got {value!r}")
