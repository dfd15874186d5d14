"""Hooks into vLLM's OpenAI API server (the API process): the `eviction` request field, per-sequence
eviction reports, and `usage.eviction` in responses.

* **Request field.** `ChatCompletionRequest` / `CompletionRequest` keep unknown fields (`extra="allow"`),
  so a top-level `eviction` object (the official client sends it with `extra_body`) or flat `eviction_*`
  keys in `vllm_xargs` reach `to_sampling_params`. The wrapped method merges them with the server
  defaults ($VLLM_EVICT_DEFAULT, JSON; `vllm-evict serve --default-eviction-*` sets it), validates them
  and writes the result to `extra_args["vllm_evict"]` (`{"policy": "none"}` when the request does not
  evict). A bad value raises vLLM's `VLLMValidationError`, so the client gets a 400 before any stream
  starts. The chat and completion handlers are wrapped to check, before they start a response, the rules
  that need the engine's config (a model that cannot evict; `decode_budget` against the page size), and
  `AsyncLLM.generate` refuses, when the handler calls it, a request that could never fit the KV cache: the
  input processor checks both too, but only once a stream has started.
* **Reports.** The engine sends a request's report in `kv_transfer_params`: on its output of the step
  after compaction (scheduler.py) and on its final output. `RequestState.make_request_output` is wrapped
  to keep it on the request's state (so a request that the API process ends itself, on a stop string,
  still has it), to take it out of `kv_transfer_params` (vLLM would echo it, one child's only), to attach
  it to the sequence's final `CompletionOutput` (`EVICTION_ATTR`; for n > 1 each child has its own), and
  to record the eviction metrics once per request. `RequestOutput.add` is wrapped so the report survives
  when a stream's unread outputs merge into an earlier one.
* **Usage.** The chat and completion response builders are wrapped to add `usage.eviction`
  (server/eviction.py `usage_block`): non-streaming responses, and the final usage chunk of a stream.
"""

from __future__ import annotations

import functools
import json
import os
from typing import Any

from vllm_evict.engine.request_config import DEFAULT_ENV, EXTRA_ARGS_KEY, flat_request

EVICTION_ATTR = "vllm_evict_report"  # on a CompletionOutput: that sequence's eviction report


@functools.cache
def server_defaults() -> dict[str, Any]:
    """The server's default eviction fields ($VLLM_EVICT_DEFAULT, set before the server starts), merged into
    every request's object; read once per process."""
    text = os.environ.get(DEFAULT_ENV)
    return json.loads(text) if text else {}


def request_fields(request) -> dict[str, Any] | None:
    """The eviction object of an OpenAI request: the top-level `eviction` field, else the flat
    `eviction_*` keys of `vllm_xargs` (`eviction_policy` -> `policy`, typed as the engine types them),
    else None."""
    fields = (request.model_extra or {}).get("eviction")
    return fields if fields is not None else flat_request(request.vllm_xargs)


def resolve_request(request):
    """The request's resolved eviction config (None: no eviction); ValueError for bad values."""
    from vllm_evict.server.eviction import resolve

    return resolve(request_fields(request), server_defaults())


def checked_request(request, vllm_config=None):
    """resolve_request, a bad value raised as vLLM's `VLLMValidationError` (a 400 naming `eviction`); given
    the engine's config, the rules that need it too (layout.check_on_engine: the model can evict, the
    page size)."""
    from vllm.exceptions import VLLMValidationError

    from vllm_evict.engine.layout import check_on_engine

    try:
        config = resolve_request(request)
        if config is not None and vllm_config is not None:
            check_on_engine(config.spec, vllm_config)
    except ValueError as exc:
        raise VLLMValidationError(str(exc), parameter="eviction") from None
    return config


def _with_eviction_field(to_sampling_params):
    def wrapped(self, *args, **kwargs):
        params = to_sampling_params(self, *args, **kwargs)
        config = checked_request(self)
        from vllm_evict.server.eviction import to_extra_args

        extra_args = {k: v for k, v in (params.extra_args or {}).items() if not k.startswith("eviction_")}
        params.extra_args = {**extra_args, **to_extra_args(config)}
        return params

    return wrapped


def _checks_engine_rules(create):
    """A chat or completion handler that refuses, before it starts a response, what needs the engine's
    config (a model that cannot evict, the page size). The input processor refuses the same, but vLLM runs it
    only when the response reads the engine's output: a stream would have sent its 200 and carry the error
    as an event."""

    @functools.wraps(create)
    async def wrapped(self, request, *args, **kwargs):
        checked_request(request, self.engine_client.vllm_config)
        return await create(self, request, *args, **kwargs)

    return wrapped


