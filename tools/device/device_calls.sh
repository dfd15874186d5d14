#!/usr/bin/env bash
# One call of the GPU device machine (one GPU unless the call names a multi-GPU kind): benchmark plans back to
# back on one warm machine, optionally after the GPU tests. Internal tooling: a user with vllm-evict installed
# runs `python benchmarks/serving.py run --plan NAME --out-dir DIR` (or benchmarks/profile_engine.py) directly;
# this wrapper adds what the device machine needs (vLLM from the staged bundle, a time budget per call, files
# packed for the way back). See tools/device/README.md.
#
# Here, once (needs PyPI; both are ignored by git):
#     build the vLLM GPU bundle, then python tools/device/repack_bundle.py   # -> .vg/p1..p5 (tools/device/README.md)
#     bash tools/device/quality_gpu.sh prepare     # -> .quality-gpu/part1, part2 (48 MB each: the GGUF halves)
# A fresh machine:
#     carry=[".vg/pK"]  bash .vg/pK/stage.sh            K = 1..5, one call each (0.2-19 s on a warm machine)
# then calls such as
#     [carry=[".quality-gpu/partK"]  STAGE_GGUF=.quality-gpu/partK]  bash tools/device/device_calls.sh PLAN...
#
# usage: [COMMIT=sha] [STAGE_GGUF=.quality-gpu/partK] [RUN_TESTS=1 [GPU_TESTS="..."]] [BUDGET_S=575] \
#          bash tools/device/device_calls.sh [PLAN...]
# Engines start from /tmp, so the checkout reaches their interpreters only through PYTHONPATH (device_env.sh)
# and never a vanilla one. SERVING_ARGS: more `serving.py run` arguments (`-- --step-trace`).
# PLAN: a serving.py plan, or PLAN@I,J for some of its entries (serving.py's --entries I J); needle-kv
# (quality_gpu.sh); or profile-NAME, a profile_engine.py run (PROFILES below).
# RUN_TESTS=1 runs the GPU tests first (GPU_TESTS: pytest arguments; default the per-head and CUDA-graph engine
# tests), from /tmp with the checkout appended to sys.path.
# Every plan runs under `timeout` so that the call ends inside the device's 600 s and its files come back
# (at most 8 files per call): $OUT/info.txt (GPU, commit, what ran), per plan $OUT/PLAN.json (every engine's
# result; a partial one is assembled from the engines that finished if the plan was cut) and $OUT/PLAN.log
# (the plan's output less warnings), needle-kv's tables and archive, and $OUT/raw.tgz with the rest
# (per-engine JSONs, GPU test log, profile tables).
set -uo pipefail
cd "$(dirname "$0")/../.."
t0=$(date +%s)
budget=${BUDGET_S:-575}
left() { echo $((budget - ($(date +%s) - t0))); }
if [ -n "${STAGE_GGUF:-}" ]; then
  bash tools/device/quality_gpu.sh stage "$STAGE_GGUF" || echo "device_calls: staging $STAGE_GGUF failed"
fi
# shellcheck source=tools/device/device_env.sh
source tools/device/device_env.sh || exit 2
export VLLM_WORKER_MULTIPROC_METHOD=spawn
# profile_engine.py runs (one engine start each): where a step's time goes, variants side by side
declare -A PROFILES=(
  # decode budget 1024 at the reasoning shape (256 x 1K prompts, a point every 128 tokens), DropKV uniform
  # against Ada-KV, and plain requests holding the same KV (H200 ~150 s)
  [profile-decode-budget]="--decode-budget --batch 256 --prompt-len 1024 --kv-len 1024 --policy dropkv
                           --allocation uniform,adakv --max-model-len 5376 --profile-steps 48"
  # the same over a whole compaction interval (128 steps: every request's decode point), with a cProfile of
  # the host's Python over another interval: where a compaction step's host time goes, uniform against Ada-KV
  [profile-decode-points]="--decode-budget --batch 256 --prompt-len 1024 --kv-len 1024 --policy dropkv
                           --allocation uniform,adakv --max-model-len 5376 --python-profile"
  # the first with an EAGLE draft (2 drafts, synthetic acceptance; DropKV uniform): at 256 requests its steps
  # verify 768 tokens and run without CUDA graphs; host phases, device profile and a cProfile of the host,
  # plain requests against decode-budget ones in the same engine (synchronous scheduling, which decode budgets
  # with speculation need)
  [profile-decode-budget-eagle]="--decode-budget --batch 256 --prompt-len 1024 --kv-len 1024 --policy dropkv
                                 --allocation uniform --max-model-len 5376 --eagle-drafts 2 --profile-steps 16
                                 --python-profile"
  # one-shot eviction at 86 x 8K (10%), uniform against Ada-KV decode steps, and plain requests of the kept
  # length (H200 ~150 s)
  [profile-adakv-decode]="--batch 86 --prompt-len 8192 --kv-len 820 --policy snapkv --allocation uniform,adakv
                          --max-tokens 64 --max-model-len 9216"
  # the per-head FlashAttention call alone: virtual sequences as generated, sorted longest first with the
  # queries moved, and the engine's ordered call with queries in place; split and unsplit (~40 s)
  [profile-order]="--attention-splits --split-shapes 64:1640 86:820 86:1800 --spreads 0 1 2
                   --num-splits 1 32 --orders natural longest engine"
  # split against unsplit over 7 shapes x 6 head spreads through the engine's ordered call, with
  # per_head.split_kv's choice beside them (the split rule's fit; ~60 s)
  [profile-splits]="--attention-splits --split-shapes 16:1640 32:1640 48:2048 64:1640 86:820 86:1800 120:1000
                    --spreads 0 0.5 1 1.5 2 2.5 --num-splits 1 32 --orders engine"
)
raw=/tmp/device-calls-raw
rm -rf "$raw" && mkdir -p "$raw"
# The device copy's git metadata can be older than the tree it ships: the caller names the commit (COMMIT=...).
{ nvidia-smi --query-gpu=name,memory.total,clocks.sm --format=csv
  echo "commit: ${COMMIT:-not given; the git log of the device copy says $(git log -1 --format=%h 2>/dev/null)}"
  echo "plans: $*"; } > "$OUT/info.txt"
