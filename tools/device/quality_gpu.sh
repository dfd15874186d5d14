#!/usr/bin/env bash
# Quality evaluation (docs/QUALITY.md) on the GPU device machine: SmolLM2-135M-Instruct, RULER-style tasks,
# every policy x allocation x budget, question-aware and question-agnostic.
#
# The device machine has no package registry and no model hub, and one call carries at most 64 MiB of
# working tree, so the 98 MB GGUF travels in two parts (< 64 MiB each) together with a `gguf` wheel, is
# joined and checksummed there, and converted there (transformers is in the GPU image; the gguf and
# accelerate wheels travel with the first part).
# vLLM itself travels as the split vLLM GPU bundle (.vg/p*, tools/device/README.md).
#
# Here (repo root, needs PyPI; once):
#     build the vLLM GPU bundle, then repack_bundle.py   # -> .vg/p1..pN (tools/device/README.md)
#     bash tools/device/quality_gpu.sh prepare              # -> .quality-gpu/part1, part2
# Remote commands, back to back (a machine goes back after ~30 s idle and after 30 minutes held; a fresh one
# needs all parts again, and the files of an unfinished run stay on the old one):
#     run(carry=[".vg/pK"], command="bash .vg/pK/stage.sh")                             # K = 1..N
#     run(carry=[".quality-gpu/part1"], command="bash tools/device/quality_gpu.sh stage .quality-gpu/part1")
#     run(carry=[".quality-gpu/part2"], command="bash tools/device/quality_gpu.sh stage .quality-gpu/part2; bash tools/device/quality_gpu.sh run")
#     run(command="bash tools/device/quality_gpu.sh run")   # repeat until it prints "quality: complete"
# The GGUF parts can also ride along with calls that carry nothing else (tools/device/device_calls.sh:
# STAGE_GGUF=.quality-gpu/partK), which saves the two staging calls.
#
# Needle accuracy at 10% with an fp8 KV cache against a bf16 cache, same samples (one call, ~200 s
# on a warm machine with the bundle and both GGUF parts staged):
#     run(command="bash tools/device/quality_gpu.sh needle-kv")
# It runs passkey, niah_single, niah_multikey and niah_multivalue at 4096 tokens, 24 samples each (seed 0, so
# the same prompts for both caches), question-aware, uniform, SnapKV / DropKV / KeyDiff at budget 0.1 and the
# full cache (1.0) as control: 96 samples x 4 settings = 384 requests per cache dtype, WORKERS=3 engines per
# dtype, all six at once. Tables: needle_kv_auto.* (bf16 cache: vLLM's default, the model dtype) and
# needle_kv_fp8.* (`vllm-evict eval --kv-cache-dtype fp8`). Back come $OUT/needle_kv.md (both tables)
# and $OUT/needle_kv.tgz (every table, request log and shard log). If it prints
# "incomplete", the same command again on the warm machine resumes both. KV_DTYPES picks the cache dtypes
# (default "auto fp8"), e.g. KV_DTYPES="auto int8_per_token_head int4_per_token_head" for vLLM's per-token-head
# caches (evicted through its Triton backend): WORKERS engines per dtype, so lower WORKERS for more dtypes.
# The same by hand:
#     KV_DTYPE=fp8 NAME=needle_kv_fp8 TASKS="passkey niah_single niah_multikey niah_multivalue" LENGTHS=4096 \
#       SAMPLES=24 VARIANTS=aware POLICIES="snapkv dropkv keydiff" ALLOCATIONS=uniform BUDGETS="0.1 1.0" \
#       WORKERS=3 CHUNK=4 bash tools/device/quality_gpu.sh run
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
# POLICIES ("core": the 9 policies of docs/DESIGN.md §4; "all" adds tova h2o knorm), BUDGETS ("0.05 0.1 0.2 0.4 1.0"),
# ALLOCATIONS ("uniform adakv"), KV_DTYPE (vLLM's default; "fp8": an fp8 e4m3 KV cache, give it its own NAME;
# a per-token-head cache takes ALLOCATIONS=uniform),
# VARIANTS ("aware agnostic"), EAGER (0; 1: no CUDA graphs, so no Triton compiles during graph capture: TurboQuant's
# took 150-200 s of an engine's start), CHUNK (1), STOP_AFTER (420), NAME (ruler_gpu), PREDICTIONS (0: the
# per-request log omits generated texts so that ruler_gpu_requests.jsonl.gz stays under the 16 MiB a file
# that can come back from the device; 1 keeps them).
# Cost: the defaults are about 2400 samples x 137 settings = 329K requests. On the H100 (2026-11-22,
# docs/QUALITY.md) 8 engines completed about 22 requests/s of a 4K grid, and 30 device-minutes
# held 33K requests: narrow TASKS / LENGTHS / VARIANTS to fit.
set -euo pipefail
cd "$(dirname "$0")/../.."
STAGE=/tmp/qgpu
WHEEL_REQ="gguf==0.19.0"
GGUF_NAME=SmolLM2-135M-Instruct.Q4_1.gguf
GGUF_SHA256=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
MODEL_DIR=$STAGE/models/SmolLM2-135M-Instruct
WORK=/tmp/quality

