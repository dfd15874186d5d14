"""OpenAI-compatible FastAPI app on vLLM 0.26's `AsyncLLM` with per-request KV-cache eviction.

`create_app(engine=...)` serves an already-built engine (anything with AsyncLLM's `generate`, `abort`,
`get_tokenizer`, `model_config`, `check_health`); `create_app(engine_factory=...)` builds it in the
app's lifespan (inside the server's event loop) and shuts it down on exit. `build_engine_args` /
`create_engine` make the real engine from `vllm_evict.engine.engine_kwargs` with our stat logger.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import REGISTRY, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

from server import eviction as ev
from server.metrics import ServerMetrics, make_stat_logger_factory
from server.protocol import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionChoice,
    CompletionChunk,
    CompletionRequest,
    CompletionResponse,
    DeltaMessage,
    ModelCard,
    ModelList,
    ResponseMessage,
    SamplingFields,
    Usage,
    random_id,
)

logger = logging.getLogger("vllm_evict.server")

# fields of the OpenAI schema that this server accepts but does not act on (no effect on the output)
_IGNORED_OK = {"user", "metadata", "store", "service_tier", "parallel_tool_calls", "reasoning_effort",
               "modalities", "tool_choice"}


# ------------------------------------------------------------------------------------------- errors
class APIError(Exception):
    """An error answered as OpenAI error JSON."""

    def __init__(self, status: int, message: str, *, type: str | None = None, param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status = int(status)
        self.message = message
        self.type = type or ("invalid_request_error" if status < 500 else "server_error")
        self.param = param
        self.code = code


def error_json(status: int, message: str, *, type: str | None = None, param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message,
                      "type": type or ("invalid_request_error" if status < 500 else "server_error"),
                      "param": param, "code": code}}


class _ClientGone(Exception):
    pass


# ------------------------------------------------------------------------------------------- engine
def build_engine_args(model: str, **overrides: Any):
    """`AsyncEngineArgs` with the eviction plugin's engine kwargs (user overrides win where allowed)."""
    from vllm.engine.arg_utils import AsyncEngineArgs

    from vllm_evict.engine import engine_kwargs

    return AsyncEngineArgs(**engine_kwargs(model=str(model), **overrides))


def create_engine(engine_args: Any, metrics: ServerMetrics):
    """vLLM's `AsyncLLM` with our Prometheus stat logger attached."""
    from vllm.usage.usage_lib import UsageContext
    from vllm.v1.engine.async_llm import AsyncLLM

    return AsyncLLM.from_engine_args(engine_args, usage_context=UsageContext.OPENAI_API_SERVER,
                                     stat_loggers=[make_stat_logger_factory(metrics)])


# ------------------------------------------------------------------------------------------- state
@dataclass
class ServerState:
    engine: Any
    model_names: list[str]
    metrics: ServerMetrics
    eviction_defaults: dict[str, Any] = field(default_factory=dict)
    api_key: str | None = None
    max_model_len: int = 0
    tokenizer: Any = None
    vocab_limit: int | None = None
    log_stats_interval_s: float | None = 10.0

    def bind_engine(self, engine: Any) -> None:
        self.engine = engine
        model_config = engine.model_config
        self.max_model_len = int(model_config.max_model_len)
        self.tokenizer = engine.get_tokenizer()
        limits = []
        with contextlib.suppress(Exception):
            limits.append(int(model_config.get_vocab_size()) - 1)
        with contextlib.suppress(Exception):
            limits.append(int(self.tokenizer.max_token_id))
        self.vocab_limit = max(limits) if limits else None
        if not self.model_names:
            self.model_names = [str(getattr(model_config, "served_model_name", None) or model_config.model)]


# ------------------------------------------------------------------------------------------- helpers
def _sse(obj: Any) -> str:
    if hasattr(obj, "model_dump_json"):
        return f"data: {obj.model_dump_json(exclude_unset=False)}\n\n"
    return f"data: {json.dumps(obj)}\n\n"


async def _wait_disconnect(raw: Request) -> None:
    while True:
        message = await raw.receive()
        if message["type"] == "http.disconnect":
            return


