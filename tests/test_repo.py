"""Repository contracts: CI runs README's test commands (the default suite and the slow tests); the vLLM version check refuses other versions."""

import os
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def readme_commands() -> list[str]:
    blocks = re.findall(r"```bash\n(.*?)```", (ROOT / "README.md").read_text(), flags=re.S)
    return [line.strip() for block in blocks for line in block.strip().splitlines()]


def test_ci_runs_readme_test_command():
    commands = readme_commands()
    test_command, slow_command = commands[1], commands[2]
    assert "pytest" in test_command and slow_command == test_command + " -m slow"
    ci_lines = [line.strip() for line in (ROOT / ".ci/run").read_text().splitlines()]
    assert test_command in ci_lines and slow_command in ci_lines
    assert "bash scripts/setup.sh" in ci_lines
    assert commands[0].startswith("bash scripts/setup.sh")


def test_version_check_refuses_other_versions():
    from vllm_evict._version_check import SUPPORTED_VLLM_VERSION, UnsupportedVllmVersion, check_vllm_version

    assert check_vllm_version(SUPPORTED_VLLM_VERSION) == SUPPORTED_VLLM_VERSION
    assert check_vllm_version(SUPPORTED_VLLM_VERSION + "+cpu") == SUPPORTED_VLLM_VERSION + "+cpu"
    with pytest.raises(UnsupportedVllmVersion, match="supports vLLM 0.26.0 only.*found vLLM 0.25.1"):
        check_vllm_version("0.25.1")


def test_installed_vllm_is_supported():
    from vllm_evict._version_check import check_vllm_version

    assert check_vllm_version().startswith("0.26.0")


def test_setup_pins_the_supported_version():
    from vllm_evict._version_check import SUPPORTED_VLLM_VERSION

    assert f"VLLM_VERSION={SUPPORTED_VLLM_VERSION}" in (ROOT / "scripts/setup.sh").read_text()
    assert f'"vllm=={SUPPORTED_VLLM_VERSION}"' in (ROOT / "pyproject.toml").read_text()


def _origins(cwd, *names):
    """Where `python -c` run in `cwd` (first on its path) finds each top-level module: its origin, or None."""
    import subprocess
    import sys

    code = ("import importlib.util as u, vllm_evict.kernels.window_scores, vllm_evict.server.metrics\n"
            f"for n in {names!r}: s = u.find_spec(n); print(s and s.origin)")
    out = subprocess.run([sys.executable, "-c", code], cwd=cwd, capture_output=True, text=True,
                         env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
    assert out.returncode == 0, out.stderr
    return out.stdout.split()


def test_kernels_and_server_install_under_the_package_namespace(tmp_path):
    """kernels/ and server/ import as vllm_evict.kernels / vllm_evict.server from the installed package
    (vllm_evict/ links to them), and install no generic top-level `kernels` or `server` (HF's `kernels`
    distribution uses that name; it may be installed). Run outside the checkout, so the source tree is not on
    the path."""
    for name, origin in zip(("kernels", "server"), _origins(tmp_path, "kernels", "server")):
        assert origin == "None" or not origin.startswith(str(ROOT / name)), origin


def test_the_checkout_does_not_shadow_hugging_face_kernels():
    """From the repository root (`python -m`, pytest put it first on the path) a top-level `kernels` is not
    this checkout's kernels/: transformers imports Hugging Face's `kernels` by that name."""
    (origin,) = _origins(ROOT, "kernels")
    assert origin == "None" or not origin.startswith(str(ROOT / "kernels")), origin
