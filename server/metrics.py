"""Prometheus metrics of vllm-evict (`vllm_evict:*`), served on vLLM's own `/metrics`.

`vllm serve` (vllm.entrypoints.openai.api_server) mounts `prometheus_client.make_asgi_app` on `/metrics`
for the registry `vllm.v1.metrics.prometheus.get_prometheus_registry()` returns: the process-global
`prometheus_client.REGISTRY` when `PROMETHEUS_MULTIPROC_DIR` is unset, which is the case with one API
server process (`--api-server-count 1`). So every `vllm_evict:*` metric object lives in that global
registry, created once per process (`get_metrics()`), and shows up on `/metrics` next to vLLM's `vllm:*`
families and the HTTP instrumentator's `http_*` ones.

Two feeds:

* `EvictStatLogger`, a vLLM `StatLoggerBase` registered under the entry-point group
  `vllm.stat_logger_plugins` (pyproject.toml). vLLM's `AsyncLLM` loads it in the API process and calls
  `record()` from its output handler every engine step with `SchedulerStats` (KV-cache usage, running /
  waiting requests) and `IterationStats` (prompt / generated tokens, TTFT, finished requests' time per
  output token).
* `observe_eviction(report, policy)`, called in the API process with the engine's eviction report of
  every finished request (evictions, prompt vs kept tokens, compression ratio, blocks freed, scoring +
  compaction latency).

With more than one API server process vLLM switches prometheus_client to multiprocess mode (it sets
`PROMETHEUS_MULTIPROC_DIR` and serves a `MultiProcessCollector` registry that never reads the global
one), the eviction reports of a request land in whichever API process served it, and the derived
gauges (sliding-window throughput, batch capacity) cannot be merged across processes; so
`EvictStatLogger` refuses to start there.

HTTP-level counts are vLLM's: `vllm:request_success_total{finished_reason}` and the instrumentator's
`http_requests_total{handler,method,status}`.
"""

from __future__ import annotations

import math
import os
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily

if TYPE_CHECKING:  # the real class is built lazily (importing vLLM takes seconds): see __getattr__ below
    from vllm.v1.metrics.loggers import StatLoggerBase as EvictStatLogger  # noqa: F401

PREFIX = "vllm_evict:"
STAT_LOGGER_GROUP = "vllm.stat_logger_plugins"  # vllm.plugins.STAT_LOGGER_PLUGINS_GROUP
MULTIPROC_ENV = ("PROMETHEUS_MULTIPROC_DIR", "prometheus_multiproc_dir")  # prometheus_client.values

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
                5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
RATIO_BUCKETS = (0.01, 0.02, 0.05, 0.1, 0.15, 0.2, 0.25, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 1.0)
LATENCY_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
                   2.5, 5.0, 10.0)

# public list (docs, dashboard tests): every metric family this module exports, without the _total /
# _bucket / _sum / _count / _created suffixes
METRIC_NAMES = (
    "vllm_evict:kv_cache_blocks",
    "vllm_evict:kv_cache_used_blocks",
    "vllm_evict:kv_cache_free_blocks",
    "vllm_evict:kv_cache_usage_ratio",
    "vllm_evict:avg_sequence_blocks",
    "vllm_evict:batch_capacity_sequences",
    "vllm_evict:num_requests_running",
    "vllm_evict:num_requests_waiting",
    "vllm_evict:prompt_tokens",                # counter -> vllm_evict:prompt_tokens_total
    "vllm_evict:generation_tokens",            # counter -> vllm_evict:generation_tokens_total
    "vllm_evict:decode_throughput_tokens_per_second",
    "vllm_evict:time_to_first_token_seconds",
    "vllm_evict:time_per_output_token_seconds",
    "vllm_evict:evictions",                    # counter -> vllm_evict:evictions_total{policy}
    "vllm_evict:eviction_prompt_tokens",       # counter -> ..._total{policy}
    "vllm_evict:eviction_kept_tokens",         # counter -> ..._total{policy}
    "vllm_evict:eviction_blocks_freed",        # counter -> ..._total{policy}
    "vllm_evict:eviction_compression_ratio",   # histogram{policy}: kept / prompt tokens
    "vllm_evict:eviction_latency_seconds",     # histogram{policy}: scoring + compaction
    "vllm_evict:decode_compactions",           # counter -> ..._total{policy}
    "vllm_evict:decode_evicted_tokens",        # counter -> ..._total{policy}
)