async def _merge(gens: list[AsyncIterator[Any]]) -> AsyncIterator[tuple[int, Any]]:
    """Interleave several async iterators, yielding (source index, item)."""
    if len(gens) == 1:
        async with contextlib.aclosing(gens[0]) as gen:
            async for item in gen:
                yield 0, item
        return
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(i: int, gen: AsyncIterator[Any]) -> None:
        try:
            async for item in gen:
                await queue.put((i, item))
            await queue.put((i, done))
        except Exception as exc:  # noqa: BLE001 - forwarded to the consumer
            await queue.put((i, exc))

    tasks = [asyncio.ensure_future(pump(i, g)) for i, g in enumerate(gens)]
    try:
        remaining = len(gens)
        while remaining:
            i, item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()  # cancels the engine generators -> vLLM aborts their requests


class _Sequences:
    """The engine requests behind one API request: one per (prompt, sample) with n=1 each.

    The server fans `n` out itself (child seeds `seed + i`, as vLLM's parallel sampling does) rather than
    using vLLM's n>1: vLLM merges the children's outputs and keeps only the last child's
    `kv_transfer_params`, which would lose the per-sequence eviction reports.
    """

    def __init__(self, request_id: str, prompts: list[tuple[list[int], str | None]], n: int):
        self.n = n
        self.prompt_lens = [len(ids) for ids, _ in prompts]
        self.prompts = [p for p in prompts for _ in range(n)]  # sequence k -> prompt k // n
        total = len(self.prompts)
        self.request_ids = [request_id] if total == 1 else [f"{request_id}-{k}" for k in range(total)]
        self.texts = [""] * total
        self.tokens = [0] * total
        self.finish: list[str | None] = [None] * total
        self.reports: dict[int, dict[str, Any]] = {}

    def __len__(self) -> int:
        return len(self.texts)

    def update(self, k: int, out: Any) -> tuple[str, str | None]:
        """Apply one RequestOutput (DELTA) of sequence k; return (new text, finish reason if it just ended)."""
        from vllm_evict.engine import eviction_report

        text, finished_now = "", None
        for c in out.outputs:
            text += c.text
            self.texts[k] += c.text
            self.tokens[k] += len(c.token_ids)
            if c.finish_reason is not None and self.finish[k] is None:
                self.finish[k] = finished_now = _finish_reason(c.finish_reason)
        if (out.finished or finished_now is not None) and k not in self.reports:
            try:
                report = eviction_report(out)
            except Exception:  # noqa: BLE001 - a broken report must not fail the request
                logger.exception("eviction_report failed for %s", out.request_id)
                report = None
            if report:
                self.reports[k] = report
        return text, finished_now

    def usage(self, cfg: Any) -> Usage:
        prompt = sum(self.prompt_lens)
        completion = sum(self.tokens)
        reports = [self.reports[k] for k in sorted(self.reports)]
        return Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
                     eviction=ev.usage_block(cfg, reports, num_sequences=len(self.texts)))


def _finish_reason(reason: Any) -> str:
    r = str(reason).lower()
    if r.startswith("finishreason."):
        r = r.split(".", 1)[1]
    return {"abort": "stop", "error": "stop"}.get(r, r)