evict_cli() {  # from /tmp, as device_calls.sh starts engines: the checkout only through PYTHONPATH
  (cd /tmp && python3 -m vllm_evict.cli "$@")
}

setup_device() {  # device: vLLM bundle and GGUF staged; the plugin on the path; the HF model converted once
  [ -f "$STAGE/$GGUF_NAME" ] || { echo "GGUF missing: stage .quality-gpu/part1 and part2 first"; exit 2; }
  # vLLM from the bundle, and this checkout with a dist-info for its `vllm.general_plugins` entry point
  # shellcheck source=tools/device/device_env.sh
  source tools/device/device_env.sh || exit 2
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$STAGE/site" \
    "$STAGE"/gguf-*.whl "$STAGE"/accelerate-*.whl
  rm -rf "$STAGE/site/vllm_evict-0.1.0.dist-info"  # an older version of this script put a second one here
  # spawn: the runner touches CUDA before vLLM starts its engine-core process
  export PYTHONPATH=$PYTHONPATH:$STAGE/site VLLM_WORKER_MULTIPROC_METHOD=spawn
  evict_cli prepare-model --gguf "$STAGE/$GGUF_NAME" --cache-dir "$MODEL_DIR"
  mkdir -p "$WORK"
  pids=(); shard_logs=()
}

eval_args() {  # NAME KV_DTYPE ("" or auto: vLLM's default) -> the array `args`
  # shellcheck disable=SC2206
  args=(--model "$MODEL_DIR" --tasks ${TASKS:-passkey niah_single niah_multikey niah_multivalue vt cwe}
        --lengths ${LENGTHS:-1024 2048 4096 8192} --samples "${SAMPLES:-100}"
        --variants ${VARIANTS:-aware agnostic} --policies ${POLICIES:-core} --allocations ${ALLOCATIONS:-uniform adakv}
        --budgets ${BUDGETS:-0.05 0.1 0.2 0.4 1.0} --chunk-samples "${CHUNK:-1}"
        --out "$WORK" --name "$1" --resume)
  [ -z "$2" ] || [ "$2" = auto ] || args+=(--kv-cache-dtype "$2")
  [ "${PREDICTIONS:-0}" = 1 ] || args+=(--no-predictions)
  if [ "${EAGER:-0}" = 1 ]; then args+=(--enforce-eager); fi
}

launch() {  # NAME KV_DTYPE OFFSET: WORKERS engines in the background (`vllm-evict eval --shard k/WORKERS`)
  # WORKERS engines share the GPU to run more requests at once (docs/QUALITY.md has the rates measured),
  # each on every WORKERS-th sample index with its own compile caches and a fixed KV cache (no memory
  # profiling, which concurrent engines would disturb). OFFSET: engines already started by this call.
  eval_args "$1" "$2"
  local workers=${WORKERS:-6} k
  for k in $(seq 0 $((workers - 1))); do
    VLLM_CACHE_ROOT=/tmp/vllm-cache/$(($3 + k)) TRITON_CACHE_DIR=/tmp/triton-cache/$(($3 + k)) OMP_NUM_THREADS=2 \
      evict_cli eval "${args[@]}" --shard "$k/$workers" --stop-after "${STOP_AFTER:-420}" \
      --gpu-memory-utilization 0.05 --kv-cache-memory-bytes "${KV_BYTES:-6000000000}" \
      > "$WORK/$1.shard$k.log" 2>&1 &
    pids+=($!); shard_logs+=("$WORK/$1.shard$k.log")
  done
}