MULTI_API_SERVER_ERROR = (
    "vllm-evict metrics need --api-server-count 1: with {detail}, vLLM serves /metrics from "
    "prometheus_client's multiprocess registry, which never shows the vllm_evict:* metrics (and eviction "
    "reports would be split across API processes). Start `vllm serve` with --api-server-count 1 (it "
    "defaults to the data-parallel size) and without PROMETHEUS_MULTIPROC_DIR."
)


def _num(x: Any) -> float | None:
    """A finite float from a report value (number, or a (nested) list of numbers -> its mean)."""
    if isinstance(x, bool) or x is None:
        return None
    if isinstance(x, (int, float)):
        return float(x) if math.isfinite(x) else None
    if hasattr(x, "tolist"):  # tensor / ndarray
        x = x.tolist()
    if isinstance(x, (list, tuple)):
        flat: list[float] = []
        stack = list(x)
        while stack:
            v = stack.pop()
            if isinstance(v, (list, tuple)):
                stack.extend(v)
            elif isinstance(v, (int, float)) and not isinstance(v, bool):
                flat.append(float(v))
            else:
                return None
        return sum(flat) / len(flat) if flat else None
    return None


class SlidingWindowRate:
    """Events per second over the last `window_s` seconds (shorter right after start)."""

    def __init__(self, window_s: float = 10.0, clock=time.monotonic):
        self.window_s = float(window_s)
        self._clock = clock
        self._start = clock()
        self._events: deque[tuple[float, float]] = deque()
        self._sum = 0.0
        self._lock = threading.Lock()

    def add(self, amount: float, now: float | None = None) -> None:
        if amount <= 0:
            return
        now = self._clock() if now is None else now
        with self._lock:
            self._events.append((now, float(amount)))
            self._sum += amount
            self._trim(now)

    def _trim(self, now: float) -> None:
        horizon = now - self.window_s
        while self._events and self._events[0][0] <= horizon:
            self._sum -= self._events.popleft()[1]
        if not self._events:
            self._sum = 0.0

    def rate(self, now: float | None = None) -> float:
        now = self._clock() if now is None else now
        with self._lock:
            self._trim(now)
            span = min(self.window_s, max(now - self._start, 1e-3))
            return self._sum / span


def _collector(registry: CollectorRegistry, cls, name: str, doc: str, labelnames=(), **kwargs):
    """`cls(name, ...)` registered in `registry`, or the collector already registered under that name (a
    second `EvictMetrics` in the same process, a reloaded module) instead of a duplicate-timeseries error."""
    existing = getattr(registry, "_names_to_collectors", {}).get(name)
    if existing is not None:
        if not isinstance(existing, cls):
            raise ValueError(f"{name} is already registered as a {type(existing).__name__}, not a {cls.__name__}")
        return existing
    return cls(name, doc, labelnames, registry=registry, **kwargs)


class EngineRates:
    """A gauge family computed at each scrape: events per second over a sliding window, one series per
    engine (label `engine`, as vLLM labels its own metrics)."""

    def __init__(self, name: str, doc: str, labelnames=("engine",), registry: CollectorRegistry = REGISTRY,
                 window_s: float = 10.0):
        self.name, self.doc, self.window_s, self.labelnames = name, doc, window_s, list(labelnames)
        self.rates: dict[int, SlidingWindowRate] = {}
        registry.register(self)

    def of(self, engine: int) -> SlidingWindowRate:
        return self.rates.setdefault(engine, SlidingWindowRate(self.window_s))

    def describe(self):
        return [GaugeMetricFamily(self.name, self.doc, labels=self.labelnames)]

    def collect(self):
        family = GaugeMetricFamily(self.name, self.doc, labels=self.labelnames)
        for engine, rate in sorted(self.rates.items()):
            family.add_metric([str(engine)], rate.rate())
        yield family


@dataclass
class _EngineState:
    """Last scheduler statistics of one engine (data-parallel rank) this API process talks to."""

    num_blocks: int | None = None  # usable blocks of this engine (null block excluded)
    usage: float = 0.0
    running: int = 0
    waiting: int = 0
    last_avg_blocks: float | None = None  # used blocks per running request when it last ran any


