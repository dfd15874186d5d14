"""Prometheus metrics of the vllm-evict server (`vllm_evict:*`).

Two feeds:

* `EvictStatLogger` — a vLLM `StatLoggerBase` handed to `AsyncLLM.from_engine_args(stat_loggers=...)`;
  vLLM calls `record()` from the engine's output-handler task every step with `SchedulerStats`
  (KV-cache usage, running / waiting requests) and `IterationStats` (generated tokens, TTFT, finished
  requests' time per output token).
* `ServerMetrics.observe_request_end()` — called by the HTTP layer with the engine's eviction report of
  every finished request (evictions, prompt vs kept tokens, compression ratio, blocks freed, scoring +
  compaction latency).

Everything lives in a private `CollectorRegistry` (no clash with vLLM's own `vllm:*` metrics in the
global registry, several apps per process in tests); `/metrics` exposes both.
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

PREFIX = "vllm_evict:"

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
                5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
RATIO_BUCKETS = (0.01, 0.02, 0.05, 0.1, 0.15, 0.2, 0.25, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 1.0)
LATENCY_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
                   2.5, 5.0, 10.0)

# public list (README, tests): every metric family this module exports, without the _bucket/_sum/... suffixes
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
    "vllm_evict:requests",                     # counter -> vllm_evict:requests_total{endpoint,policy}
    "vllm_evict:requests_aborted",             # counter -> vllm_evict:requests_aborted_total
    "vllm_evict:request_errors",               # counter -> vllm_evict:request_errors_total{status}
    "vllm_evict:evictions",                    # counter -> vllm_evict:evictions_total{policy}
    "vllm_evict:eviction_prompt_tokens",       # counter -> ..._total{policy}
    "vllm_evict:eviction_kept_tokens",         # counter -> ..._total{policy}
    "vllm_evict:eviction_blocks_freed",        # counter -> ..._total{policy}
    "vllm_evict:eviction_compression_ratio",   # histogram{policy}: kept / prompt tokens
    "vllm_evict:eviction_latency_seconds",     # histogram{policy}: scoring + compaction
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


class ServerMetrics:
    """All `vllm_evict:*` metric objects plus the state behind the derived gauges."""

    def __init__(self, registry: CollectorRegistry | None = None, throughput_window_s: float = 10.0):
        self.registry = registry if registry is not None else CollectorRegistry(auto_describe=True)
        r = self.registry
        p = PREFIX
        # KV cache / batch
        self.kv_blocks = Gauge(p + "kv_cache_blocks", "Usable KV-cache blocks (pages) of the engine.", registry=r)
        self.kv_used_blocks = Gauge(p + "kv_cache_used_blocks", "KV-cache blocks held by requests.", registry=r)
        self.kv_free_blocks = Gauge(p + "kv_cache_free_blocks", "KV-cache blocks free (incl. reusable "
                                    "prefix-cache blocks).", registry=r)
        self.kv_usage = Gauge(p + "kv_cache_usage_ratio", "Fraction of KV-cache blocks in use (0..1).", registry=r)
        self.avg_seq_blocks = Gauge(p + "avg_sequence_blocks", "Average physical KV length of the running "
                                    "sequences, in blocks (used blocks / running requests; last value "
                                    "kept while idle).", registry=r)
        self.batch_capacity = Gauge(p + "batch_capacity_sequences", "Sequences of the current average physical "
                                    "length that fit in free + used KV-cache memory.", registry=r)
        self.running = Gauge(p + "num_requests_running", "Requests in the engine's running batch.", registry=r)
        self.waiting = Gauge(p + "num_requests_waiting", "Requests waiting to be scheduled.", registry=r)
        # tokens / latency
        self.prompt_tokens = Counter(p + "prompt_tokens", "Prompt tokens prefilled.", registry=r)
        self.generation_tokens = Counter(p + "generation_tokens", "Tokens generated.", registry=r)
        self._decode_rate = SlidingWindowRate(throughput_window_s)
        self.decode_tps = Gauge(p + "decode_throughput_tokens_per_second",
                                f"Generated tokens per second over a sliding {throughput_window_s:g} s window.",
                                registry=r)
        self.decode_tps.set_function(self._decode_rate.rate)
        self.ttft = Histogram(p + "time_to_first_token_seconds", "Time from arrival to the first token.",
                              buckets=TTFT_BUCKETS, registry=r)
        self.tpot = Histogram(p + "time_per_output_token_seconds", "Mean time per output token after the first, "
                              "per finished request.", buckets=TPOT_BUCKETS, registry=r)
        # requests
        self.requests = Counter(p + "requests", "Generation requests accepted, by endpoint and eviction policy.",
                                ["endpoint", "policy"], registry=r)
        self.aborted = Counter(p + "requests_aborted", "Requests aborted because the client went away.", registry=r)
        self.errors = Counter(p + "request_errors", "Requests answered with an error, by HTTP status.",
                              ["status"], registry=r)
        # eviction
        self.evictions = Counter(p + "evictions", "Requests whose KV cache was evicted, by policy.", ["policy"],
                                 registry=r)
        self.evict_prompt_tokens = Counter(p + "eviction_prompt_tokens", "Prompt tokens of evicted requests.",
                                           ["policy"], registry=r)
        self.evict_kept_tokens = Counter(p + "eviction_kept_tokens", "KV tokens kept after eviction (average "
                                         "over layers and KV heads), per evicted request.", ["policy"],
                                         registry=r)
        self.blocks_freed = Counter(p + "eviction_blocks_freed", "KV-cache blocks freed by eviction.", ["policy"],
                                    registry=r)
        self.compression = Histogram(p + "eviction_compression_ratio", "Kept / prompt KV tokens per evicted "
                                     "request.", ["policy"], buckets=RATIO_BUCKETS, registry=r)
        self.evict_latency = Histogram(p + "eviction_latency_seconds", "Scoring + compaction time per evicted "
                                       "request (when the engine reports it).", ["policy"],
                                       buckets=LATENCY_BUCKETS, registry=r)
        self._last_avg_blocks: float | None = None
        self._max_model_len: int | None = None
        self._block_size: int | None = None

    # ----------------------------------------------------------------------------------- engine stats
    def configure(self, *, num_blocks: int | None, block_size: int | None, max_model_len: int | None) -> None:
        self._block_size = block_size
        self._max_model_len = max_model_len
        if num_blocks:
            self.kv_blocks.set(num_blocks)
            self.kv_free_blocks.set(num_blocks)
            self.kv_used_blocks.set(0)
            self._update_capacity(num_blocks, used=0, running=0)

    def _update_capacity(self, total: int, used: int, running: int) -> None:
        if running > 0 and used > 0:
            self._last_avg_blocks = used / running
        avg = self._last_avg_blocks
        if avg is None and self._max_model_len and self._block_size:
            avg = float(math.ceil(self._max_model_len / self._block_size))  # before any traffic: full-length
        if avg:
            self.avg_seq_blocks.set(avg)
            self.batch_capacity.set(total / avg)

    def record_scheduler(self, *, num_blocks: int | None, kv_cache_usage: float, num_running: int,
                         num_waiting: int) -> None:
        self.running.set(num_running)
        self.waiting.set(num_waiting)
        usage = min(max(float(kv_cache_usage), 0.0), 1.0)
        self.kv_usage.set(usage)
        if num_blocks:
            used = int(round(usage * num_blocks))
            self.kv_blocks.set(num_blocks)
            self.kv_used_blocks.set(used)
            self.kv_free_blocks.set(num_blocks - used)
            self._update_capacity(num_blocks, used, num_running)

    def record_iteration(self, *, generation_tokens: int, prompt_tokens: int, ttfts: list[float],
                         tpots: list[float]) -> None:
        if generation_tokens:
            self.generation_tokens.inc(generation_tokens)
            self._decode_rate.add(generation_tokens)
        if prompt_tokens:
            self.prompt_tokens.inc(prompt_tokens)
        for t in ttfts:
            self.ttft.observe(t)
        for t in tpots:
            self.tpot.observe(t)

    # ----------------------------------------------------------------------------------- requests
    def observe_request(self, endpoint: str, policy: str) -> None:
        self.requests.labels(endpoint=endpoint, policy=policy).inc()

    def observe_error(self, status: int) -> None:
        self.errors.labels(status=str(status)).inc()

    def observe_abort(self) -> None:
        self.aborted.inc()

    def observe_eviction(self, report: dict[str, Any]) -> None:
        """One engine eviction report (see docs/ARCHITECTURE.md) of a finished request."""
        policy = str(report.get("policy") or "unknown")
        self.evictions.labels(policy=policy).inc()
        prompt = _num(report.get("prompt_tokens"))
        kept = _num(report.get("kept_tokens_per_head"))
        if prompt is not None and prompt >= 0:
            self.evict_prompt_tokens.labels(policy=policy).inc(prompt)
        if kept is not None and kept >= 0:
            self.evict_kept_tokens.labels(policy=policy).inc(kept)
        if prompt and kept is not None and prompt > 0:
            self.compression.labels(policy=policy).observe(kept / prompt)
        freed = _num(report.get("blocks_freed"))
        if freed is None:
            before, after = _num(report.get("blocks_before")), _num(report.get("blocks_after"))
            if before is not None and after is not None:
                freed = before - after
        if freed is not None and freed > 0:
            self.blocks_freed.labels(policy=policy).inc(freed)
        latency_ms = _num(report.get("latency_ms"))
        if latency_ms is not None and latency_ms >= 0:
            self.evict_latency.labels(policy=policy).observe(latency_ms / 1000.0)


def make_stat_logger_factory(metrics: ServerMetrics):
    """A per-engine stat-logger factory `(vllm_config, engine_index) -> StatLoggerBase` for AsyncLLM."""
    from vllm.v1.metrics.loggers import StatLoggerBase

    class EvictStatLogger(StatLoggerBase):
        """Feeds `ServerMetrics` from vLLM's per-step SchedulerStats / IterationStats."""

        def __init__(self, vllm_config, engine_index: int = 0):
            self.vllm_config = vllm_config
            self.engine_index = engine_index
            self.metrics = metrics

        def _num_blocks(self) -> int | None:
            n = getattr(self.vllm_config.cache_config, "num_gpu_blocks", None)
            return max(int(n) - 1, 0) if n else None  # block 0 is vLLM's reserved null block

        def log_engine_initialized(self):
            cfg = self.vllm_config
            self.metrics.configure(num_blocks=self._num_blocks(), block_size=cfg.cache_config.block_size,
                                   max_model_len=cfg.model_config.max_model_len)

        def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None, engine_idx: int = 0):
            if scheduler_stats is not None:
                self.metrics.record_scheduler(
                    num_blocks=self._num_blocks(),
                    kv_cache_usage=scheduler_stats.kv_cache_usage,
                    num_running=scheduler_stats.num_running_reqs,
                    num_waiting=scheduler_stats.num_waiting_reqs
                    + getattr(scheduler_stats, "num_skipped_waiting_reqs", 0),
                )
            if iteration_stats is not None:
                pts = getattr(iteration_stats, "prompt_token_stats", None)
                self.metrics.record_iteration(
                    generation_tokens=iteration_stats.num_generation_tokens,
                    prompt_tokens=pts.total if pts is not None else iteration_stats.num_prompt_tokens,
                    ttfts=list(iteration_stats.time_to_first_tokens_iter),
                    tpots=[f.mean_time_per_output_token for f in iteration_stats.finished_requests
                           if f.num_generation_tokens > 1],
                )

    return EvictStatLogger
