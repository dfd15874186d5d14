"""Eviction beside a speculative draft model on hybrid models, on CPU, with dummy draft weights and 2 draft
tokens: tiny random Qwen3-Next (Gated DeltaNet and full attention) with one multi-token-prediction (MTP)
layer, and a tiny GPT-OSS (sliding window and full attention, sinks) with a one-layer EAGLE3 draft, both in
bf16. vLLM puts the draft's attention layer in the target's full-attention KV cache group, so it is compacted
with it (its cache keeps the last target layer's tokens). The runner's seq_lens stay semantic for the other
groups, so the drafter's metadata gets the compacted rows' physical lengths of its own (DESIGN.md §4.8 g).
Target tokens follow the reference by teacher forcing (tests/engine/hybrid.py). One engine per model."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch

from tests.engine import hybrid
from tests.engine.inprocess import inprocess_llm
from tests.engine.test_eviction import params, random_prompt, scheduler_of
from tests.engine.test_speculative_eagle import held, record_draft_writes

pytestmark = pytest.mark.engine


@dataclass(frozen=True)
class Drafted:
    kind: str              # tiny model kind
    method: str            # vLLM's speculative method
    target_layer: str      # the last target layer of the full-attention group
    draft_layer: str
    engine: dict = field(default_factory=dict)  # engine arguments past the common ones

    def speculation(self, model) -> dict:
        from vllm_evict.testing.tiny_models import tiny_eagle3_draft

        draft = {"model": str(tiny_eagle3_draft(model))} if self.method == "eagle3" else {}
        return {"method": self.method, "num_speculative_tokens": 2, "draft_load_config": {"load_format": "dummy"},
                **draft}


MODELS = {
    "qwen3-next-mtp": Drafted("qwen3-next", "mtp", "model.layers.3.self_attn.attn", "mtp.layers.0.self_attn.attn",
                              {"mamba_ssm_cache_dtype": "float32"}),
    "gpt-oss-eagle3": Drafted("gpt-oss-6", "eagle3", "model.layers.5.attn.attn", "model.layers.6.self_attn.attn"),
}


def cases(page: int) -> list[dict]:
    return [{"policy": "snapkv", "budget": 0.5}, {"policy": "keydiff", "budget": 0.5, "chunked": True,
                                                  "chunk_budget": 0.5},
            {"policy": "snapkv", "decode_budget": 3 * page, "decode_every": page}]


# GPT-OSS's engine runs with the slow suite (README's second test command): the default one keeps its time
@pytest.fixture(scope="module", params=["qwen3-next-mtp", pytest.param("gpt-oss-eagle3", marks=pytest.mark.slow)])
def drafted(request) -> Drafted:
    return MODELS[request.param]


@pytest.fixture(scope="module")
def model(drafted):
    from vllm_evict.testing.tiny_models import ensure_tiny_model, tiny_mtp_model

    model = ensure_tiny_model(drafted.kind)
    return tiny_mtp_model(model) if drafted.method == "mtp" else model


@pytest.fixture(scope="module")
def engine(drafted, model):
    with inprocess_llm(model, block_size=hybrid.PAGE, max_model_len=1024, max_num_batched_tokens=256,
                       dtype="bfloat16", speculative_config=drafted.speculation(model), **drafted.engine) as llm:
        yield llm


@pytest.fixture(scope="module")
def reference(model):
    return hybrid.reference_for(model, torch.bfloat16)


def evicted_group(llm) -> int:
    return scheduler_of(llm).kv_cache_manager.group.index


def test_the_draft_layer_is_compacted_with_the_full_attention_group(engine, drafted):
    groups = scheduler_of(engine).kv_cache_config.kv_cache_groups
    hybrid.check_only_full_attention_is_evicted(engine)
    assert {drafted.target_layer, drafted.draft_layer} <= set(groups[evicted_group(engine)].layer_names)


def test_tokens_follow_the_reference(engine, reference):
    page = hybrid.page_of(engine)
    prompt = random_prompt(21, 300)
    max_tokens = 36 + 2 * (page - hybrid.PAGE)  # two decode points at least
    requests = [None, *cases(page)]
    outputs = engine.generate([{"prompt_token_ids": prompt}] * len(requests), [params(c, max_tokens) for c in requests])
    plain = list(outputs[0].outputs[0].token_ids)
    hybrid.check(outputs[0], lambda forced: reference.generate(prompt, max_tokens, forced=forced), False, "no eviction")
    for case, out in zip(requests[1:], outputs[1:]):
        hybrid.check(out, lambda forced: reference.replay(prompt, max_tokens, hybrid.spec_of(case), page_size=page,
                                                          forced=forced), False, str(case), full=plain)
        report = out.kv_transfer_params["vllm_evict"]
        freed = report.get("decode_blocks_freed" if "decode_budget" in case else "blocks_freed", 0)
        assert freed > 0, (case, report)
    assert hybrid.idle(engine)


def test_drafts_read_and_write_the_compacted_rows_physical_ends(engine, drafted, monkeypatch):
    """A plain and an evicted request of one prompt. Every slot the drafter's later steps write is the
    row's physical end by the lengths the drafter was given (semantic lengths point past a compacted row's
    kept pages), and the draft layer's cache keeps the positions the last target layer keeps: each kept row
    of the evicted request is the plain request's row of the same position, in both layers."""
    writes = record_draft_writes(monkeypatch)
    llm = engine.llm_engine
    page = hybrid.page_of(engine)
    prompt = random_prompt(22, 4 * page + 12)
    llm.add_request("evicted", {"prompt_token_ids": prompt}, params({"policy": "snapkv", "budget": 0.5}, 40))
    llm.step()  # the whole prompt in one chunk: the drafter writes all of it in the compaction step
    llm.add_request("plain", {"prompt_token_ids": prompt}, params(None, 40))
    for _ in range(6):  # decode steps with drafts, the plain request prefilled beside them
        llm.step()
    assert writes and all(torch.equal(slots, expected) for slots, expected, _ in writes)
    assert any(shifted for _, _, shifted in writes)  # the evicted request drafted after its compaction
    kept = 2 * page  # every head keeps at least half the prompt: its first two pages are full
    for layer in drafted.target_layer, drafted.draft_layer:
        group = evicted_group(engine)
        plain_rows = held(engine, "plain", layer, len(prompt), group)[0].float()
        evicted_rows = held(engine, "evicted", layer, kept, group)[0].float()
        distance = torch.cdist(evicted_rows.transpose(0, 1), plain_rows.transpose(0, 1))  # [H, kept, n]
        values, indices = distance.topk(2, dim=-1, largest=False)
        if layer == drafted.target_layer:
            positions = indices[..., 0]
            assert (positions.diff(dim=-1) > 0).all() and (positions[:, -1] > kept).any()  # a strict subset
        assert torch.equal(indices[..., 0], positions), layer
        assert (values[..., 0] < 0.1 * values[..., 1]).all(), (layer, values[..., 0].max(), values[..., 1].min())
    llm.abort_request(["plain", "evicted"])
    while llm.has_unfinished_requests():
        llm.step()
    assert hybrid.idle(engine)


def test_aborted_requests_return_every_group_s_blocks(engine):
    hybrid.check_aborts_leak_nothing(engine, cases=cases(hybrid.page_of(engine)))