class EvictMetrics:
    """All `vllm_evict:*` metric objects (in `registry`, prometheus_client's global one by default) plus the
    state behind the derived gauges. Every series carries the label `engine`, the index of the engine
    (data-parallel rank) it describes, as vLLM's own `vllm:*` series do: sum over it for the server's
    totals. Use the per-process singleton `get_metrics()`."""

    def __init__(self, registry: CollectorRegistry = REGISTRY, throughput_window_s: float = 10.0):
        self.registry = r = registry
        p = PREFIX

        def gauge(name, doc):
            return _collector(r, Gauge, p + name, doc, ["engine"])

        def counter(name, doc, labels=("engine",)):
            return _collector(r, Counter, p + name, doc, labels)

        def histogram(name, doc, buckets, labels=("engine",)):
            return _collector(r, Histogram, p + name, doc, labels, buckets=buckets)

        # KV cache / batch
        self.kv_blocks = gauge("kv_cache_blocks", "Usable KV-cache blocks (pages) of the engine.")
        self.kv_used_blocks = gauge("kv_cache_used_blocks", "KV-cache blocks held by requests.")
        self.kv_free_blocks = gauge("kv_cache_free_blocks", "KV-cache blocks free (incl. reusable prefix-cache "
                                    "blocks).")
        self.kv_usage = gauge("kv_cache_usage_ratio", "Fraction of KV-cache blocks in use (0..1).")
        self.avg_seq_blocks = gauge("avg_sequence_blocks", "Average physical KV length of the running "
                                    "sequences, in blocks (used blocks / running requests; last value kept "
                                    "while idle).")
        self.batch_capacity = gauge("batch_capacity_sequences", "Sequences of the current average physical "
                                    "length that fit in free + used KV-cache memory.")
        self.running = gauge("num_requests_running", "Requests in the engine's running batch.")
        self.waiting = gauge("num_requests_waiting", "Requests waiting to be scheduled.")
        # tokens / latency
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens prefilled.")
        self.generation_tokens = counter("generation_tokens", "Tokens generated.")
        self.decode_tps = _collector(r, EngineRates, p + "decode_throughput_tokens_per_second",
                                     f"Generated tokens per second over a sliding {throughput_window_s:g} s "
                                     "window.", ["engine"], window_s=throughput_window_s)
        self.ttft = histogram("time_to_first_token_seconds", "Time from arrival to the first token.", TTFT_BUCKETS)
        self.tpot = histogram("time_per_output_token_seconds", "Mean time per output token after the first, per "
                              "finished request.", TPOT_BUCKETS)
        # eviction
        by_policy = ("policy", "engine")
        self.evictions = counter("evictions", "Requests whose KV cache was evicted, by policy.", by_policy)
        self.evict_prompt_tokens = counter("eviction_prompt_tokens", "Prompt tokens of evicted requests.",
                                           by_policy)
        self.evict_kept_tokens = counter("eviction_kept_tokens", "KV tokens kept after eviction (average over "
                                         "layers and KV heads), per evicted request.", by_policy)
        self.blocks_freed = counter("eviction_blocks_freed", "KV-cache blocks freed by eviction.", by_policy)
        self.decode_compactions = counter("decode_compactions", "Decode-time compactions that evicted tokens "
                                          "(DESIGN.md §4.8 c).", by_policy)
        self.decode_evicted_tokens = counter("decode_evicted_tokens", "Tokens evicted by decode-time compactions "
                                             "(average over layers and KV heads).", by_policy)
        self.compression = histogram("eviction_compression_ratio", "Kept / prompt KV tokens per evicted request.",
                                     RATIO_BUCKETS, by_policy)
        self.evict_latency = histogram("eviction_latency_seconds", "Scoring + compaction time per evicted "
                                       "request (when the engine reports it).", LATENCY_BUCKETS, by_policy)
        self._lock = threading.Lock()
        self._engines: dict[int, _EngineState] = {}
        self._max_model_len: int | None = None
        self._block_size: int | None = None

    # ----------------------------------------------------------------------------------- engine stats
    def register_engine(self, engine: int) -> None:
        """An engine (data-parallel rank) whose stats this process records; fresh state."""
        with self._lock:
            self._engines[engine] = _EngineState()

    @property
    def num_engines(self) -> int:
        return max(len(self._engines), 1)

    def configure(self, *, num_blocks: int | None, block_size: int | None, max_model_len: int | None,
                  engine: int = 0) -> None:
        with self._lock:
            self._block_size = block_size
            self._max_model_len = max_model_len
            st = self._engines.setdefault(engine, _EngineState())
            if num_blocks:
                st.num_blocks = int(num_blocks)
            self._refresh(engine)

    def record_scheduler(self, *, num_blocks: int | None, kv_cache_usage: float, num_running: int,
                         num_waiting: int, engine: int = 0) -> None:
        with self._lock:
            st = self._engines.setdefault(engine, _EngineState())
            if num_blocks:
                st.num_blocks = int(num_blocks)
            st.usage = min(max(float(kv_cache_usage), 0.0), 1.0)
            st.running = int(num_running)
            st.waiting = int(num_waiting)
            self._refresh(engine)

    def _refresh(self, engine: int) -> None:
        """Set one engine's gauges from its last statistics."""
        st, label = self._engines[engine], {"engine": str(engine)}
        self.running.labels(**label).set(st.running)
        self.waiting.labels(**label).set(st.waiting)
        self.kv_usage.labels(**label).set(st.usage)
        if not st.num_blocks:
            return
        used = int(round(st.usage * st.num_blocks))
        self.kv_blocks.labels(**label).set(st.num_blocks)
        self.kv_used_blocks.labels(**label).set(used)
        self.kv_free_blocks.labels(**label).set(st.num_blocks - used)
        if st.running > 0 and used > 0:
            st.last_avg_blocks = used / st.running
        avg = st.last_avg_blocks
        if avg is None and self._max_model_len and self._block_size:
            avg = float(math.ceil(self._max_model_len / self._block_size))  # before any traffic
        if avg:
            self.avg_seq_blocks.labels(**label).set(avg)
            self.batch_capacity.labels(**label).set(st.num_blocks / avg)

    def record_iteration(self, *, generation_tokens: int, prompt_tokens: int, ttfts: list[float],
                         tpots: list[float], engine: int = 0) -> None:
        label = {"engine": str(engine)}
        if generation_tokens:
            self.generation_tokens.labels(**label).inc(generation_tokens)
            self.decode_tps.of(engine).add(generation_tokens)
        if prompt_tokens:
            self.prompt_tokens.labels(**label).inc(prompt_tokens)
        for t in ttfts:
            self.ttft.labels(**label).observe(t)
        for t in tpots:
            self.tpot.labels(**label).observe(t)

    # ----------------------------------------------------------------------------------- eviction
    def observe_eviction(self, report: dict[str, Any], policy: str | None = None) -> None:
        """One engine eviction report (see docs/ARCHITECTURE.md) of a finished request, labelled with
        `policy` (else the report's own `policy`, else "unknown") and the report's `engine`."""
        labels = self._labels(report, policy)
        self.evictions.labels(**labels).inc()
        prompt = _num(report.get("prompt_tokens"))
        kept = _num(report.get("kept_tokens_per_head"))
        if prompt is not None and prompt >= 0:
            self.evict_prompt_tokens.labels(**labels).inc(prompt)
        if kept is not None and kept >= 0:
            self.evict_kept_tokens.labels(**labels).inc(kept)
        if prompt and kept is not None and prompt > 0:
            self.compression.labels(**labels).observe(kept / prompt)
        freed = _num(report.get("blocks_freed"))
        if freed is None:
            before, after = _num(report.get("blocks_before")), _num(report.get("blocks_after"))
            if before is not None and after is not None:
                freed = before - after
        if freed is not None and freed > 0:
            self.blocks_freed.labels(**labels).inc(freed)
        latency_ms = _num(report.get("latency_ms"))
        if latency_ms is not None and latency_ms >= 0:
            self.evict_latency.labels(**labels).observe(latency_ms / 1000.0)
        self.observe_decode(None, report, policy)

    def observe_decode(self, previous: dict[str, Any] | None, report: dict[str, Any], policy: str | None = None) -> None:
        """The decode-time compactions a request's newer report adds to its `previous` one (None: all)."""
        labels = self._labels(report, policy)
        for key, metric in (("decode_compactions", self.decode_compactions),
                            ("decode_evicted_tokens", self.decode_evicted_tokens),
                            ("decode_blocks_freed", self.blocks_freed)):
            added = (_num(report.get(key)) or 0) - (_num((previous or {}).get(key)) or 0)
            if added > 0:
                metric.labels(**labels).inc(added)

    @staticmethod
    def _labels(report: dict[str, Any], policy: str | None) -> dict[str, str]:
        engine = report.get("engine")
        return {"policy": str(policy or report.get("policy") or "unknown"),
                "engine": str(engine if isinstance(engine, int) and not isinstance(engine, bool) else 0)}


