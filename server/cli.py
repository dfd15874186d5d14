"""`vllm-evict serve [MODEL] [vLLM engine flags] [--default-eviction-*] [--host --port --api-key]`.

All of vLLM's engine flags (`AsyncEngineArgs.add_cli_args`) are accepted. They are added lazily, only
when `serve` is the chosen subcommand (or its help is shown), so other `vllm-evict` subcommands do not
pay for importing vLLM. Only the engine flags the user actually set are forwarded to
`vllm_evict.engine.engine_kwargs`, plus CPU defaults (float32, a 1 GiB KV cache) where unset.
Without MODEL the tiny local test model (`vllm_evict.testing.tiny_models`) is served as `tiny-llama`.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import Any

TINY_MODEL_NAME = "tiny-llama"
CPU_KV_CACHE_BYTES = 1 << 30

# our own (non-engine) options: dest names
_SERVER_DESTS = {"model_tag", "host", "port", "api_key", "default_eviction_policy", "default_eviction_budget",
                 "default_eviction_allocation", "log_level", "root_path", "func", "command"}


class _LazyEngineArgs:
    """Adds vLLM's engine flags the first time the parser parses or prints help.

    Until then the parser is a plain `argparse.ArgumentParser` (building the `vllm-evict` parser must not
    import vLLM); on first use it becomes a vLLM `FlexibleArgumentParser` (needed by `add_cli_args`).
    """

    def _ensure_engine_args(self) -> None:
        if getattr(self, "_engine_args_added", False):
            return
        self._engine_args_added = True
        try:
            from vllm.utils.argparse_utils import FlexibleArgumentParser, SortedHelpFormatter
        except ImportError:  # vLLM missing: serve() reports it; --help still works
            return
        if not isinstance(self, FlexibleArgumentParser):
            self.__class__ = _flexible_serve_parser(FlexibleArgumentParser)
            self.add_json_tip = True
            self.formatter_class = SortedHelpFormatter
        add_engine_args(self)

    def parse_known_args(self, args=None, namespace=None):
        self._ensure_engine_args()
        return super().parse_known_args(args, namespace)

    def format_help(self):
        self._ensure_engine_args()
        return super().format_help()


class ServeParser(_LazyEngineArgs, argparse.ArgumentParser):
    pass


_FLEXIBLE_CLASS: list[type] = []


def _flexible_serve_parser(base: type) -> type:
    if not _FLEXIBLE_CLASS:
        _FLEXIBLE_CLASS.append(type("FlexibleServeParser", (_LazyEngineArgs, base), {}))
    return _FLEXIBLE_CLASS[0]


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    from vllm.engine.arg_utils import AsyncEngineArgs

    AsyncEngineArgs.add_cli_args(parser)


def add_server_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                   help="HF model directory or name; default: the tiny local test model")
    g = p.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1)")
    g.add_argument("--port", type=int, default=8000)
    g.add_argument("--api-key", default=os.environ.get("VLLM_EVICT_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on /v1/* (env VLLM_EVICT_API_KEY)")
    g.add_argument("--root-path", default=None, help="ASGI root_path behind a proxy")
    g.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    e = p.add_argument_group("eviction defaults (used when a request has no `eviction` object or omits keys)")
    e.add_argument("--default-eviction-policy", default=None,
                   help="policy name, e.g. snapkv, dropkv; 'none' disables (default: no eviction)")
    e.add_argument("--default-eviction-budget", default=None,
                   help="ratio in (0, 1] like 0.1, or a token count like 2048")
    e.add_argument("--default-eviction-allocation", default=None, help="uniform | adakv")


def register(subparsers) -> None:
    parser_class = ServeParser
    previous = getattr(subparsers, "_parser_class", None)
    try:
        subparsers._parser_class = parser_class  # the serve parser must accept vLLM's flag syntax
        p = subparsers.add_parser("serve", help="OpenAI-compatible server with per-request KV-cache eviction",
                                  description=__doc__)
    finally:
        if previous is not None:
            subparsers._parser_class = previous
    add_server_args(p)
    p.set_defaults(func=serve, _parser=p)


def build_parser() -> argparse.ArgumentParser:
    """Stand-alone parser (same flags as `vllm-evict serve`)."""
    p = ServeParser(prog="vllm-evict serve", description=__doc__)
    add_server_args(p)
    p.set_defaults(func=serve, _parser=p)
    return p


def _user_engine_kwargs(args: argparse.Namespace, parser: argparse.ArgumentParser) -> dict[str, Any]:
    """Engine flags whose value differs from the parser default (i.e. set by the user)."""
    import dataclasses

    from vllm.engine.arg_utils import AsyncEngineArgs

    fields = {f.name for f in dataclasses.fields(AsyncEngineArgs)}
    out = {}
    for dest, value in vars(args).items():
        if dest in _SERVER_DESTS or dest.startswith("_") or dest not in fields:
            continue
        if value != parser.get_default(dest):
            out[dest] = value
    return out


def resolve_engine_config(args: argparse.Namespace, parser: argparse.ArgumentParser) -> tuple[str, dict, list[str]]:
    """(model, engine kwargs, served model names) for a parsed `serve` command line."""
    kwargs = _user_engine_kwargs(args, parser)
    model = args.model_tag or kwargs.pop("model", None)
    kwargs.pop("model", None)
    names = list(kwargs.get("served_model_name") or [])
    tiny = model is None
    if tiny:
        from vllm_evict.testing.tiny_models import ensure_tiny_model

        model = str(ensure_tiny_model("llama"))
        if not names:
            names = [TINY_MODEL_NAME]
            kwargs["served_model_name"] = names
        kwargs.setdefault("max_model_len", 2048)
    if not names:
        names = [str(model)]
    if _on_cpu():
        if kwargs.get("dtype", "auto") == "auto":
            kwargs["dtype"] = "float32"  # bf16 takes slow fallback paths on most CPUs
        if "kv_cache_memory_bytes" not in kwargs and not os.environ.get("VLLM_CPU_KVCACHE_SPACE"):
            kwargs["kv_cache_memory_bytes"] = CPU_KV_CACHE_BYTES
        if tiny:
            kwargs.setdefault("block_size", 16)
    return str(model), kwargs, names


def _on_cpu() -> bool:
    try:
        from vllm.platforms import current_platform

        return bool(current_platform.is_cpu())
    except Exception:  # pragma: no cover
        return False


def serve(args: argparse.Namespace) -> int:
    import uvicorn

    from server import eviction as ev
    from server.app import build_engine_args, create_app, create_engine

    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(asctime)s %(name)s: %(message)s")
    parser = getattr(args, "_parser", None) or build_parser()
    try:
        defaults = ev.build_defaults(args.default_eviction_policy, args.default_eviction_budget,
                                     args.default_eviction_allocation)
        if defaults.get("policy") == "none":
            defaults = {}
        ev.validate_defaults(defaults)
    except ValueError as exc:
        print(f"vllm-evict serve: invalid --default-eviction-*: {exc}", file=sys.stderr)
        return 2
    model, kwargs, names = resolve_engine_config(args, parser)
    engine_args = build_engine_args(model, **kwargs)
    app = create_app(engine_factory=lambda metrics: create_engine(engine_args, metrics),
                     served_model_names=names, api_key=args.api_key, eviction_defaults=defaults)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level, root_path=args.root_path or "",
                timeout_keep_alive=5)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    raise SystemExit(main())
