#!/usr/bin/env bash
# Quality evaluation (docs/QUALITY.md) on the GPU device machine: SmolLM2-135M-Instruct, RULER-style tasks,
# every policy x allocation x budget, question-aware and question-agnostic.
#
# The device machine has no package registry and no model hub, and one call carries at most 64 MiB of
# working tree, so the 98 MB GGUF travels in two parts (< 64 MiB each) together with a `gguf` wheel, is
# joined and checksummed there, and converted there (transformers is in the GPU image; the gguf and
# accelerate wheels travel with the first part).
# vLLM itself travels as the split bundle of ../shared/gpu/build_vllm_bundle.sh.
#
# Here (repo root, needs PyPI; once):
#     bash ../shared/gpu/build_vllm_bundle.sh              # -> .vllm-gpu/part1..N
#     bash benchmarks/quality_gpu.sh prepare              # -> .quality-gpu/part1, part2
# Device calls, back to back (a machine goes back after ~30 s idle and after 30 minutes held; a fresh one
# needs all parts again, and the files of an unfinished run stay on the old one):
#     run(carry=[".vllm-gpu/partK"], command="bash .vllm-gpu/partK/stage.sh")            # K = 1..N
#     run(carry=[".quality-gpu/part1"], command="bash benchmarks/quality_gpu.sh stage .quality-gpu/part1")
#     run(carry=[".quality-gpu/part2"], command="bash benchmarks/quality_gpu.sh stage .quality-gpu/part2; bash benchmarks/quality_gpu.sh run")
#     run(command="bash benchmarks/quality_gpu.sh run")   # repeat until it prints "quality: complete"
# Each `run` starts WORKERS engines (`vllm-evict eval --shard k/WORKERS`), each of which starts no new
# generate call after STOP_AFTER seconds; then one `--report-only` run merges the shards and writes the
# (partial) tables to $OUT/quality/. The next `run` resumes from /tmp/quality on the same warm machine; to
# go on on a fresh machine, copy a returned ruler_gpu_requests.jsonl.gz into /tmp/quality/ first.
# A call takes about STOP_AFTER + 150 s (engine start inside STOP_AFTER; one block of ~100 s and the
# merge after it): keep STOP_AFTER <= 435 under the 600-s command limit.
# Each generate call of a shard holds CHUNK sample indices of every task and length, so a run that stops
# early still fills every cell, with fewer samples (status "incomplete (k/N)" in the tables).
# Copy $OUT/quality/* into docs/quality/ and commit ruler_gpu.{csv,json,md,png,_summary.csv}.
#
# Knobs (environment): WORKERS (6 engines sharing the GPU; KV_BYTES of KV cache each, default 6e9),
# SAMPLES (100 per task x length), LENGTHS ("1024 2048 4096 8192"), TASKS (all),
# POLICIES ("core": the 9 SPEC policies; "all" adds tova h2o knorm), BUDGETS ("0.05 0.1 0.2 0.4 1.0"),
# VARIANTS ("aware agnostic"), CHUNK (1), STOP_AFTER (420), NAME (ruler_gpu), PREDICTIONS (0: the
# per-request log omits generated texts so that ruler_gpu_requests.jsonl.gz stays under the 16 MiB a file
# that can come back from the device; 1 keeps them).
# Cost: the defaults are about 2400 samples x 137 settings = 329K requests. On the H100 (2026-11-22,
# docs/QUALITY.md) 8 engines completed about 22 requests/s of a 4K grid, and one session's 30
# device-minutes held 33K requests: narrow TASKS / LENGTHS / VARIANTS to fit.
set -euo pipefail
cd "$(dirname "$0")/.."
STAGE=/tmp/qgpu
WHEEL_REQ="gguf==0.19.0"
GGUF_NAME=SmolLM2-135M-Instruct.Q4_1.gguf
GGUF_SHA256=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
MODEL_DIR=$STAGE/models/SmolLM2-135M-Instruct
WORK=/tmp/quality