# ------------------------------------------------------------------------------------------- app
def create_app(
    engine: Any = None,
    *,
    engine_factory: Callable[[ServerMetrics], Any] | None = None,
    served_model_names: list[str] | None = None,
    api_key: str | None = None,
    eviction_defaults: dict[str, Any] | None = None,
    metrics: ServerMetrics | None = None,
    log_stats_interval_s: float | None = 10.0,
) -> FastAPI:
    if engine is None and engine_factory is None:
        raise ValueError("create_app needs an engine or an engine_factory")
    metrics = metrics or ServerMetrics()
    defaults = dict(eviction_defaults or {})
    ev.validate_defaults(defaults)  # fail at startup, not on the first request
    state = ServerState(engine=None, model_names=list(served_model_names or []), metrics=metrics,
                        eviction_defaults=defaults, api_key=api_key or None,
                        log_stats_interval_s=log_stats_interval_s)
    owns_engine = engine is None

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        eng = engine if engine is not None else engine_factory(metrics)
        state.bind_engine(eng)
        stats_task = None
        if state.log_stats_interval_s and hasattr(eng, "do_log_stats"):
            async def _log_stats():
                while True:
                    await asyncio.sleep(state.log_stats_interval_s)
                    with contextlib.suppress(Exception):
                        await eng.do_log_stats()
            stats_task = asyncio.create_task(_log_stats())
        logger.info("serving %s (max_model_len=%d) eviction defaults=%s", state.model_names,
                    state.max_model_len, defaults or None)
        try:
            yield
        finally:
            if stats_task is not None:
                stats_task.cancel()
            if owns_engine:
                with contextlib.suppress(Exception):
                    eng.shutdown()

    app = FastAPI(title="vllm-evict", version=_version(), lifespan=lifespan)
    app.state.server = state
    app.add_middleware(_AuthMiddleware, state=state)

    # ----------------------------------------------------------------------------- error handlers
    def _err(status: int, message: str, **kw: Any) -> JSONResponse:
        metrics.observe_error(status)
        return JSONResponse(error_json(status, message, **kw), status_code=status)

    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError):
        return _err(exc.status, exc.message, type=exc.type, param=exc.param, code=exc.code)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, exc: RequestValidationError):
        errors = exc.errors()
        first = errors[0] if errors else {}
        loc = [str(p) for p in first.get("loc", ()) if p != "body"]
        if first.get("type") == "json_invalid":
            return _err(400, "We could not parse the JSON body of your request: "
                             f"{first.get('ctx', {}).get('error', 'invalid JSON')}", code="invalid_json")
        param = ".".join(loc) or None
        msgs = []
        for e in errors[:5]:
            where = ".".join(str(p) for p in e.get("loc", ()) if p != "body")
            msgs.append(f"{where}: {e.get('msg')}" if where else str(e.get("msg")))
        return _err(400, "Invalid request: " + "; ".join(msgs), param=param)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(raw: Request, exc: StarletteHTTPException):
        if exc.status_code == 404:
            msg = f"Invalid URL ({raw.method} {raw.url.path})"
        else:
            msg = str(exc.detail) if exc.detail else HTTPStatus(exc.status_code).phrase
        return _err(exc.status_code, msg)

    @app.exception_handler(Exception)
    async def _internal_error(_: Request, exc: Exception):
        logger.exception("internal error")
        return _err(500, f"Internal server error: {type(exc).__name__}: {exc}")

    # ----------------------------------------------------------------------------- plain endpoints
    @app.get("/health")
    async def health():
        eng = state.engine
        if eng is None or getattr(eng, "errored", False):
            return _err(503, "engine is not running")
        try:
            await eng.check_health()
        except Exception as exc:  # noqa: BLE001
            return _err(503, f"engine unhealthy: {exc}")
        return Response(status_code=200)

    @app.get("/metrics")
    async def prometheus_metrics():
        body = generate_latest(metrics.registry) + generate_latest(REGISTRY)
        return Response(content=body, media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def list_models():
        cards = [ModelCard(id=name, root=str(state.engine.model_config.model), max_model_len=state.max_model_len)
                 for name in state.model_names]
        return JSONResponse(ModelList(data=cards).model_dump())

    @app.get("/version")
    async def version():
        return {"version": _version()}

    # ----------------------------------------------------------------------------- request plumbing
    def _check_model(name: str | None) -> str:
        if name is None or name == "":
            return state.model_names[0]
        if name not in state.model_names:
            raise APIError(404, f"The model `{name}` does not exist.", param="model", code="model_not_found")
        return name

    def _check_common(req: SamplingFields) -> Any:
        extras = set(req.model_extra or ())
        if extras:
            logger.warning("ignoring unknown request fields: %s", sorted(extras))
        try:
            return ev.resolve(req.eviction, state.eviction_defaults)
        except ev.EvictionFieldError as exc:
            raise APIError(400, str(exc), param="eviction", code="invalid_eviction") from None

    def _check_prompt(ids: list[int], max_tokens: int | None, param: str) -> None:
        if not ids:
            raise APIError(400, "The prompt is empty.", param=param)
        limit = state.vocab_limit
        if limit is not None:
            bad = next((t for t in ids if not isinstance(t, int) or t < 0 or t > limit), None)
            if bad is not None:
                raise APIError(400, f"Token id {bad} is out of vocabulary.", param=param)
        n, m = len(ids), state.max_model_len
        if n >= m or (max_tokens is not None and n + max_tokens > m):
            requested = n + (max_tokens or 1)
            what = "messages" if param == "messages" else "prompt"
            raise APIError(400, f"This model's maximum context length is {m} tokens. However, you requested "
                                f"{requested} tokens ({n} in the {what}, {max_tokens or 1} for the completion). "
                                f"Please reduce the length of the {what} or completion.",
                           param="max_tokens" if n < m else param, code="context_length_exceeded")

    def _sampling_params(req: SamplingFields, max_tokens: int | None, cfg: Any, index: int = 0):
        """SamplingParams of sequence `index` of the request (n=1; seed + index like vLLM's n>1)."""
        from vllm.sampling_params import RequestOutputKind, SamplingParams

        kwargs: dict[str, Any] = dict(
            n=1, seed=None if req.seed is None else req.seed + index, stop=req.stop, stop_token_ids=req.stop_token_ids, max_tokens=max_tokens,
            min_tokens=req.min_tokens, ignore_eos=req.ignore_eos, logit_bias=req.logit_bias,
            include_stop_str_in_output=req.include_stop_str_in_output,
            skip_special_tokens=req.skip_special_tokens, output_kind=RequestOutputKind.DELTA,
            extra_args=ev.to_extra_args(cfg),
        )
        for name in ("temperature", "top_p", "presence_penalty", "frequency_penalty", "repetition_penalty"):
            value = getattr(req, name)
            if value is not None:
                kwargs[name] = value
        if req.top_k is not None:
            kwargs["top_k"] = req.top_k
        if req.min_p is not None:
            kwargs["min_p"] = req.min_p
        try:
            return SamplingParams.from_optional(**kwargs)
        except ValueError as exc:
            raise APIError(400, str(exc), param=getattr(exc, "parameter", None)) from None

    def _prompt_input(ids: list[int], text: str | None):
        from vllm.inputs import tokens_input

        return tokens_input(list(ids), prompt=text)

    def _generators(seqs: _Sequences, req: SamplingFields, max_tokens: int | None, cfg: Any) -> list:
        """One engine generator per sequence (not started until iterated)."""
        gens = []
        for k, ((ids, text), rid) in enumerate(zip(seqs.prompts, seqs.request_ids)):
            sp = _sampling_params(req, max_tokens, cfg, index=k % seqs.n)
            gens.append(state.engine.generate(_prompt_input(ids, text), sp, rid))
        return gens

    async def _abort(request_ids: list[str]) -> None:
        with contextlib.suppress(Exception):
            await state.engine.abort(request_ids)

    async def _run_unless_disconnected(raw: Request, coro, request_ids: list[str]):
        work = asyncio.ensure_future(coro)
        watch = asyncio.ensure_future(_wait_disconnect(raw))
        try:
            done, _ = await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            work.cancel()
            watch.cancel()
            asyncio.ensure_future(_abort(request_ids))
            metrics.observe_abort()
            raise
        if work in done:
            watch.cancel()
            return work.result()
        work.cancel()  # cancels engine.generate -> vLLM aborts and frees the KV blocks
        with contextlib.suppress(BaseException):
            await work
        await _abort(request_ids)
        metrics.observe_abort()
        raise _ClientGone()

    def _engine_error(exc: Exception) -> APIError:
        from vllm.v1.engine.exceptions import EngineDeadError

        if isinstance(exc, APIError):
            return exc
        if isinstance(exc, EngineDeadError):
            return APIError(503, "The engine is dead; restart the server.")
        if isinstance(exc, ValueError):
            return APIError(400, str(exc), param=getattr(exc, "parameter", None))
        cause = exc.__cause__ or exc
        return APIError(500, f"Generation failed: {type(cause).__name__}: {cause}")

    def _sse_response(gen: AsyncIterator[str], request_ids: list[str], seq_state: dict) -> Response:
        return _SSEResponse(gen, media_type="text/event-stream",
                            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
                            on_disconnect=lambda: _on_stream_gone(request_ids, seq_state))

    def _on_stream_gone(request_ids: list[str], seq_state: dict) -> None:
        if not seq_state.get("finished"):
            seq_state["finished"] = True
            metrics.observe_abort()
            asyncio.ensure_future(_abort(request_ids))

    # ----------------------------------------------------------------------------- chat
    def _render_chat(req: ChatCompletionRequest) -> tuple[list[int], str]:
        tok = state.tokenizer
        if tok is None or not getattr(tok, "chat_template", None):
            raise APIError(400, "This model has no chat template; use /v1/completions.", param="messages")
        messages = []
        for i, m in enumerate(req.messages):
            content = m.content
            if isinstance(content, list):
                parts = []
                for part in content:
                    if part.type not in ("text", "input_text") or part.text is None:
                        raise APIError(400, f"Content part type {part.type!r} is not supported (text only).",
                                       param=f"messages.{i}.content")
                    parts.append(part.text)
                content = "".join(parts)
            msg: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role,
                                   "content": content or ""}
            if m.name is not None:
                msg["name"] = m.name
            messages.append(msg)
        try:
            text = tok.apply_chat_template(messages, tokenize=False,
                                           add_generation_prompt=req.add_generation_prompt
                                           and not req.continue_final_message,
                                           continue_final_message=req.continue_final_message,
                                           **(req.chat_template_kwargs or {}))
        except Exception as exc:  # noqa: BLE001 - template errors are the caller's
            raise APIError(400, f"Could not apply the chat template: {exc}", param="messages") from None
        if not isinstance(text, str):
            text = tok.decode(text)
        ids = list(tok.encode(text, add_special_tokens=False))
        return ids, text

    def _stream(req: SamplingFields, seqs: _Sequences, cfg: Any, max_tokens: int | None, prelude: list[str],
                delta_event: Callable[[int, str, str | None, Usage | None], str],
                final_event: Callable[[Usage], str]) -> Response:
        """SSE response: prelude events, one event per sequence delta, usage event if asked, [DONE]."""
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        continuous = bool(req.stream_options and req.stream_options.continuous_usage_stats)
        seq_state: dict[str, Any] = {}
        gens = _generators(seqs, req, max_tokens, cfg)

        async def stream():
            try:
                for event in prelude:
                    yield event
                async with contextlib.aclosing(_merge(gens)) as outs:
                    async for k, out in outs:
                        text, finish = seqs.update(k, out)
                        if text or finish is not None:
                            yield delta_event(k, text, finish, _partial_usage(seqs) if continuous else None)
                seq_state["finished"] = True
                if include_usage:
                    yield final_event(seqs.usage(cfg))
                _observe_reports(seqs)
            except Exception as exc:  # noqa: BLE001 - reported in-band, the status line is gone
                seq_state["finished"] = True
                err = _engine_error(exc)
                metrics.observe_error(err.status)
                yield _sse(error_json(err.status, err.message, type=err.type, param=err.param, code=err.code))
            yield "data: [DONE]\n\n"

        return _sse_response(stream(), seqs.request_ids, seq_state)

    async def _collect(raw: Request, req: SamplingFields, seqs: _Sequences, cfg: Any,
                       max_tokens: int | None) -> bool:
        """Run all sequences to completion; False if the client went away (requests aborted)."""
        gens = _generators(seqs, req, max_tokens, cfg)

        async def collect():
            async with contextlib.aclosing(_merge(gens)) as outs:
                async for k, out in outs:
                    seqs.update(k, out)

        try:
            await _run_unless_disconnected(raw, collect(), seqs.request_ids)
        except _ClientGone:
            return False
        except Exception as exc:  # noqa: BLE001
            raise _engine_error(exc) from None
        _observe_reports(seqs)
        return True

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatCompletionRequest, raw: Request):
        model = _check_model(req.model)
        cfg = _check_common(req)
        if req.logprobs or req.top_logprobs:
            raise APIError(400, "logprobs are not supported by this server.", param="logprobs")
        if req.tools:
            raise APIError(400, "tools are not supported by this server.", param="tools")
        if req.response_format and req.response_format.get("type", "text") != "text":
            raise APIError(400, "Only response_format {\"type\": \"text\"} is supported.", param="response_format")
        ids, text = _render_chat(req)
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        _check_prompt(ids, max_tokens, "messages")
        _sampling_params(req, max_tokens, cfg)  # validate before anything starts
        request_id = random_id("chatcmpl")
        created = int(time.time())
        metrics.observe_request("chat", ev.policy_label(cfg))
        seqs = _Sequences(request_id, [(ids, text)], req.n)

        if req.stream:
            def chunk(choices, usage=None) -> str:
                return _sse(ChatCompletionChunk(id=request_id, created=created, model=model, choices=choices,
                                                usage=usage))

            continuous = bool(req.stream_options and req.stream_options.continuous_usage_stats)
            prelude = [chunk([ChatChunkChoice(index=i, delta=DeltaMessage(role="assistant", content=""))],
                             usage=_partial_usage(seqs) if continuous else None) for i in range(req.n)]
            return _stream(
                req, seqs, cfg, max_tokens, prelude,
                lambda k, delta, finish, usage: chunk(
                    [ChatChunkChoice(index=k, delta=DeltaMessage(content=delta), finish_reason=finish)], usage),
                lambda usage: chunk([], usage))

        if not await _collect(raw, req, seqs, cfg, max_tokens):
            return Response(status_code=499)
        choices = [ChatChoice(index=k, message=ResponseMessage(content=seqs.texts[k]), finish_reason=seqs.finish[k])
                   for k in range(len(seqs))]
        resp = ChatCompletionResponse(id=request_id, created=created, model=model, choices=choices,
                                      usage=seqs.usage(cfg))
        return JSONResponse(resp.model_dump())

    def _partial_usage(seqs: _Sequences) -> Usage:
        prompt, completion = sum(seqs.prompt_lens), sum(seqs.tokens)
        return Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)

    def _observe_reports(seqs: _Sequences) -> None:
        for report in seqs.reports.values():
            try:
                metrics.observe_eviction(report)
            except Exception:  # noqa: BLE001 - metrics must never fail a request
                logger.exception("could not record eviction report %r", report)

    # ----------------------------------------------------------------------------- completions
    def _completion_prompts(req: CompletionRequest) -> list[tuple[list[int], str | None]]:
        p = req.prompt
        tok = state.tokenizer
        if isinstance(p, str):
            items: list[Any] = [p]
        elif isinstance(p, list) and p and all(isinstance(x, int) for x in p):
            items = [p]
        else:
            items = list(p)
        if not items:
            raise APIError(400, "The prompt is empty.", param="prompt")
        out = []
        for item in items:
            if isinstance(item, str):
                out.append((list(tok.encode(item, add_special_tokens=True)), item))
            else:
                ids = list(item)
                text = None
                with contextlib.suppress(Exception):
                    text = tok.decode(ids)
                out.append((ids, text))
        return out

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, raw: Request):
        model = _check_model(req.model)
        cfg = _check_common(req)
        if req.logprobs is not None:
            raise APIError(400, "logprobs are not supported by this server.", param="logprobs")
        if req.suffix:
            raise APIError(400, "suffix is not supported by this server.", param="suffix")
        if req.best_of is not None and req.best_of != req.n:
            raise APIError(400, "best_of != n is not supported by this server.", param="best_of")
        prompts = _completion_prompts(req)
        for ids, _ in prompts:
            _check_prompt(ids, req.max_tokens, "prompt")
        _sampling_params(req, req.max_tokens, cfg)  # validate before anything starts
        request_id = random_id("cmpl")
        created = int(time.time())
        metrics.observe_request("completions", ev.policy_label(cfg))
        seqs = _Sequences(request_id, prompts, req.n)
        echo = [(text or "") if req.echo else "" for text in (t for _, t in seqs.prompts)]

        if req.stream:
            def chunk(choices, usage=None) -> str:
                return _sse(CompletionChunk(id=request_id, created=created, model=model, choices=choices,
                                            usage=usage))

            prelude = [chunk([CompletionChoice(index=k, text=echo[k])]) for k in range(len(seqs))] if req.echo else []
            return _stream(
                req, seqs, cfg, req.max_tokens, prelude,
                lambda k, delta, finish, usage: chunk([CompletionChoice(index=k, text=delta, finish_reason=finish)],
                                                      usage),
                lambda usage: chunk([], usage))

        if not await _collect(raw, req, seqs, cfg, req.max_tokens):
            return Response(status_code=499)
        choices = [CompletionChoice(index=k, text=echo[k] + seqs.texts[k], finish_reason=seqs.finish[k])
                   for k in range(len(seqs))]
        resp = CompletionResponse(id=request_id, created=created, model=model, choices=choices,
                                  usage=seqs.usage(cfg))
        return JSONResponse(resp.model_dump())

    return app