def _refuses_what_never_fits(generate):
    """AsyncLLM.generate, refusing when called (a ValueError, a 400) a request of token ids that could never fit
    the KV cache: vLLM's handlers call it before they start a response but run its body, where the input
    processor makes the same check, only once the response reads the output: a stream would have sent its
    200 already."""

    @functools.wraps(generate)
    def wrapped(self, prompt, sampling_params, request_id, *args, **kwargs):
        from vllm_evict.engine.plugin import never_fits

        token_ids = prompt.get("prompt_token_ids") if isinstance(prompt, dict) else None
        if token_ids is not None:
            reason = never_fits(self.vllm_config, len(token_ids), sampling_params)
            if reason is not None:
                raise ValueError(reason)
        return generate(self, prompt, sampling_params, request_id, *args, **kwargs)

    return wrapped


def _attach_reports(make_request_output):
    def wrapped(self, new_token_ids, pooling_output, finish_reason, stop_reason, kv_transfer_params=None,
                *args, **kwargs):
        report = kv_transfer_params.get(EXTRA_ARGS_KEY) if isinstance(kv_transfer_params, dict) else None
        if report is not None:  # on the output of each step that finished a compaction, and on the last one
            from vllm_evict.server import metrics

            previous = getattr(self, EVICTION_ATTR, None)
            if previous is None:
                metrics.observe_eviction(report)  # once per request, even if it is aborted later
            else:
                metrics.observe_decode(previous, report)  # what decode-time compactions added since
            setattr(self, EVICTION_ATTR, report)
            kv_transfer_params = {k: v for k, v in kv_transfer_params.items() if k != EXTRA_ARGS_KEY} or None
        report = getattr(self, EVICTION_ATTR, None)
        if report is None or finish_reason is None:  # only the sequence's final output carries it
            return make_request_output(self, new_token_ids, pooling_output, finish_reason, stop_reason,
                                       kv_transfer_params, *args, **kwargs)
        new_completion_output = self._new_completion_output

        def with_report(*a, **k):  # this child's output, before a parent request merges it
            output = new_completion_output(*a, **k)
            setattr(output, EVICTION_ATTR, report)
            return output

        self._new_completion_output = with_report
        try:
            return make_request_output(self, new_token_ids, pooling_output, finish_reason, stop_reason,
                                       kv_transfer_params, *args, **kwargs)
        finally:
            del self._new_completion_output

    return wrapped


def _keep_reports(add):
    """A streamed request's outputs are merged when the client reads slower than the engine steps
    (`RequestOutputCollector` in DELTA mode: `RequestOutput.add` with aggregate=True). The merge extends the
    pending CompletionOutput and drops the newer object, and with it the report on the final output; carry
    the report over."""
    @functools.wraps(add)
    def wrapped(self, next_output, aggregate):
        reports = {c.index: getattr(c, EVICTION_ATTR) for c in next_output.outputs
                   if getattr(c, EVICTION_ATTR, None) is not None}
        add(self, next_output, aggregate)
        for completion in self.outputs:
            if completion.index in reports:
                setattr(completion, EVICTION_ATTR, reports[completion.index])

    return wrapped


class _Reports:
    """Eviction reports of one API request's sequences, keyed (prompt index, choice index)."""

    def __init__(self) -> None:
        self.by_sequence: dict[tuple[int, int], dict] = {}

    def add(self, prompt_index: int, request_output) -> None:
        for output in getattr(request_output, "outputs", None) or ():
            report = getattr(output, EVICTION_ATTR, None)
            if report is not None:
                self.by_sequence[(prompt_index, output.index)] = report

    async def watch(self, results):
        """Pass a result generator through (items: RequestOutput, or (prompt index, RequestOutput))."""
        async for item in results:
            if isinstance(item, tuple):
                self.add(*item)
            else:
                self.add(0, item)
            yield item

    def usage(self, request, num_prompts: int = 1) -> dict[str, Any]:
        from vllm_evict.server.eviction import usage_block

        num_sequences = num_prompts * (request.n or 1)
        reports = []
        for (prompt_index, index), report in sorted(self.by_sequence.items()):
            if num_sequences > 1:  # say which sequence each report is about
                report = {**report, "index": index, **({"prompt_index": prompt_index} if num_prompts > 1 else {})}
            reports.append(report)
        return usage_block(resolve_request(request), reports, num_sequences=num_sequences)


