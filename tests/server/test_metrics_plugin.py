"""server/metrics.py as a vLLM stat-logger plugin: entry point, record() with real vLLM stats objects,
observe_eviction(), the one-API-process guard, and the metrics showing up on vLLM's own /metrics route.
No engine is started."""

from __future__ import annotations

import math
import sys
from importlib.metadata import EntryPoint, entry_points
from pathlib import Path
from types import SimpleNamespace

import pytest
from prometheus_client import REGISTRY, CollectorRegistry, Counter, generate_latest

from vllm_evict.server import metrics as M

ROOT = Path(__file__).resolve().parents[2]
GROUP = "vllm.stat_logger_plugins"


def val(name: str, **labels) -> float:
    """Current value of a sample in the global registry (0 when the labelled child does not exist yet)."""
    v = REGISTRY.get_sample_value(name, labels)
    return 0.0 if v is None else v


def cfg(*, num_gpu_blocks=101, block_size=16, max_model_len=4096, api_process_count=1):
    """The parts of a VllmConfig EvictStatLogger reads (vLLM's own ParallelConfig)."""
    from vllm.config import ParallelConfig

    return SimpleNamespace(parallel_config=ParallelConfig(_api_process_count=api_process_count),
                           cache_config=SimpleNamespace(num_gpu_blocks=num_gpu_blocks, block_size=block_size),
                           model_config=SimpleNamespace(max_model_len=max_model_len))


@pytest.fixture
def metrics(monkeypatch):
    """The process singleton with its per-engine state cleared (metric values are process-global: tests read
    absolute gauges and counter deltas)."""
    for env in M.MULTIPROC_ENV:
        monkeypatch.delenv(env, raising=False)
    m = M.get_metrics()
    with m._lock:
        m._engines.clear()
    return m


# ----------------------------------------------------------------------------------------------- entry point
def test_entry_point_declared_in_pyproject_resolves_to_the_class():
    try:
        import tomllib
    except ImportError:  # Python 3.10
        tomllib = pytest.importorskip("tomli")
    from vllm.v1.metrics.loggers import StatLoggerBase

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    value = project["entry-points"][GROUP]["vllm_evict"]
    assert value == "vllm_evict.server.metrics:EvictStatLogger"
    cls = EntryPoint("vllm_evict", value, GROUP).load()
    assert cls is M.EvictStatLogger
    assert isinstance(cls, type) and issubclass(cls, StatLoggerBase)  # what vLLM 0.26 requires of the value
    assert cls.__module__ == "vllm_evict.server.metrics" and cls.__qualname__ == "EvictStatLogger"


def test_installed_entry_point_is_what_vllm_loads(monkeypatch):
    monkeypatch.delenv("VLLM_PLUGINS", raising=False)
    installed = {ep.name: ep.value for ep in entry_points(group=GROUP)}
    assert installed.get("vllm_evict") == "vllm_evict.server.metrics:EvictStatLogger", (
        f"installed metadata lacks the stat-logger entry point ({installed}); reinstall (pip install --no-deps "
        f"-e .) and refresh or delete a stale ./vllm_evict.egg-info, which shadows the installed metadata "
        f"when the repo root is on sys.path")
    from vllm.v1.metrics.loggers import load_stat_logger_plugin_factories

    assert M.EvictStatLogger in load_stat_logger_plugin_factories()


def test_importing_the_module_does_not_import_vllm():
    import subprocess

    code = "import sys, server.metrics as m; m.observe_eviction({}, 'p'); print('vllm' in sys.modules)"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "False"


# ----------------------------------------------------------------------------------------------- registry
def test_metrics_live_in_the_global_registry_once(metrics):
    assert M.get_metrics() is metrics
    again = M.EvictMetrics()  # a second instance reuses the registered collectors instead of raising
    assert again.evictions is metrics.evictions and again.kv_usage is metrics.kv_usage
    assert again.decode_tps is metrics.decode_tps  # the exposed throughput windows are shared too
    families = {f.name: f.type for f in REGISTRY.collect() if f.name.startswith(M.PREFIX)}
    assert set(families) == set(M.METRIC_NAMES)
    for gone in ("vllm_evict:requests", "vllm_evict:requests_aborted", "vllm_evict:request_errors"):
        assert gone not in families
    assert families["vllm_evict:evictions"] == "counter"
    assert families["vllm_evict:eviction_latency_seconds"] == "histogram"
    # a clash with a collector of another type is still an error
    reg = CollectorRegistry()
    Counter("vllm_evict:kv_cache_blocks", "x", registry=reg)
    with pytest.raises(ValueError, match="already registered as a Counter"):
        M.EvictMetrics(registry=reg)