cat "$OUT/info.txt"
if [ "${RUN_TESTS:-0}" = 1 ]; then  # from /tmp, as the engines
  (repo=$PWD; cd /tmp && timeout -k 10 $(($(left) - 60)) python3 -m pytest -q -p no:cacheprovider \
    --import-mode=append --rootdir "$repo" -rfE --tb=short \
    ${GPU_TESTS:-$repo/tests/engine/test_cuda_per_head.py $repo/tests/engine/test_cuda_graphs.py}) \
    > "$raw/gpu_tests.log" 2>&1; grep -E "^(FAILED|ERROR|E  )|passed|failed" "$raw/gpu_tests.log" | cut -c1-600 | tail -30
fi
for spec in "$@"; do
  plan=${spec%@*}
  entries=()
  [ "$spec" = "$plan" ] || entries=(--entries ${spec#*@})
  entries=("${entries[@]//,/ }")
  t=$(($(left) - 15))
  if [ "$t" -lt 90 ]; then echo "device_calls: $plan skipped ($t s left)" | tee -a "$OUT/info.txt"; continue; fi
  echo "device_calls: $plan ($t s left)" | tee -a "$OUT/info.txt"
  s=$(date +%s)
  if [ -n "${PROFILES[$plan]:-}" ]; then
    mkdir -p "$raw/$plan"
    # shellcheck disable=SC2086
    (repo=$PWD; cd /tmp && timeout -k 10 "$t" python3 "$repo/benchmarks/profile_engine.py" ${PROFILES[$plan]} \
      --out-dir "$raw/$plan" 2>&1) | grep -v "Warning\|warn(" > "$raw/$plan.log"
    rc=$?
    grep -E '^\{|^###|Traceback|Error' "$raw/$plan.log" | cut -c1-400 | tail -20
    cp -f "$raw/$plan.log" "$OUT/$plan.log"
  elif [ "$plan" = needle-kv ]; then
    STOP_AFTER=${STOP_AFTER:-$(( t - 200 < 300 ? t - 200 : 300 ))} timeout -k 10 "$t" \
      bash tools/device/quality_gpu.sh needle-kv 2>&1 | grep -v "Warning\|warn(" > "$raw/$plan.log"
    rc=$?
    grep -E "^quality:|^\[needle|Traceback|Error" "$raw/$plan.log" | cut -c1-400 | tail -20
    cp -f "$raw/$plan.log" "$OUT/$plan.log"
  else
    (repo=$PWD; cd /tmp && timeout -k 10 "$t" python3 "$repo/benchmarks/serving.py" run --plan "$plan" \
      --out-dir "$raw" \
      --stop-by $(( $(date +%s) + t - 40 )) ${entries[*]} ${SERVING_ARGS:-} 2>&1) | grep -v "Warning\|warn(" > "$raw/$plan.log"
    rc=$?
    grep -E '^\{|^-> rc' "$raw/$plan.log" | cut -c1-400
    cp -f "$raw/$plan.log" "$OUT/$plan.log"
    if [ -f "$raw/$plan.json" ]; then
      cp -f "$raw/$plan.json" "$OUT/$plan.json"
    else  # cut by the timeout: the engines that wrote their JSON
      python3 - "$raw" "$plan" "$OUT/$plan.json" <<'EOF'
import json, sys
from pathlib import Path
raw, plan, out = Path(sys.argv[1]), sys.argv[2], Path(sys.argv[3])
runs = [json.loads(p.read_text()) for p in sorted(raw.glob(f"{plan}_*.json"))]
out.write_text(json.dumps([{"partial": "the plan was cut by device_calls.sh's timeout"}] + runs, indent=1))
EOF
    fi
  fi
  echo "device_calls: $plan rc $rc in $(( $(date +%s) - s )) s" | tee -a "$OUT/info.txt"
done
tar -C "$raw" -czf "$OUT/raw.tgz" . 2>/dev/null  # the plan logs too (also in $OUT): one archive of the call
echo "device_calls: done in $(( $(date +%s) - t0 )) s; files: $(ls "$OUT" | tr '\n' ' ')"
