# Source on the GPU device machine (repo root: `source tools/device/device_env.sh`) after staging the vLLM
# bundle (.vllm-gpu/part*, tools/device/README.md):
# puts vLLM, this checkout and a dist-info for the plugin's `vllm.general_plugins` entry point on the path
# (pip cannot install the package there: no registry).
[ -f /tmp/vsite/READY ] || { echo "vLLM bundle missing: stage .vllm-gpu/part* first (fresh machine?)"; return 2; }
_d=/tmp/vsite-evict/vllm_evict-0.1.0.dist-info
mkdir -p "$_d"
printf 'Metadata-Version: 2.1\nName: vllm-evict\nVersion: 0.1.0\n' > "$_d/METADATA"
printf '[vllm.general_plugins]\nvllm_evict = vllm_evict.engine.plugin:register\n' > "$_d/entry_points.txt"
# the package as pip installs it: kernels/ and server/ of the checkout as vllm_evict.kernels / .server
_p=/tmp/vsite-evict/vllm_evict
rm -rf "$_p" && mkdir -p "$_p" && ln -s "$PWD"/vllm_evict/* "$_p"/ && ln -s "$PWD/kernels" "$PWD/server" "$_p"/
export PYTHONPATH=/tmp/vsite-evict:$PWD:/tmp/vsite:${PYTHONPATH:-} VLLM_USE_V2_MODEL_RUNNER=0 \
  VLLM_USE_FLASHINFER_SAMPLER=0 PYTHONUNBUFFERED=1
