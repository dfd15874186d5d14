#!/usr/bin/env bash
# Issue 18 GPU soak, one engine per call (after staging the vLLM bundle): the OpenAI server on loopback
# (Llama-3.1-8B config, dummy weights) under benchmarks/load.py, then SIGTERM; JSON and logs under $OUT.
#   bash benchmarks/device_soak.sh evict|vanilla SECONDS [CLIENTS]
# evict: `vllm-evict serve` with the mixed eviction load; vanilla: stock `vllm serve` (only the bundle on
# PYTHONPATH, no plugins) with the same load minus the eviction field (--mix none).
set -uo pipefail
cd "$(dirname "$0")/.."
source benchmarks/device_env.sh || exit 2
engine=$1 seconds=$2 clients=${3:-200}
model=$(python3 -c "from vllm_evict.testing.tiny_models import write_real_config as w; print(w('llama-3.1-8b', '/tmp/models'))")
args=("$model" --load-format dummy --max-model-len 8192 --port 8000 --shutdown-timeout 45)
if [ "$engine" = evict ]; then
  python3 -m vllm_evict.cli serve "${args[@]}" > "$OUT/server_$engine.log" 2>&1 &
  mix=mixed
else
  PYTHONPATH=/tmp/vsite VLLM_PLUGINS=none python3 -m vllm.entrypoints.cli.main serve "${args[@]}" \
    > "$OUT/server_$engine.log" 2>&1 &
  mix=none
fi
pid=$!
python3 - <<'PY' || { echo "server did not come up"; tail -30 "$OUT/server_$engine.log"; kill $pid; exit 1; }
import time, urllib.request
for _ in range(300):
    try:
        urllib.request.urlopen("http://127.0.0.1:8000/health", timeout=2)
        break
    except Exception:
        time.sleep(1)
else:
    raise SystemExit(1)
PY
python3 benchmarks/load.py --url http://127.0.0.1:8000 --clients "$clients" --seconds "$seconds" --prompt-len 4096 \
  --max-tokens 256 --mix "$mix" --pid $pid --out "$OUT/load_$engine.json" 2>&1 | tail -5
t0=$(date +%s); kill -TERM $pid; wait $pid; echo "server exit $? after $(( $(date +%s) - t0 )) s"
grep -ci "traceback\|error" "$OUT/server_$engine.log" | sed 's/^/server log error lines: /'
