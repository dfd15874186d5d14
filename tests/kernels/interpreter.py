"""Run a test module's `check('cpu', seed)` for a few seeds in the Triton interpreter (a subprocess:
TRITON_INTERPRET must be set before Triton is imported)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def check_in_interpreter(module: str, seeds: int = 4) -> None:
    script = f"import sys; sys.path.insert(0, {str(REPO)!r}); from {module} import check; " \
             f"[check('cpu', s) for s in range({seeds})]"
    res = subprocess.run([sys.executable, "-c", script], env=dict(os.environ, TRITON_INTERPRET="1"),
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-4000:]
