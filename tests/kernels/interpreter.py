"""Run a test module's `check('cpu', seed)` for a few seeds in the Triton interpreter (a subprocess:
TRITON_INTERPRET must be set before Triton is imported)."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def check_in_interpreter(module: str, seeds: int = 4) -> None:
    # from outside the checkout, with the checkout last on sys.path (for `tests`): `vllm_evict` is the
    # installed package (with .kernels), also where nothing is pip-installed (the GPU machine's mirror)
    script = f"import sys; sys.path.append({str(REPO)!r}); from {module} import check; " \
             f"[check('cpu', s) for s in range({seeds})]"
    res = subprocess.run([sys.executable, "-c", script], env=dict(os.environ, TRITON_INTERPRET="1"),
                         capture_output=True, text=True, timeout=600, cwd=tempfile.gettempdir())
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-4000:]