# ----------------------------------------------------------------------------------------------- record()
def _iteration(*, gen: int, prompt: int, ttfts: list[float], finished: list[tuple[int, float]]):
    from vllm.v1.engine import FinishReason
    from vllm.v1.metrics.stats import FinishedRequestStats, IterationStats

    it = IterationStats()
    it.num_generation_tokens = gen
    it.prompt_token_stats.computed = prompt
    it.prompt_token_stats.total = prompt
    it.time_to_first_tokens_iter = list(ttfts)
    it.finished_requests = [FinishedRequestStats(finish_reason=FinishReason.STOP, num_generation_tokens=n,
                                                 mean_time_per_output_token=tpot) for n, tpot in finished]
    return it


def test_record_updates_gauges_and_counters(metrics):
    from vllm.v1.metrics.stats import SchedulerStats

    logger = M.EvictStatLogger(cfg(num_gpu_blocks=101, block_size=16, max_model_len=4096), 0)
    logger.log_engine_initialized()
    assert val("vllm_evict:kv_cache_blocks", engine="0") == 100  # vLLM's null block excluded
    assert val("vllm_evict:kv_cache_free_blocks", engine="0") == 100 and val("vllm_evict:kv_cache_used_blocks", engine="0") == 0
    assert val("vllm_evict:avg_sequence_blocks", engine="0") == 256  # before traffic: ceil(max_model_len / block_size)
    assert val("vllm_evict:batch_capacity_sequences", engine="0") == pytest.approx(100 / 256)

    before = {n: val(n, engine="0") for n in ("vllm_evict:prompt_tokens_total", "vllm_evict:generation_tokens_total",
                                  "vllm_evict:time_to_first_token_seconds_count",
                                  "vllm_evict:time_to_first_token_seconds_sum",
                                  "vllm_evict:time_per_output_token_seconds_count",
                                  "vllm_evict:time_per_output_token_seconds_sum")}
    ttft_le_01 = val("vllm_evict:time_to_first_token_seconds_bucket", le="0.1", engine="0")
    sched = SchedulerStats(num_running_reqs=4, num_waiting_reqs=2, num_skipped_waiting_reqs=1, kv_cache_usage=0.3)
    it = _iteration(gen=5, prompt=37, ttfts=[0.05, 0.2], finished=[(10, 0.02), (1, 9.0)])
    logger.record(sched, it, None, engine_idx=0)

    assert val("vllm_evict:num_requests_running", engine="0") == 4
    assert val("vllm_evict:num_requests_waiting", engine="0") == 3  # waiting + skipped waiting
    assert val("vllm_evict:kv_cache_usage_ratio", engine="0") == pytest.approx(0.3)
    assert val("vllm_evict:kv_cache_used_blocks", engine="0") == 30 and val("vllm_evict:kv_cache_free_blocks", engine="0") == 70
    assert val("vllm_evict:avg_sequence_blocks", engine="0") == pytest.approx(7.5)
    assert val("vllm_evict:batch_capacity_sequences", engine="0") == pytest.approx(100 / 7.5)
    assert val("vllm_evict:prompt_tokens_total", engine="0") - before["vllm_evict:prompt_tokens_total"] == 37
    assert val("vllm_evict:generation_tokens_total", engine="0") - before["vllm_evict:generation_tokens_total"] == 5
    assert val("vllm_evict:decode_throughput_tokens_per_second", engine="0") > 0
    assert val("vllm_evict:time_to_first_token_seconds_count", engine="0") - \
        before["vllm_evict:time_to_first_token_seconds_count"] == 2
    assert val("vllm_evict:time_to_first_token_seconds_sum", engine="0") - \
        before["vllm_evict:time_to_first_token_seconds_sum"] == pytest.approx(0.25)
    assert val("vllm_evict:time_to_first_token_seconds_bucket", le="0.1", engine="0") - ttft_le_01 == 1
    # TPOT only for finished requests with more than one generated token
    assert val("vllm_evict:time_per_output_token_seconds_count", engine="0") - \
        before["vllm_evict:time_per_output_token_seconds_count"] == 1
    assert val("vllm_evict:time_per_output_token_seconds_sum", engine="0") - \
        before["vllm_evict:time_per_output_token_seconds_sum"] == pytest.approx(0.02)

    # idle step: queues and usage drop, the average sequence length keeps its last value
    logger.record(SchedulerStats(), None)
    assert val("vllm_evict:num_requests_running", engine="0") == 0 and val("vllm_evict:kv_cache_usage_ratio", engine="0") == 0
    assert val("vllm_evict:kv_cache_free_blocks", engine="0") == 100
    assert val("vllm_evict:avg_sequence_blocks", engine="0") == pytest.approx(7.5)


