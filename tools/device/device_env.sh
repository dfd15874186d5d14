# Source on the GPU device machine (repo root: `source tools/device/device_env.sh`) after staging the vLLM
# bundle (.vg/p*, tools/device/README.md):
# puts vLLM, this checkout and a dist-info for the plugin's `vllm.general_plugins` entry point on the path
# (pip cannot install the package there: no registry).
[ -f /tmp/vsite/READY ] || { echo "vLLM bundle missing: stage .vg/p* first (fresh machine?)"; return 2; }
_d=/tmp/vsite-evict/vllm_evict-0.1.0.dist-info
mkdir -p "$_d"
printf 'Metadata-Version: 2.1\nName: vllm-evict\nVersion: 0.1.0\n' > "$_d/METADATA"
printf '[vllm.general_plugins]\nvllm_evict = vllm_evict.engine.plugin:register\n' > "$_d/entry_points.txt"
export PYTHONPATH=/tmp/vsite-evict:$PWD:/tmp/vsite:${PYTHONPATH:-} VLLM_USE_V2_MODEL_RUNNER=0 \
  VLLM_USE_FLASHINFER_SAMPLER=0 PYTHONUNBUFFERED=1