_metrics: EvictMetrics | None = None
_metrics_lock = threading.Lock()


def get_metrics() -> EvictMetrics:
    """This process's `EvictMetrics` (in prometheus_client's global REGISTRY), created on first use."""
    global _metrics
    if _metrics is None:
        with _metrics_lock:
            if _metrics is None:
                _metrics = EvictMetrics()
    return _metrics


def observe_eviction(report: dict[str, Any], policy: str | None = None) -> None:
    """Record one finished request's eviction report (called in the API process)."""
    get_metrics().observe_eviction(report, policy)


def observe_decode(previous: dict[str, Any], report: dict[str, Any]) -> None:
    """Record the decode-time compactions of a request's newer report (called in the API process)."""
    get_metrics().observe_decode(previous, report)


def check_single_api_process(vllm_config: Any) -> None:
    """ValueError unless /metrics is served from this process's global registry (one API server)."""
    parallel = getattr(vllm_config, "parallel_config", None)
    count = int(getattr(parallel, "_api_process_count", 1) or 1)
    if count > 1:
        raise ValueError(MULTI_API_SERVER_ERROR.format(detail=f"{count} API server processes"))
    env = next((k for k in MULTIPROC_ENV if k in os.environ), None)
    if env is not None:
        raise ValueError(MULTI_API_SERVER_ERROR.format(detail=f"{env}={os.environ[env]!r} set"))