# ------------------------------------------------------------------------------------------- ASGI bits
class _SSEResponse(StreamingResponse):
    """StreamingResponse that always watches for the client going away and then closes the body
    generator (whose `finally` / vLLM's `generate()` abort the engine requests) right away."""

    def __init__(self, *args: Any, on_disconnect: Callable[[], None] | None = None, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._on_disconnect = on_disconnect

    async def __call__(self, scope, receive, send) -> None:
        disconnected = False
        finished = False

        async def stream() -> None:
            nonlocal finished
            try:
                await self.stream_response(send)
                finished = True
            except OSError:
                pass  # client went away while we were sending
            except Exception:  # noqa: BLE001
                logger.exception("error while streaming a response")

        async def listen() -> None:
            nonlocal disconnected
            await self.listen_for_disconnect(receive)
            disconnected = True

        stream_task = asyncio.ensure_future(stream())
        listen_task = asyncio.ensure_future(listen())
        try:
            await asyncio.wait({stream_task, listen_task}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for t in (stream_task, listen_task):
                t.cancel()
            for t in (stream_task, listen_task):
                with contextlib.suppress(BaseException):
                    await t
            if not finished:
                if self._on_disconnect is not None:
                    self._on_disconnect()
                with contextlib.suppress(BaseException):
                    await self.body_iterator.aclose()  # type: ignore[union-attr]


class _AuthMiddleware:
    """Bearer-token check for /v1/* (pure ASGI: leaves `receive` alone so disconnects stay visible)."""

    def __init__(self, app, state: ServerState):
        self.app = app
        self.state = state

    async def __call__(self, scope, receive, send) -> None:
        key = self.state.api_key
        if key and scope["type"] == "http" and scope.get("path", "").startswith("/v1"):
            headers = dict(scope.get("headers") or [])
            auth = headers.get(b"authorization", b"").decode("latin-1")
            token = auth[7:].strip() if auth[:7].lower() == "bearer " else ""
            if not token or not hmac.compare_digest(token.encode(), key.encode()):
                self.state.metrics.observe_error(401)
                msg = ("You didn't provide an API key. Provide it in the Authorization header as "
                       "'Bearer YOUR_KEY'." if not token else "Incorrect API key provided.")
                resp = JSONResponse(error_json(401, msg, code="invalid_api_key"), status_code=401,
                                    headers={"WWW-Authenticate": "Bearer"})
                await resp(scope, receive, send)
                return
        await self.app(scope, receive, send)


def _version() -> str:
    try:
        from vllm_evict import __version__

        return __version__
    except Exception:  # pragma: no cover
        return "unknown"
