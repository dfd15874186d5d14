"""`vllm-evict` command line: each subcommand lives in the module that owns it."""

from __future__ import annotations

import argparse
import importlib
import sys

# subcommand -> module exposing `register(subparsers)`; each registers a parser with `func=` set
SUBCOMMAND_MODULES = (
    "vllm_evict.server.cli",           # serve
    "vllm_evict.bench.eval_cli",       # eval
    "vllm_evict.bench.load",           # bench serve
    "vllm_evict.models",               # prepare-model
    "vllm_evict.testing.tiny_models",  # make-tiny
)
# subcommands whose arguments vLLM's own parser reads: name -> (module, function taking the argv)
PASSTHROUGH = {"serve": ("vllm_evict.server.cli", "serve"), "bench": ("vllm_evict.bench.load", "bench")}


def add_passthrough(subparsers, name: str, run, **parser_kwargs) -> None:
    """A subcommand whose arguments go, as they are, to `run(argv)`: vLLM's own parser reads them, and
    vLLM is imported only when the subcommand runs (main() dispatches these before argparse)."""
    p = subparsers.add_parser(name, add_help=False, **parser_kwargs)
    p.add_argument("argv", nargs=argparse.REMAINDER)
    p.set_defaults(func=lambda args: run(args.argv))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="vllm-evict", description=__doc__)
    subparsers = parser.add_subparsers(dest="command", required=True)
    for name in SUBCOMMAND_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name != name:
                raise
            continue  # subcommand not built yet
        module.register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] and argv[0] in PASSTHROUGH:  # dispatched before argparse, which cannot pass vLLM's flags on
        module, function = PASSTHROUGH[argv[0]]
        return getattr(importlib.import_module(module), function)(argv[1:])
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    raise SystemExit(main())
