#!/usr/bin/env bash
# One remote command on a machine of several GPUs: each JOB runs on a GPU of its own, all at once, so that
# vanilla vLLM and vllm-evict (or several models) are measured in the same command on identical cards.
#   JOB = PLAN:ENGINE (a benchmarks/serving.py plan's vanilla or evict engine; PLAN:ENGINE#I its entry I
#         alone), or test:PYTEST_ARGS
#         (pytest arguments, spaces as commas), or py:SCRIPT,ARGS (a python script of the checkout, spaces as
#         commas; $OUT in ARGS is the job's own folder of files back), run on the slot's GPUs (GPUS_PER_JOB of them, in slot order).
#         JOB+JOB+...: jobs one after another on that GPU.
# usage: [COMMIT=sha] [BUDGET_S=570] [SERVING_EXTRA="--step-trace"] [GPUS_PER_JOB=1] bash tools/device/side_by_side.sh JOB...
#   SERVING_EXTRA: arguments passed to every engine run of the PLAN:ENGINE jobs
#   GPUS_PER_JOB: GPUs of each slot (2 for the TP=2 / PP=2 plans: slot i gets GPUs 2i and 2i+1)
# Files back ($OUT): info.txt (GPUs, commit, jobs), JOB.log per job (warnings dropped), results.tgz (the JSONs).
set -uo pipefail
cd "$(dirname "$0")/../.."
# shellcheck source=tools/device/device_env.sh
source tools/device/device_env.sh || exit 2
export VLLM_WORKER_MULTIPROC_METHOD=spawn
budget=${BUDGET_S:-570}
per_job=${GPUS_PER_JOB:-1}
{ nvidia-smi --query-gpu=index,name --format=csv,noheader; echo "commit ${COMMIT:-unknown}"; echo "jobs $*";
  date -u; } > "$OUT/info.txt"
mkdir -p /tmp/side
gpu=0
job_command() {  # the shell command of one JOB
  local job=$1 name args
  name=$(echo "$job" | tr ':,/ $#' '______')
  if [[ $job == test:* ]]; then
    args=${job#test:}
    # from /tmp, the checkout appended to sys.path (as device_calls.sh)
    echo "cd /tmp && python3 -m pytest -q -p no:cacheprovider --import-mode=append --rootdir $PWD -rfE \
--tb=short $(for a in ${args//,/ }; do [[ $a == tests/* ]] && echo "$PWD/$a" || echo "$a"; done | tr '\n' ' ')"
  elif [[ $job == py:* ]]; then
    args=${job#py:}
    args=${args//,/ }
    mkdir -p "$OUT/$name"
    echo "cd /tmp && python3 $PWD/${args//\$OUT/$OUT/$name}"
  else
    # from /tmp too: a vanilla engine's model-inspection subprocess (run with -m) must not find the checkout
    local engine=${job##*:} entries=""
    [[ $engine == *#* ]] && entries="--entries ${engine#*#}" && engine=${engine%%#*}
    echo "cd /tmp && python3 $PWD/benchmarks/serving.py run --plan ${job%%:*} --engines $engine $entries --out-dir /tmp/side/$name ${SERVING_EXTRA:+-- $SERVING_EXTRA}"
  fi
}
for slot in "$@"; do
  name=$(echo "$slot" | tr ':,/ $+#[]' '_________')
  name="gpu${gpu}_${name:0:80}"  # a file name of its own, short enough for the file system
  cmd=""
  IFS='+' read -ra jobs <<< "$slot"
  for job in "${jobs[@]}"; do cmd+="${cmd:+; }$(job_command "$job")"; done
  gpus=$(seq -s, "$gpu" $((gpu + per_job - 1)))
  echo "GPU $gpus: $cmd" >> "$OUT/info.txt"
  # RAY_TMPDIR: a Ray executor's local cluster of its own per slot (sessions, sockets)
  (CUDA_VISIBLE_DEVICES=$gpus RAY_TMPDIR=/tmp/ray$gpu timeout $((budget - 10)) bash -c "$cmd" 2>&1 \
     | grep -v -E "Warning|warnings.warn|^\s*$" > "$OUT/$name.log"; echo "rc ${PIPESTATUS[0]}" >> "$OUT/$name.log") &
  gpu=$((gpu + per_job))
done
wait
tar -C /tmp/side -czf "$OUT/results.tgz" . 2>/dev/null
date -u >> "$OUT/info.txt"