def test_data_parallel_engines_are_labelled_as_vllm_labels_its_own(metrics):
    """vLLM builds one logger per engine through its PerEngineStatLoggerAdapter and labels its series with
    the engine index; so do these: one series per engine, summed by the query."""
    from vllm.v1.metrics.loggers import PerEngineStatLoggerAdapter
    from vllm.v1.metrics.stats import SchedulerStats

    # the API process's num_gpu_blocks is the sum over its engines (2 x 101 here)
    adapter = PerEngineStatLoggerAdapter(cfg(num_gpu_blocks=202), [0, 1], M.EvictStatLogger)
    adapter.log_engine_initialized()
    assert val("vllm_evict:kv_cache_blocks", engine="0") == val("vllm_evict:kv_cache_blocks", engine="1") == 100
    adapter.record(SchedulerStats(num_running_reqs=2, kv_cache_usage=0.5), _iteration(
        gen=8, prompt=0, ttfts=[], finished=[]), engine_idx=0)
    adapter.record(SchedulerStats(num_running_reqs=1, num_waiting_reqs=4, kv_cache_usage=0.1), None, engine_idx=1)
    per_engine = {name: [val(name, engine=e) for e in "01"] for name in (
        "vllm_evict:num_requests_running", "vllm_evict:num_requests_waiting", "vllm_evict:kv_cache_used_blocks",
        "vllm_evict:kv_cache_free_blocks", "vllm_evict:kv_cache_usage_ratio", "vllm_evict:avg_sequence_blocks",
        "vllm_evict:batch_capacity_sequences")}
    assert per_engine == {"vllm_evict:num_requests_running": [2, 1], "vllm_evict:num_requests_waiting": [0, 4],
                          "vllm_evict:kv_cache_used_blocks": [50, 10], "vllm_evict:kv_cache_free_blocks": [50, 90],
                          "vllm_evict:kv_cache_usage_ratio": [0.5, pytest.approx(0.1)],
                          "vllm_evict:avg_sequence_blocks": [25, 10], "vllm_evict:batch_capacity_sequences": [4, 10]}
    assert val("vllm_evict:decode_throughput_tokens_per_second", engine="0") > 0
    assert val("vllm_evict:decode_throughput_tokens_per_second", engine="1") == 0
    # engine 0 goes idle: engine 1's numbers remain
    adapter.record(SchedulerStats(), None, engine_idx=0)
    assert val("vllm_evict:num_requests_running", engine="0") == 0
    assert val("vllm_evict:num_requests_running", engine="1") == 1
    assert val("vllm_evict:kv_cache_used_blocks", engine="1") == 10
    # an eviction report names the engine that served it (under data parallelism)
    before = val("vllm_evict:evictions_total", policy="t-dp", engine="1")
    M.observe_eviction({"policy": "t-dp", "engine": 1, "prompt_tokens": 64, "kept_tokens_per_head": 16})
    assert val("vllm_evict:evictions_total", policy="t-dp", engine="1") - before == 1


# ----------------------------------------------------------------------------------------------- eviction
def _snapshot(policy: str) -> dict[str, float]:
    names = {
        "n": ("vllm_evict:evictions_total", {}),
        "prompt": ("vllm_evict:eviction_prompt_tokens_total", {}),
        "kept": ("vllm_evict:eviction_kept_tokens_total", {}),
        "freed": ("vllm_evict:eviction_blocks_freed_total", {}),
        "ratio_n": ("vllm_evict:eviction_compression_ratio_count", {}),
        "ratio_sum": ("vllm_evict:eviction_compression_ratio_sum", {}),
        "ratio_le_0.2": ("vllm_evict:eviction_compression_ratio_bucket", {"le": "0.2"}),
        "ratio_le_0.25": ("vllm_evict:eviction_compression_ratio_bucket", {"le": "0.25"}),
        "lat_n": ("vllm_evict:eviction_latency_seconds_count", {}),
        "lat_sum": ("vllm_evict:eviction_latency_seconds_sum", {}),
        "lat_le_0.01": ("vllm_evict:eviction_latency_seconds_bucket", {"le": "0.01"}),
        "lat_le_0.025": ("vllm_evict:eviction_latency_seconds_bucket", {"le": "0.025"}),
        "decode_n": ("vllm_evict:decode_compactions_total", {}),
        "decode_tokens": ("vllm_evict:decode_evicted_tokens_total", {}),
    }
    return {k: val(n, policy=policy, engine="0", **extra) for k, (n, extra) in names.items()}


def _delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {k: after[k] - before[k] for k in before}


