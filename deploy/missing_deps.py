"""Print the requirements of an installed distribution that the current environment does not satisfy.

Used by deploy/Dockerfile after `pip install --no-deps .` on top of the vLLM image: the image already has
vLLM's whole stack (torch, fastapi, transformers, ...), so only what is really missing gets installed.

    python3 missing_deps.py vllm-evict            # one requirement per line (empty: nothing missing)
    python3 missing_deps.py vllm-evict --check    # exit 1 (and list them on stderr) if anything is missing

torch is never printed for installation: replacing the image's CUDA build of torch would break vLLM, so an
unsatisfied torch requirement is an error (exit 2) instead.
"""

from __future__ import annotations

import sys
from importlib import metadata

from packaging.markers import default_environment
from packaging.requirements import Requirement

NEVER_INSTALL = {"torch"}


class IncompatibleBaseImage(RuntimeError):
    pass


def unsatisfied(requirements: list[str]) -> list[str]:
    """The requirement strings (markers evaluated without extras) not met by installed distributions."""
    env = {**default_environment(), "extra": ""}
    out = []
    for spec in requirements:
        req = Requirement(spec)
        if req.marker is not None and not req.marker.evaluate(env):
            continue
        try:
            version = metadata.version(req.name)
        except metadata.PackageNotFoundError:
            version = None
        ok = version is not None and req.specifier.contains(version, prereleases=True)
        if ok:
            continue
        if req.name.lower() in NEVER_INSTALL:
            raise IncompatibleBaseImage(f"{req} is required but the image has {req.name} {version}; "
                                        "refusing to replace it (use the matching vllm/vllm-openai tag)")
        out.append(str(req).split(";")[0].strip())
    return out


def main(argv: list[str]) -> int:
    args = [a for a in argv if not a.startswith("--")]
    dist = args[0] if args else "vllm-evict"
    try:
        missing = unsatisfied(metadata.requires(dist) or [])
    except IncompatibleBaseImage as exc:
        print(f"missing_deps: {exc}", file=sys.stderr)
        return 2
    if "--check" in argv:
        if missing:
            print("missing_deps: still unsatisfied: " + ", ".join(missing), file=sys.stderr)
            return 1
        print(f"missing_deps: every requirement of {dist} is satisfied", file=sys.stderr)
        return 0
    for line in missing:
        print(line)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