wait_shards() {  # 0: every shard finished; 3: some stopped at STOP_AFTER; 1: a shard failed
  local rc=0 i r
  for i in "${!pids[@]}"; do
    r=0; wait "${pids[$i]}" || r=$?
    if [ $r = 3 ]; then [ $rc = 1 ] || rc=3
    elif [ $r != 0 ]; then rc=1; echo "quality: ${shard_logs[$i]} failed (exit $r)"; fi
    { tr '\r' '\n' < "${shard_logs[$i]}" | grep -E "^\[eval\] .*(req/s|engine up)|Error" || true; } | tail -3 \
      | sed "s|^|[$(basename "${shard_logs[$i]}" .log)] |"
  done
  return $rc
}

merge() {  # NAME KV_DTYPE: one --report-only run merges the shards into the tables
  local r=0
  eval_args "$1" "$2"
  evict_cli eval "${args[@]}" --report-only > "$WORK/$1.merge.log" 2>&1 || r=$?
  tail -5 "$WORK/$1.merge.log"
  case $r in 0|3) return $r ;; *) return 1 ;; esac
}

finish() {  # the combined status: 0 complete, 3 incomplete (run again on the warm machine), else failed
  case $1 in
    0) echo "quality: complete" ;;
    3) echo "quality: incomplete; run the same command again on the warm machine" ;;
    *) echo "quality: eval failed (exit $1)"; exit "$1" ;;
  esac
}

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
  setup_device
  launch "${NAME:-ruler_gpu}" "${KV_DTYPE:-}" 0
  rc=0; wait_shards || rc=$?
  merge "${NAME:-ruler_gpu}" "${KV_DTYPE:-}" || { r=$?; if [ $r = 1 ] || [ $rc = 0 ]; then rc=$r; fi; }
  if [ -n "${OUT:-}" ]; then
    mkdir -p "$OUT/quality" && cp -f "$WORK"/* "$OUT/quality/"
  fi
  finish $rc
  ;;
needle-kv)  # device: the needle tasks at 10% on each KV-cache dtype of KV_DTYPES (default bf16 and fp8), same samples, at once
  # Both cache dtypes run side by side (WORKERS engines each), then merge into needle_kv_auto.* and
  # needle_kv_fp8.* (NAME_PREFIX). What comes back: $OUT/needle_kv.md with every dtype's table, and
  # $OUT/needle_kv.tgz with every table, request log and shard log.
  TASKS=${TASKS:-passkey niah_single niah_multikey niah_multivalue} LENGTHS=${LENGTHS:-4096} SAMPLES=${SAMPLES:-24}
  VARIANTS=${VARIANTS:-aware} POLICIES=${POLICIES:-snapkv dropkv keydiff} ALLOCATIONS=${ALLOCATIONS:-uniform}
  BUDGETS=${BUDGETS:-0.1 1.0} WORKERS=${WORKERS:-3} CHUNK=${CHUNK:-4} STOP_AFTER=${STOP_AFTER:-300}
  setup_device
  prefix=${NAME_PREFIX:-needle_kv}
  offset=0
  for kvd in ${KV_DTYPES:-auto fp8}; do
    launch "${prefix}_$kvd" "$kvd" "$offset"
    offset=$((offset + WORKERS))
  done
  rc=0; wait_shards || rc=$?
  for kvd in ${KV_DTYPES:-auto fp8}; do
    merge "${prefix}_$kvd" "$kvd" || { r=$?; if [ $r = 1 ] || [ $rc = 0 ]; then rc=$r; fi; }
  done
  if [ -n "${OUT:-}" ]; then
    for kvd in ${KV_DTYPES:-auto fp8}; do  # one file: a call returns few
      { echo "# KV cache dtype: $kvd"; cat "$WORK/${prefix}_$kvd.md" 2>/dev/null || echo "(no table)"; echo; }
    done > "$OUT/$prefix.md"
    tar -C "$WORK" -czf "$OUT/$prefix.tgz" .
  fi
  finish $rc
  ;;
*)
  sed -n '2,55p' "$0"; exit 2 ;;
esac
