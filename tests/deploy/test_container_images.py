"""Build the container images for real and run them: deploy/build_local.sh (buildah + podman, no registry, no
daemon; the base image comes from Debian packages through debootstrap).

* test_cpu_image_builds_and_serves: `build_local.sh all` builds deploy/Dockerfile.cpu on a debootstrapped
  Debian bookworm base, runs it as shipped (its ENTRYPOINT and non-root USER, the tiny model), waits for the
  image's own HEALTHCHECK, then checks /health, a chat completion with an `eviction` field on a ~250-token
  prompt (usage.eviction.evicted) and /metrics (`vllm_evict:` series).
* test_gpu_dockerfile_on_standin_base: `build_local.sh gpu` builds deploy/Dockerfile on a stand-in for
  vllm/vllm-openai:v0.26.0 (the CPU image without this package: vLLM 0.26.0 + torch 2.11.0) and runs its
  ENTRYPOINT with the README's arguments (--help) as its USER. The CUDA runtime is not exercised.

They skip, with the script's reason, only where the container tools cannot run (not root, buildah / podman /
debootstrap missing, podman unable to start any container: the script exits 77); any other failure fails.
CI (.ci/run) installs the tools. ~10 min on 2 CPU cores (debootstrap ~1 min, build ~6 min, start ~2 min).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "deploy" / "build_local.sh"
SKIP_STATUS = 77
TIMEOUT_S = float(os.environ.get("VLLM_EVICT_IMAGE_TEST_TIMEOUT", "3000"))
TOOLS = ("buildah", "podman", "debootstrap")

pytestmark = [pytest.mark.engine, pytest.mark.container, pytest.mark.slow]


def _cannot_run() -> str | None:
    if os.geteuid() != 0:
        return "needs root (debootstrap, rootful buildah and podman)"
    missing = [t for t in TOOLS if shutil.which(t) is None]
    if missing:
        return (f"not installed: {', '.join(missing)} (Debian: apt-get install -y --no-install-recommends "
                "buildah podman runc debootstrap netavark aardvark-dns iptables; .ci/run does)")
    return None


def _run_script(step: str, tmp_path: Path) -> tuple[str, dict[str, str]]:
    """Run `build_local.sh STEP`; skip on exit 77 (tools cannot run here), fail on any other error.
    Returns (its output, its TIMINGS_FILE entries)."""
    reason = _cannot_run()
    if reason:
        pytest.skip(reason)
    log = tmp_path / f"build_local-{step}.log"
    timings = tmp_path / "timings.txt"
    env = {**os.environ, "TIMINGS_FILE": str(timings), "LOG_TAIL": "40"}
    with open(log, "wb") as f:
        try:
            proc = subprocess.run(["bash", str(SCRIPT), step], stdout=f, stderr=subprocess.STDOUT, env=env,
                                  cwd=ROOT, timeout=TIMEOUT_S)
        except subprocess.TimeoutExpired:
            pytest.fail(f"build_local.sh {step} ran past {TIMEOUT_S:.0f}s:\n{_tail(log)}")
    out = log.read_text(errors="replace")
    if proc.returncode == SKIP_STATUS:
        skips = [ln.split("SKIP: ", 1)[1] for ln in out.splitlines() if "SKIP: " in ln]
        pytest.skip(f"container tools cannot run here: {skips[-1] if skips else _tail(log, 5)}")
    assert proc.returncode == 0, f"build_local.sh {step} failed ({proc.returncode}):\n{_tail(log)}"
    entries = dict(ln.split("=", 1) for ln in timings.read_text().split() if "=" in ln) if timings.exists() else {}
    print(f"build_local.sh {step}: {entries}")
    return out, entries


def _dockerfile_healthcheck(name: str) -> list[str]:
    text = re.sub(r"\\\n\s*", " ", (ROOT / "deploy" / name).read_text())
    (line,) = [ln for ln in text.splitlines() if ln.startswith("HEALTHCHECK ")]
    return json.loads(line.split(" CMD ", 1)[1])


def _tail(path: Path, n: int = 40) -> str:
    """The log's error lines first (a report may show only the start of a long failure), then its last n."""
    lines = path.read_text(errors="replace").splitlines()
    errors = [ln for ln in lines if re.search(r"\berror\b|no space left|ERROR", ln, re.IGNORECASE)][-15:]
    return "\n".join(["errors in the log:", *errors, f"last {n} lines:", *lines[-n:]])


def test_cpu_image_builds_and_serves(tmp_path):
    out, timings = _run_script("all", tmp_path)
    # the script's checks passed; make sure each one really ran, with the expected results
    assert "run: all checks passed" in out
    # the health check that ran is the image's, i.e. the Dockerfile's HEALTHCHECK CMD
    m = re.search(r"the image's HEALTHCHECK: (\[.*\])", out)
    assert m and json.loads(m.group(1)) == ["CMD", *_dockerfile_healthcheck("Dockerfile.cpu")], out[-3000:]
    assert "run: HEALTHCHECK passed" in out
    assert re.search(r"image USER=10001:10001, server uid=10001", out)
    assert re.search(r"GET /health: 200", out)
    m = re.search(r"POST /v1/chat/completions: 200, prompt_tokens=(\d+).*eviction=(\{.*\})", out)
    assert m, out[-3000:]
    assert 200 <= int(m.group(1)) <= 320
    assert '"evicted": true' in m.group(2) and '"policy": "snapkv"' in m.group(2), m.group(2)
    assert re.search(r"GET /metrics: 200, \d+ vllm_evict: samples", out)
    assert re.search(r'vllm_evict:evictions_total\{[^}]*policy="snapkv"[^}]*\} [1-9]', out)
    assert {"build_s", "start_s", "image_size_bytes"} <= set(timings), timings


def test_gpu_dockerfile_on_standin_base(tmp_path):
    """Runs after the CPU test (same module, file order): its image is the stand-in's source."""
    reason = _cannot_run()
    if reason:
        pytest.skip(reason)
    r = subprocess.run(["podman", "image", "exists", "localhost/vllm-evict:0.1.0-cpu"], capture_output=True,
                       timeout=120)
    if r.returncode != 0:
        pytest.skip("the CPU image was not built (test_cpu_image_builds_and_serves skipped or failed)")
    out, timings = _run_script("gpu", tmp_path)
    assert "gpu: all checks passed" in out
    # the Dockerfile's install lines ran: --no-deps install, missing_deps listing + --check, the import check
    assert re.search(r"vllm 0\.26\.0", out), "the Dockerfile's import check did not print the vLLM version"
    assert "gpu: runs as uid 10001; VLLM_USE_V2_MODEL_RUNNER=0" in out
    assert "gpu_standin_build_s" in timings
