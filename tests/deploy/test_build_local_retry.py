"""deploy/build_local.sh's retry_memfd_sealing, sourced from the script itself, around a stand-in command.

buildah's chroot isolation can exit with "Close_Fd sealing memfd copy: Device or resource busy" before the
container command runs (a transient EBUSY on a loaded machine); the wrapper runs such a command again, up to 3
tries, and returns every other failure at once, stdout and stderr passed through."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "deploy" / "build_local.sh"
SEALING = "Close_Fd sealing memfd copy: Device or resource busy"


def run_wrapped(tmp_path: Path, failures: int, message: str, status: int) -> tuple[subprocess.CompletedProcess, int]:
    """Wrap a command that fails `failures` times (printing `message`, exit `status`), then prints 'done'.
    Called as the script calls it (under its `set -euo pipefail`). Returns the process and how often the
    command ran."""
    count = tmp_path / "tries"
    fake = tmp_path / "fake-buildah"
    fake.write_text(f"""#!/bin/bash
n=$(( $(cat {count} 2>/dev/null || echo 0) + 1 )); echo $n > {count}
if [ $n -le {failures} ]; then echo "{message}" >&2; echo "Error: exit status {status}" >&2; exit {status}; fi
echo done; echo "a warning" >&2
""")
    fake.chmod(0o755)
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "MEMFD_RETRY_S": "0"}
    proc = subprocess.run(["bash", "-c", f'source "{SCRIPT}"; retry_memfd_sealing "{fake}" run ctr; echo after'],
                          capture_output=True, text=True, timeout=60, env=env)
    return proc, int(count.read_text())


def test_transient_sealing_failure_is_tried_again(tmp_path):
    proc, tries = run_wrapped(tmp_path, failures=2, message=SEALING, status=1)
    assert (proc.returncode, tries) == (0, 3), proc.stderr
    assert proc.stdout == "done\nafter\n"  # stdout of the successful try only, unchanged
    assert proc.stderr.count(SEALING) == 2 and proc.stderr.count("try 2 of 3") == 1 and "a warning" in proc.stderr


def test_sealing_failure_three_times_fails(tmp_path):
    proc, tries = run_wrapped(tmp_path, failures=5, message=SEALING, status=1)
    assert (proc.returncode, tries) == (1, 3), proc.stderr
    assert proc.stdout == ""  # the script's `set -e` stops at the failure
    assert proc.stderr.count(SEALING) == 3 and proc.stderr.count(" of 3") == 2  # tries 2 and 3 logged, no 4th


@pytest.mark.parametrize("status", [1, 125])
def test_other_failures_are_not_tried_again(tmp_path, status):
    proc, tries = run_wrapped(tmp_path, failures=1, message="error: RUN pip install failed", status=status)
    assert (proc.returncode, tries, proc.stdout) == (status, 1, ""), proc.stderr
    assert "error: RUN pip install failed" in proc.stderr and "try 2" not in proc.stderr