def _make_stat_logger_class():
    from vllm.v1.metrics.loggers import StatLoggerBase

    class EvictStatLogger(StatLoggerBase):
        """vLLM stat-logger plugin (entry-point group `vllm.stat_logger_plugins`, name `vllm_evict`): feeds
        the `vllm_evict:*` metrics from vLLM's per-step SchedulerStats / IterationStats. vLLM builds one per
        engine (data-parallel rank) as `EvictStatLogger(vllm_config, engine_index)`."""

        def __init__(self, vllm_config, engine_index: int = 0):
            check_single_api_process(vllm_config)
            self.vllm_config = vllm_config
            self.engine_index = engine_index
            self.metrics = get_metrics()
            self.metrics.register_engine(engine_index)

        def _num_blocks(self) -> int | None:
            # the API process's num_gpu_blocks is summed over the engines it talks to (core_client.py);
            # each engine reserves block 0 as its null block
            n = getattr(self.vllm_config.cache_config, "num_gpu_blocks", None)
            return max(int(n) // self.metrics.num_engines - 1, 0) if n else None

        def log_engine_initialized(self):
            cfg = self.vllm_config
            self.metrics.configure(num_blocks=self._num_blocks(), block_size=cfg.cache_config.block_size,
                                   max_model_len=cfg.model_config.max_model_len, engine=self.engine_index)

        def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None, engine_idx: int = 0):
            if scheduler_stats is not None:
                self.metrics.record_scheduler(
                    num_blocks=self._num_blocks(),
                    kv_cache_usage=scheduler_stats.kv_cache_usage,
                    num_running=scheduler_stats.num_running_reqs,
                    num_waiting=scheduler_stats.num_waiting_reqs
                    + getattr(scheduler_stats, "num_skipped_waiting_reqs", 0),
                    engine=self.engine_index,
                )
            if iteration_stats is not None:
                pts = getattr(iteration_stats, "prompt_token_stats", None)
                self.metrics.record_iteration(
                    generation_tokens=iteration_stats.num_generation_tokens,
                    prompt_tokens=pts.total if pts is not None else iteration_stats.num_prompt_tokens,
                    ttfts=list(iteration_stats.time_to_first_tokens_iter),
                    tpots=[f.mean_time_per_output_token for f in iteration_stats.finished_requests
                           if f.num_generation_tokens > 1],
                    engine=self.engine_index,
                )

    EvictStatLogger.__module__ = __name__
    EvictStatLogger.__qualname__ = "EvictStatLogger"
    return EvictStatLogger


_class_lock = threading.Lock()


def __getattr__(name: str):
    # `EvictStatLogger` subclasses vLLM's StatLoggerBase; it is built on first access so that importing this
    # module (for `_num`, `observe_eviction`, `METRIC_NAMES`) does not import vLLM
    if name == "EvictStatLogger":
        with _class_lock:
            cls = globals().get("EvictStatLogger")
            if cls is None:
                cls = globals()["EvictStatLogger"] = _make_stat_logger_class()
        return cls
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
