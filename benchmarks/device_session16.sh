#!/usr/bin/env bash
# Session 16's device work (issues 32 and 34): one device call per numbered line, back to back on one warm
# machine (it goes back ~30 s after a call ends, and at the end of the call in flight once it has been held
# 30 minutes; a fresh one needs the vLLM bundle staged again). Each line is run(carry=..., command=...) of the
# device tool, with no kind (one GPU). Seconds are estimates for a warm H200 from session 15's logs (engine
# start ~60-70 s each, the first of a fresh machine ~90 s); every plan JSON records the GPU it ran on.
#
# Here, once (needs PyPI; both are ignored by git):
#     bash ../shared/gpu/build_vllm_bundle.sh      # -> .vllm-gpu/part1, part2 (58 MB each)
#     bash benchmarks/quality_gpu.sh prepare       # -> .quality-gpu/part1, part2 (48 MB each: the GGUF halves)
# Device calls:
#  1. carry=[".vllm-gpu/part1"]     bash .vllm-gpu/part1/stage.sh                                     ~40 s
#  2. carry=[".vllm-gpu/part2"]     bash .vllm-gpu/part2/stage.sh                                     ~60 s
#  3. carry=[".quality-gpu/part1"]  STAGE_GGUF=.quality-gpu/part1 bash benchmarks/device_session16.sh fp8perf32a
#       #32, bf16 cache, vanilla then DropKV 10% uniform, one engine start each, suites load,e2e: decode
#       tok/s at capacity (32K in / 256 out, --num-requests 0 = as many as the pool holds at once: ~26 and
#       ~241 on an H200) and the 16K x 64 / 512-out end-to-end time (vanilla also: its limit)           ~330 s
#  4. carry=[".quality-gpu/part2"]  STAGE_GGUF=.quality-gpu/part2 bash benchmarks/device_session16.sh fp8perf32b
#       #32, the same with --kv-cache-dtype fp8 on both engines (~53 and ~491 requests at capacity)    ~350 s
#  5. bash benchmarks/device_session16.sh fp8-needle
#       #32, needle accuracy at 10% with a bf16 and an fp8 cache, same samples: 4 needle tasks at 4K,
#       n=24 each, SnapKV / DropKV / KeyDiff at 0.1 and the full cache (quality_gpu.sh fp8-needle)      ~220 s
#  6. bash benchmarks/device_session16.sh reasoning34c
#       #34, one vanilla engine: the physical limit of the reasoning shape (suite limit) and vanilla's own
#       256 x 1K / 4K run; then DropKV + Ada-KV at decode budget 1024                                 ~440 s
#  7. bash benchmarks/device_session16.sh reasoning34b
#       #34, vanilla, then SnapKV at decode budgets 1024 and 2048                                     ~510 s
# About 1,950 s of calls plus the machine's start: call 7 starts near the machine's 30 minutes and, being in
# flight, still finishes. If this session's device time is counted in full (not at a single chip's 50%),
# it is over 30 minutes: then drop call 5 or 7, or run 6 as reasoning34limit (vanilla only, ~270 s).
# Variants: if Ada-KV decode budgets have not landed, the evict engine of reasoning34c only records the
# refusal (~70 s): run reasoning34limit instead. fp8load32a/b and fp8e2e16a/b are calls 3-4 cut in halves,
# to redo one half that failed (each half costs its own engine starts). GPU tests can ride along with a call
# that has room (call 5): RUN_TESTS=1 GPU_TESTS="$PWD/tests/engine/test_cuda_fp8.py" bash ... fp8-needle.
# On an H100 instead of an H200 the KV pool is half as large and the reasoning shape slower (vanilla 234 s
# in the issue): reasoning34b then does not fit one call; run reasoning34b1 and reasoning34b2 (one SnapKV
# budget each, vanilla in each) instead.
#
# usage: [STAGE_GGUF=.quality-gpu/partK] [RUN_TESTS=1 [GPU_TESTS="..."]] [BUDGET_S=575] \
#          bash benchmarks/device_session16.sh PLAN...     (PLAN: a serving.py plan, or fp8-needle)
# Every plan runs under `timeout` so that the call ends inside the device's 600 s and its files come back
# (at most 8 files per call): $OUT/info.txt (GPU, commit, what ran), per plan $OUT/PLAN.json (every engine's
# result; a partial one is assembled from the engines that finished if the plan was cut) and $OUT/PLAN.log
# (the plan's output less warnings), fp8-needle's two tables and archive, and $OUT/raw.tgz with the rest
# (per-engine JSONs, GPU test log).
set -uo pipefail
cd "$(dirname "$0")/.."
t0=$(date +%s)
budget=${BUDGET_S:-575}
left() { echo $((budget - ($(date +%s) - t0))); }
if [ -n "${STAGE_GGUF:-}" ]; then
  bash benchmarks/quality_gpu.sh stage "$STAGE_GGUF" || echo "session16: staging $STAGE_GGUF failed"
