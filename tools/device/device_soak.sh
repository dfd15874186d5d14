#!/usr/bin/env bash
# GPU soak (docs/RELIABILITY.md), one engine per call (after staging the vLLM bundle): the OpenAI server on loopback
# (Llama-3.1-8B config, dummy weights) under benchmarks/load.py, then SIGTERM; JSON and logs under $OUT.
#   bash tools/device/device_soak.sh evict|vanilla SECONDS [CLIENTS] [DIR]      (DIR defaults to $OUT)
# evict: `vllm-evict serve` with the mixed eviction load; vanilla: stock `vllm serve` (only the bundle on
# PYTHONPATH, no plugins) with the same load minus the eviction field (--mix none).
# A 600 s soak plus engine start and drain outlasts one remote command (600 s): start it detached in one call,
# from a copy of the tree (the next call replaces the working tree under a running script)
#   cp -r . /tmp/soakrepo && cd /tmp/soakrepo && \
#     setsid nohup bash tools/device/device_soak.sh evict 600 200 /tmp/soak > /tmp/soak.log 2>&1 &
# and collect it in the next (back to back, so the machine stays warm):
#   while [ ! -f /tmp/soak/done_evict ]; do sleep 5; done; cp /tmp/soak/* $OUT/
# SOAK_PORT (default 8000) and SOAK_ENGINE_ARGS (extra server flags) let both engines share one GPU at once,
# e.g. SOAK_ENGINE_ARGS="--gpu-memory-utilization 0.45 --kv-cache-memory-bytes 16G" on ports 8000 and 8001.
set -uo pipefail
cd "$(dirname "$0")/../.."
source tools/device/device_env.sh || exit 2
engine=$1 seconds=$2 clients=${3:-200} dir=${4:-$OUT}
mkdir -p "$dir"
model=$(python3 -c "from vllm_evict.testing.tiny_models import write_real_config as w; print(w('llama-3.1-8b', '/tmp/models'))")
port=${SOAK_PORT:-8000}
# shellcheck disable=SC2206  # SOAK_ENGINE_ARGS is a list of flags
args=("$model" --load-format dummy --max-model-len 8192 --port "$port" --shutdown-timeout 45 ${SOAK_ENGINE_ARGS:-})
# Both from /tmp: `python3 -m` puts the working directory first on sys.path, and vanilla must not see the
# checkout at all.
if [ "$engine" = evict ]; then
  (cd /tmp && exec python3 -m vllm_evict.cli serve "${args[@]}") > "$dir/server_$engine.log" 2>&1 &
  mix=mixed
else
  (cd /tmp && PYTHONPATH=/tmp/vsite VLLM_PLUGINS=none exec python3 -m vllm.entrypoints.cli.main serve "${args[@]}") \
    > "$dir/server_$engine.log" 2>&1 &
  mix=none
fi
pid=$!
# wait for /health, but stop at once if the server exited (a failed start must not spend device time)
up=$(python3 -c "
import time, urllib.request
for _ in range(300):
    try:
        urllib.request.urlopen('http://127.0.0.1:$port/health', timeout=2); print('up'); break
    except Exception:
        try:  # an exited child stays a zombie until this script waits for it
            exited = open('/proc/$pid/stat').read().rsplit(')', 1)[1].split()[0] == 'Z'
        except FileNotFoundError:
            exited = True
        if exited:
            print('exited'); break
        time.sleep(1)
")
if [ "$up" != up ]; then
  echo "server did not come up (${up:-timeout})"; tail -30 "$dir/server_$engine.log"; kill $pid; touch "$dir/done_$engine"; exit 1
fi
python3 benchmarks/load.py --url "http://127.0.0.1:$port" --clients "$clients" --seconds "$seconds" --prompt-len 4096 \
  --max-tokens 256 --mix "$mix" --pid $pid --out "$dir/load_$engine.json" 2>&1 | tail -5
t0=$(date +%s); kill -TERM $pid; wait $pid; echo "server exit $? after $(( $(date +%s) - t0 )) s"
grep -ci "traceback\|error" "$dir/server_$engine.log" | sed 's/^/server log error lines: /'
touch "$dir/done_$engine"
