"""Re-pack the vLLM GPU bundle into parts that fit one device call beside the tracked tree, FlashAttention 2
included (TurboQuant caches need it), with one stage script.

The bundle builder's parts are about 58 MB each; a call carries at most 64 MiB with the tree, which is now about
14 MB. This script takes the builder's work directory (its wheels, vllm-py.tar.xz and the compressed .so files,
`/tmp/vllm-gpu-build` by default) and writes OUT/p1 ... pN of at most --part-bytes, the large files split into
pieces. On the device machine, one call per part, back to back (`carry=[".vg/pK"]`):

    bash .vg/pK/stage.sh

The last part to arrive installs vLLM into /tmp/vsite and writes /tmp/vsite/READY, as the builder's own
stage scripts do (tools/device/device_env.sh checks it).

usage: python tools/device/repack_bundle.py [--build /tmp/vllm-gpu-build] [--out .vg] [--part-bytes 49000000]
"""

from __future__ import annotations

import argparse
import glob
import os
import shutil
import subprocess
import zipfile
from pathlib import Path

STAGE = """#!/usr/bin/env bash
# Device side: keep this part in /tmp/vbundle; once every part has arrived, install vLLM (with FlashAttention 2
# and 3) into /tmp/vsite.
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
mkdir -p /tmp/vbundle
cp -f "$HERE"/* /tmp/vbundle/
touch "/tmp/vbundle/.have-$(basename "$HERE")"
need=$(cat "$HERE/PARTS"); have=$(ls /tmp/vbundle/.have-p* | wc -l)
echo "vllm bundle: $have of $need parts on this machine"
[ "$have" -lt "$need" ] && exit 0
[ -f /tmp/vsite/READY ] && { echo "already installed in /tmp/vsite"; exit 0; }
cd /tmp/vbundle
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/vsite ./*.whl
tar -C /tmp/vsite -xJf vllm-py.tar.xz
cat C.xz.* | xz -dc > /tmp/vsite/vllm/_C_stable_libtorch.abi3.so
xz -dc _vllm_fa3_C.abi3.so.xz > /tmp/vsite/vllm/vllm_flash_attn/_vllm_fa3_C.abi3.so
cat fa2.xz.* | xz -dc > /tmp/vsite/vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so
PYTHONPATH=/tmp/vsite python3 -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)"
touch /tmp/vsite/READY
"""


def split(path: Path, prefix: Path, piece: int) -> None:
    """path cut into prefix.aa, prefix.ab, ... of at most `piece` bytes (as `split -b` names them)."""
    with open(path, "rb") as f:
        for i, chunk in enumerate(iter(lambda: f.read(piece), b"")):
            Path(f"{prefix}.{chr(97 + i // 26)}{chr(97 + i % 26)}").write_bytes(chunk)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--build", default="/tmp/vllm-gpu-build", help="the bundle builder's work directory")
    ap.add_argument("--out", default=".vg")
    ap.add_argument("--part-bytes", type=int, default=49_000_000)
    args = ap.parse_args()
    build, out = Path(args.build), Path(args.out)
    staging = out / "files"
    shutil.rmtree(out, ignore_errors=True)
    staging.mkdir(parents=True)
    for wheel in glob.glob(str(build / "deps" / "*.whl")):
        shutil.copy(wheel, staging)
    for name in ("vllm-py.tar.xz", "_vllm_fa3_C.abi3.so.xz"):
        shutil.copy(build / name, staging)
    piece = args.part_bytes // 2
    split(build / "_C_stable_libtorch.abi3.so.xz", staging / "C.xz", piece)
    fa2 = build / "_vllm_fa2_C.abi3.so.xz"
    if not fa2.exists():  # FlashAttention 2 from the builder's vLLM wheel, compressed once
        wheel = glob.glob(str(build / "vllm-*.whl"))[0]
        with zipfile.ZipFile(wheel) as z, open(fa2, "wb") as f:
            data = z.read("vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so")
            f.write(subprocess.run(["xz", "-T0", "-9", "-c"], input=data, capture_output=True, check=True).stdout)
    split(fa2, staging / "fa2.xz", piece)
    parts: list[list] = []  # first fit, largest files first
    for f in sorted(staging.iterdir(), key=lambda p: -p.stat().st_size):
        size = f.stat().st_size
        part = next((p for p in parts if p[0] + size <= args.part_bytes), None)
        if part is None:
            part = [0, []]
            parts.append(part)
        part[0] += size
        part[1].append(f)
    for k, (size, files) in enumerate(parts, 1):
        d = out / f"p{k}"
        d.mkdir()
        for f in files:
            shutil.move(f, d / f.name)
        (d / "PARTS").write_text(str(len(parts)))
        (d / "stage.sh").write_text(STAGE)
        os.chmod(d / "stage.sh", 0o755)
        print(f"{d}: {size / 1e6:.1f} MB, {len(files)} files")
    staging.rmdir()


if __name__ == "__main__":
    main()
