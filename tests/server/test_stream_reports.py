"""A streamed sequence's eviction report survives vLLM merging the outputs a slow client has not read yet
(`RequestOutputCollector` in DELTA mode calls `RequestOutput.add(..., aggregate=True)`, which extends the
pending CompletionOutput and drops the newer one). Without the hook the final usage chunk said
`"evicted": false` whenever the last outputs merged (seen under a loaded test run)."""

import pytest

from vllm_evict.engine.openai_api import EVICTION_ATTR, _keep_reports, _Reports

REPORT = {"policy": "snapkv", "evicted": True}


def pending_and_final():
    from vllm.outputs import CompletionOutput, RequestOutput

    def output(tokens, finish, finished):
        completion = CompletionOutput(index=0, text="", token_ids=tokens, cumulative_logprob=None, logprobs=None,
                                      finish_reason=finish)
        return RequestOutput(request_id="r", prompt=None, prompt_token_ids=[1, 2], prompt_logprobs=None,
                             outputs=[completion], finished=finished)

    pending, final = output([5], None, False), output([6, 7], "length", True)
    setattr(final.outputs[0], EVICTION_ATTR, REPORT)
    return pending, final


def reports_of(request_output) -> dict:
    reports = _Reports()
    reports.add(0, request_output)
    return reports.by_sequence


@pytest.mark.parametrize("aggregate", [True, False])
def test_report_survives_merge(aggregate):
    from vllm.outputs import RequestOutput

    pending, final = pending_and_final()
    _keep_reports(RequestOutput.add)(pending, final, aggregate)
    assert pending.outputs[0].finish_reason == "length"
    assert list(pending.outputs[0].token_ids) == ([5, 6, 7] if aggregate else [6, 7])
    assert reports_of(pending) == {(0, 0): REPORT}


def test_vllm_merge_alone_drops_the_report():
    """Why the hook exists: vLLM 0.26's own merge keeps the pending object. (Unwrapped: this process may
    have installed the hook already, whenever a test imported the API server before the plugin loaded.)"""
    import inspect

    from vllm.outputs import RequestOutput

    pending, final = pending_and_final()
    inspect.unwrap(RequestOutput.add)(pending, final, True)
    assert reports_of(pending) == {}
