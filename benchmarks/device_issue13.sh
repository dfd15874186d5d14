#!/usr/bin/env bash
# One device call (after staging the vLLM bundle): the GPU tests of the engine, then a serving plan.
#   bash benchmarks/device_issue13.sh [PLAN ...]      (logs and JSON under $OUT)
set -uo pipefail
cd "$(dirname "$0")/.."
source benchmarks/device_env.sh || exit 2
export VLLM_WORKER_MULTIPROC_METHOD=spawn
nvidia-smi --query-gpu=name,memory.total,clocks.sm --format=csv | tee $OUT/gpu.txt
git log -1 --format=%H > $OUT/commit.txt 2>/dev/null || true
if [ "${RUN_TESTS:-1}" = 1 ]; then
  # from /tmp with the checkout appended to sys.path: `vllm_evict` must resolve to the installed-layout
  # mirror (with .kernels and .server), not to the checkout's folder
  (repo=$PWD; cd /tmp && python3 -m pytest -q -p no:cacheprovider --import-mode=append --rootdir "$repo" -rfE \
    --tb=short ${GPU_TESTS:-$repo/tests/engine/test_cuda_per_head.py $repo/tests/engine/test_cuda_graphs.py}) \
    > $OUT/gpu_tests.log 2>&1; grep -E "^(FAILED|ERROR|E  )|passed|failed" $OUT/gpu_tests.log | cut -c1-600 | tail -30
fi
for plan in "$@"; do
  python3 benchmarks/serving.py run --plan "$plan" --out-dir $OUT 2>&1 | grep -v "Warning\|warn(" > $OUT/$plan.log
  grep '^{' $OUT/$plan.log | cut -c1-400
done