def test_observe_eviction_updates_counters_and_histograms(metrics):
    report = {"policy": "snapkv", "prompt_tokens": 200, "kept_tokens_per_head": [[40, 60], [50, 50]],
              "blocks_before": 13, "blocks_after": 4, "latency_ms": 12.5}
    before = _snapshot("t-snapkv")
    M.observe_eviction(report, "t-snapkv")
    d = _delta(before, _snapshot("t-snapkv"))
    assert d["n"] == 1 and d["prompt"] == 200 and d["kept"] == 50  # kept: mean over layers and heads
    assert d["freed"] == 9  # blocks_before - blocks_after
    assert d["ratio_n"] == 1 and d["ratio_sum"] == pytest.approx(0.25)
    assert d["ratio_le_0.2"] == 0 and d["ratio_le_0.25"] == 1
    assert d["lat_n"] == 1 and d["lat_sum"] == pytest.approx(0.0125)  # latency_ms is milliseconds
    assert d["lat_le_0.01"] == 0 and d["lat_le_0.025"] == 1

    # explicit blocks_freed wins; unusable values are skipped; the label falls back to the report's policy
    before = _snapshot("t-report")
    M.observe_eviction({"policy": "t-report", "prompt_tokens": 0, "kept_tokens_per_head": True,
                        "blocks_freed": 3, "blocks_before": 100, "blocks_after": 0,
                        "latency_ms": math.nan}, "")
    d = _delta(before, _snapshot("t-report"))
    assert d == {**{k: 0.0 for k in d}, "n": 1, "freed": 3}
    before = _snapshot("unknown")
    M.observe_eviction({}, "")
    assert _delta(before, _snapshot("unknown"))["n"] == 1


def test_decode_compactions_count_what_each_newer_report_adds(metrics):
    """A decode-budget request reports again after each decode compaction: the first report counts whole,
    each later one adds only its increase (compactions, evicted tokens, freed blocks)."""
    first = {"policy": "t-decode", "prompt_tokens": 100, "decode_compactions": 1, "decode_evicted_tokens": 80,
             "decode_blocks_freed": 5}
    later = {**first, "decode_compactions": 3, "decode_evicted_tokens": 240, "decode_blocks_freed": 15}
    before = _snapshot("t-decode")
    M.observe_eviction(first)
    M.observe_decode(first, later)
    M.observe_decode(later, later)  # the final output repeats the last report: nothing new
    d = _delta(before, _snapshot("t-decode"))
    assert (d["n"], d["decode_n"], d["decode_tokens"], d["freed"]) == (1, 3, 240, 15)


# ----------------------------------------------------------------------------------------------- one API process
def test_more_than_one_api_process_is_refused(metrics, monkeypatch):
    with pytest.raises(ValueError, match="--api-server-count 1") as e:
        M.EvictStatLogger(cfg(api_process_count=2), 0)
    assert "2 API server processes" in str(e.value)
    M.EvictStatLogger(cfg(api_process_count=1), 0)  # fine
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", "/tmp/x")
    with pytest.raises(ValueError, match="PROMETHEUS_MULTIPROC_DIR"):
        M.EvictStatLogger(cfg(api_process_count=1), 0)


def test_served_on_vllm_metrics_route(metrics, monkeypatch, tmp_path):
    """vLLM's own /metrics mount (serve/instrumentator) shows the vllm_evict:* metrics next to its HTTP
    metrics; in multiprocess mode (what --api-server-count > 1 sets up) it would not."""
    pytest.importorskip("httpx")
    from fastapi import FastAPI, HTTPException
    from fastapi.testclient import TestClient
    from vllm.entrypoints.serve.instrumentator.metrics import attach_router
    from vllm.v1.metrics.prometheus import get_prometheus_registry

    M.observe_eviction({"prompt_tokens": 64, "kept_tokens_per_head": 16}, "t-route")
    metrics.record_scheduler(num_blocks=100, kv_cache_usage=0.25, num_running=1, num_waiting=0)
    app = FastAPI()

    @app.post("/v1/completions")
    def bad():
        raise HTTPException(status_code=400, detail="bad")

    attach_router(app)
    with TestClient(app) as client:
        assert client.post("/v1/completions").status_code == 400
        text = client.get("/metrics").text
    assert 'vllm_evict:kv_cache_usage_ratio{engine="0"} ' in text
    assert 'vllm_evict:evictions_total{engine="0",policy="t-route"} ' in text
    assert 'http_requests_total{handler="/v1/completions",method="POST",status="4xx"}' in text

    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path))
    assert b"vllm_evict:" not in generate_latest(get_prometheus_registry())