cmd=${1:-}
case "$cmd" in
prepare)  # here: split the GGUF into two parts, fetch the gguf wheel (pure Python)
  PY=${PYTHON:-.venv/bin/python}
  grep -qx '/.quality-gpu/' .git/info/exclude 2>/dev/null || echo '/.quality-gpu/' >> .git/info/exclude
  src=$("$PY" -c "
import sys
from vllm_evict.models import locate_gguf, check_gguf
p = locate_gguf(); check_gguf(p); print(p)")
  rm -rf .quality-gpu && mkdir -p .quality-gpu/part1 .quality-gpu/part2
  half=$(( ($(stat -c %s "$src") + 1) / 2 ))
  head -c "$half" "$src" > .quality-gpu/part1/gguf.part1
  tail -c +"$((half + 1))" "$src" > .quality-gpu/part2/gguf.part2
  # accelerate: transformers' GGUF loader needs it and the GPU image may lack it (pure Python, no deps taken)
  "$PY" -m pip download -q --no-deps --only-binary=:all: -d .quality-gpu/part1 "$WHEEL_REQ" \
    "accelerate==$("$PY" -c 'import accelerate; print(accelerate.__version__)')"
  du -sh .quality-gpu/part*
  ;;
stage)    # device: keep this part in $STAGE; join once both are there
  part=${2:?usage: stage .quality-gpu/partN}
  mkdir -p "$STAGE"
  cp -f "$part"/* "$STAGE"/
  if [ -f "$STAGE/gguf.part1" ] && [ -f "$STAGE/gguf.part2" ]; then
    cat "$STAGE/gguf.part1" "$STAGE/gguf.part2" > "$STAGE/$GGUF_NAME"
    echo "$GGUF_SHA256  $STAGE/$GGUF_NAME" | sha256sum -c -
  else
    echo "quality: staged $part; waiting for the other GGUF part"
  fi
  ;;
run)      # device: convert (once per machine), then evaluate for at most STOP_AFTER seconds
  [ -f /tmp/vsite/READY ] || { echo "vLLM bundle missing: stage .vllm-gpu/part* first (fresh machine?)"; exit 2; }
  [ -f "$STAGE/$GGUF_NAME" ] || { echo "GGUF missing: stage .quality-gpu/part1 and part2 first"; exit 2; }
  export PYTHONPATH=/tmp/vsite:${PYTHONPATH:-} VLLM_USE_V2_MODEL_RUNNER=0 VLLM_USE_FLASHINFER_SAMPLER=0
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$STAGE/site" \
    "$STAGE"/gguf-*.whl "$STAGE"/accelerate-*.whl
  # vllm-evict from this checkout, plus a dist-info so that vLLM finds its `vllm.general_plugins` entry point
  mkdir -p "$STAGE/site/vllm_evict-0.1.0.dist-info"
  printf 'Metadata-Version: 2.1\nName: vllm-evict\nVersion: 0.1.0\n' > "$STAGE/site/vllm_evict-0.1.0.dist-info/METADATA"
  printf '[vllm.general_plugins]\nvllm_evict = vllm_evict.engine.plugin:register\n' \
    > "$STAGE/site/vllm_evict-0.1.0.dist-info/entry_points.txt"
  # spawn: the runner touches CUDA before vLLM starts its engine-core process
  export PYTHONPATH=$PWD:$STAGE/site:$PYTHONPATH PYTHONUNBUFFERED=1 VLLM_WORKER_MULTIPROC_METHOD=spawn
  python3 -m vllm_evict.cli prepare-model --gguf "$STAGE/$GGUF_NAME" --cache-dir "$MODEL_DIR"
  # shellcheck disable=SC2206
  args=(--model "$MODEL_DIR" --tasks ${TASKS:-passkey niah_single niah_multikey niah_multivalue vt cwe}
        --lengths ${LENGTHS:-1024 2048 4096 8192} --samples "${SAMPLES:-100}"
        --variants ${VARIANTS:-aware agnostic} --policies ${POLICIES:-core} --allocations uniform adakv
        --budgets ${BUDGETS:-0.05 0.1 0.2 0.4 1.0} --chunk-samples "${CHUNK:-1}"
        --out "$WORK" --name "${NAME:-ruler_gpu}" --resume)
  [ "${PREDICTIONS:-0}" = 1 ] || args+=(--no-predictions)
  # WORKERS engines share the GPU to run more requests at once (docs/QUALITY.md has the rates measured),
  # each on every WORKERS-th sample index with its own compile caches and a fixed KV cache (no memory
  # profiling, which concurrent engines would disturb).
  workers=${WORKERS:-6}
  mkdir -p "$WORK"
  pids=()
  for k in $(seq 0 $((workers - 1))); do
    VLLM_CACHE_ROOT=/tmp/vllm-cache/$k TRITON_CACHE_DIR=/tmp/triton-cache/$k OMP_NUM_THREADS=2 \
      python3 -m vllm_evict.cli eval "${args[@]}" --shard "$k/$workers" --stop-after "${STOP_AFTER:-420}" \
      --gpu-memory-utilization 0.05 --kv-cache-memory-bytes "${KV_BYTES:-6000000000}" \
      > "$WORK/shard$k.log" 2>&1 &
    pids+=($!)
  done
  rc=0
  for k in "${!pids[@]}"; do
    wait "${pids[$k]}" || { r=$?; [ $r = 3 ] && rc=3 || { rc=1; echo "quality: shard $k failed (exit $r)"; }; }
    { tr '\r' '\n' < "$WORK/shard$k.log" | grep -E "^\[eval\] .*(req/s|engine up)|Error" || true; } | tail -3 \
      | sed "s/^/[shard $k] /"
  done
  set +e
  python3 -m vllm_evict.cli eval "${args[@]}" --report-only > "$WORK/merge.log" 2>&1
  merge_rc=$?
  set -e
  tail -5 "$WORK/merge.log"
  [ $merge_rc = 0 ] || [ $merge_rc = 3 ] || rc=1
  [ $rc != 0 ] || [ $merge_rc != 3 ] || rc=3
  if [ -n "${OUT:-}" ]; then
    mkdir -p "$OUT/quality" && cp -f "$WORK"/* "$OUT/quality/"
  fi
  case $rc in
    0) echo "quality: complete" ;;
    3) echo "quality: incomplete; run 'bash benchmarks/quality_gpu.sh run' again on the warm machine" ;;
    *) echo "quality: eval failed (exit $rc)"; exit $rc ;;
  esac
  ;;
*)
  sed -n '2,32p' "$0"; exit 2 ;;
esac