fi
# shellcheck source=benchmarks/device_env.sh
source benchmarks/device_env.sh || exit 2
export VLLM_WORKER_MULTIPROC_METHOD=spawn
raw=/tmp/session16-raw
rm -rf "$raw" && mkdir -p "$raw"
{ nvidia-smi --query-gpu=name,memory.total,clocks.sm --format=csv; echo "commit: $(git log -1 --format=%H 2>/dev/null)"
  echo "plans: $*"; } > "$OUT/info.txt"
cat "$OUT/info.txt"
if [ "${RUN_TESTS:-0}" = 1 ]; then  # as device_issue13.sh: from /tmp, the installed-layout mirror first
  (repo=$PWD; cd /tmp && timeout -k 10 $(($(left) - 60)) python3 -m pytest -q -p no:cacheprovider \
    --import-mode=append --rootdir "$repo" -rfE --tb=short \
    ${GPU_TESTS:-$repo/tests/engine/test_cuda_per_head.py $repo/tests/engine/test_cuda_graphs.py}) \
    > "$raw/gpu_tests.log" 2>&1; grep -E "^(FAILED|ERROR|E  )|passed|failed" "$raw/gpu_tests.log" | cut -c1-600 | tail -30
fi
for plan in "$@"; do
  t=$(($(left) - 15))
  if [ "$t" -lt 90 ]; then echo "session16: $plan skipped ($t s left)" | tee -a "$OUT/info.txt"; continue; fi
  echo "session16: $plan ($t s left)" | tee -a "$OUT/info.txt"
  s=$(date +%s)
  if [ "$plan" = fp8-needle ]; then
    STOP_AFTER=${STOP_AFTER:-$(( t - 200 < 300 ? t - 200 : 300 ))} timeout -k 10 "$t" \
      bash benchmarks/quality_gpu.sh fp8-needle 2>&1 | grep -v "Warning\|warn(" > "$raw/$plan.log"
    rc=$?
    grep -E "^quality:|^\[needle|Traceback|Error" "$raw/$plan.log" | cut -c1-400 | tail -20
    cp -f "$raw/$plan.log" "$OUT/$plan.log"
  else
    timeout -k 10 "$t" python3 benchmarks/serving.py run --plan "$plan" --out-dir "$raw" 2>&1 \
      | grep -v "Warning\|warn(" > "$raw/$plan.log"
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
out.write_text(json.dumps([{"partial": "the plan was cut by device_session16.sh's timeout"}] + runs, indent=1))
EOF
    fi
  fi
  echo "session16: $plan rc $rc in $(( $(date +%s) - s )) s" | tee -a "$OUT/info.txt"
done
tar -C "$raw" -czf "$OUT/raw.tgz" . 2>/dev/null  # the plan logs too (also in $OUT): one archive of the call
echo "session16: done in $(( $(date +%s) - t0 )) s; files: $(ls "$OUT" | tr '\n' ' ')"