def _add_usage(response, reports: _Reports, request, num_prompts: int = 1):
    usage = getattr(response, "usage", None)
    if usage is not None:
        usage.eviction = reports.usage(request, num_prompts)
    return response


def _with_usage_in_stream(chunks, reports: _Reports, request, num_prompts: int = 1):
    """Server-sent events with `usage.eviction` added to the final usage chunk (the one before [DONE])."""

    async def stream():
        held = None
        async for chunk in chunks:
            if chunk.strip() == "data: [DONE]" and held is not None:
                held = _usage_chunk(held, reports, request, num_prompts)
            if held is not None:
                yield held
            held = chunk
        if held is not None:
            yield held

    return stream()


def _usage_chunk(chunk: str, reports: _Reports, request, num_prompts: int) -> str:
    if not chunk.startswith("data: ") or '"usage"' not in chunk:
        return chunk
    body = json.loads(chunk[len("data: "):])
    if body.get("choices") or not body.get("usage"):
        return chunk
    body["usage"]["eviction"] = reports.usage(request, num_prompts)
    return f"data: {json.dumps(body)}\n\n"


def install_serving_hooks() -> None:
    """Install the hooks above (idempotent); a no-op where vLLM's OpenAI server is not importable."""
    try:
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
        from vllm.entrypoints.openai.chat_completion.serving import OpenAIServingChat
        from vllm.entrypoints.openai.completion.protocol import CompletionRequest
        from vllm.entrypoints.openai.completion.serving import OpenAIServingCompletion
        from vllm.outputs import RequestOutput
        from vllm.v1.engine.async_llm import AsyncLLM
        from vllm.v1.engine.output_processor import RequestState
    except ImportError:  # pragma: no cover - a vLLM build without the OpenAI server
        return
    if getattr(RequestState, "_vllm_evict_hooked", False):
        return
    from vllm_evict.engine import surface

    surface.check("serving")
    for request_cls in (ChatCompletionRequest, CompletionRequest):
        request_cls.to_sampling_params = _with_eviction_field(request_cls.to_sampling_params)
    RequestState.make_request_output = _attach_reports(RequestState.make_request_output)
    RequestOutput.add = _keep_reports(RequestOutput.add)
    AsyncLLM.generate = _refuses_what_never_fits(AsyncLLM.generate)
    OpenAIServingChat.create_chat_completion = _checks_engine_rules(OpenAIServingChat.create_chat_completion)
    OpenAIServingCompletion.create_completion = _checks_engine_rules(OpenAIServingCompletion.create_completion)

    chat_full = OpenAIServingChat.chat_completion_full_generator
    chat_stream = OpenAIServingChat.chat_completion_stream_generator
    completion_response = OpenAIServingCompletion.request_output_to_completion_response
    completion_stream = OpenAIServingCompletion.completion_stream_generator

    async def chat_completion_full_generator(self, request, result_generator, *args, **kwargs):
        reports = _Reports()
        response = await chat_full(self, request, reports.watch(result_generator), *args, **kwargs)
        return _add_usage(response, reports, request)

    def chat_completion_stream_generator(self, request, result_generator, *args, **kwargs):
        reports = _Reports()
        chunks = chat_stream(self, request, reports.watch(result_generator), *args, **kwargs)
        return _with_usage_in_stream(chunks, reports, request)

    def request_output_to_completion_response(self, final_res_batch, request, *args, **kwargs):
        reports = _Reports()
        for prompt_index, request_output in enumerate(final_res_batch):
            reports.add(prompt_index, request_output)
        response = completion_response(self, final_res_batch, request, *args, **kwargs)
        return _add_usage(response, reports, request, len(final_res_batch))

    def completion_stream_generator(self, request, engine_inputs, result_generator, *args, **kwargs):
        reports = _Reports()
        chunks = completion_stream(self, request, engine_inputs, reports.watch(result_generator), *args, **kwargs)
        return _with_usage_in_stream(chunks, reports, request, len(engine_inputs))

    OpenAIServingChat.chat_completion_full_generator = chat_completion_full_generator
    OpenAIServingChat.chat_completion_stream_generator = chat_completion_stream_generator
    OpenAIServingCompletion.request_output_to_completion_response = request_output_to_completion_response
    OpenAIServingCompletion.completion_stream_generator = completion_stream_generator
    RequestState._vllm_evict_hooked = True
