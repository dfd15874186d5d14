"""Eviction with an EAGLE draft model (one layer, dummy weights, 3 draft tokens) on CPU. vLLM puts the draft's
attention layer in the target's KV cache group, so compaction frees its blocks with the target's: its cache
keeps, head by head, the tokens the last target layer keeps, compacted after the drafter has written the
step's tokens, and the drafter's later steps write at the compacted rows' shifted slots (DESIGN.md §4.8 g).
Greedy speculation is lossless, so target tokens equal the reference's. One engine with 3 drafts a step, one with
vLLM's dynamic speculation (3, none or 1 a step by the batch's size, as the requests are admitted)."""

from __future__ import annotations

import pytest
import torch

from tests.engine.inprocess import inprocess_llm
from tests.engine.test_eviction import check_against_reference, params, random_prompt, scheduler_of
from tests.engine.test_speculative import check_draft_schedule, drafts_per_step

pytestmark = pytest.mark.engine

PAGE = 16
# the last target layer and the draft's, numbered after the target's
TARGET_LAYER, DRAFT_LAYER = "model.layers.2.self_attn.attn", "model.layers.3.self_attn.attn"
CASES = [
    {"policy": "snapkv", "budget": 0.3},
    {"policy": "keydiff", "budget": 0.3, "chunked": True, "chunk_size": 64},
    {"policy": "dropkv", "decode_budget": 48, "decode_every": 32},
]


@pytest.fixture(scope="module", params=[None, [[1, 2, 3], [3, 3, 0], [4, 1024, 1]]], ids=["fixed", "dynamic"])
def engine(tiny_llama, request):
    from vllm_evict.testing.tiny_models import tiny_eagle_draft

    speculation = {"method": "eagle", "model": str(tiny_eagle_draft(tiny_llama)), "num_speculative_tokens": 3,
                   "draft_load_config": {"load_format": "dummy"},
                   **({"num_speculative_tokens_per_batch_size": request.param} if request.param else {})}
    with inprocess_llm(tiny_llama, block_size=PAGE, max_model_len=1280, max_num_batched_tokens=256,
                       speculative_config=speculation) as llm:
        yield llm


def runner_of(llm):
    return llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker.model_runner


def layer_cache(llm, layer: str):
    """The paged cache adapter of attention layer `layer`."""
    attention = runner_of(llm).compilation_config.static_forward_context[layer]
    return attention.impl._cached_paged_cache(attention, attention.kv_cache)


def held(llm, req_id: str, layer: str, n: int, group: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys, values [n, H, D] of the first n tokens a request's blocks of KV cache group `group` hold in `layer`."""
    manager = scheduler_of(llm).kv_cache_manager.coordinator.single_type_managers[group]
    internal, = [key for key in manager.req_to_blocks if key.split("-")[0] == req_id]  # vLLM suffixes the ids
    blocks = torch.tensor([b.block_id for b in manager.req_to_blocks[internal]])
    return layer_cache(llm, layer).gather_prefix(blocks, n)


def test_tokens_follow_the_reference(engine, reference):
    from vllm_evict.engine.request_config import parse_request

    prompt = random_prompt(11, 230)
    requests = [None, *CASES]
    with drafts_per_step(engine) as steps:  # one prompt admitted a step: batches of 1 to 4
        outputs = engine.generate([{"prompt_token_ids": prompt}] * len(requests), [params(c, 100) for c in requests])
    check_draft_schedule(engine, steps, configured=3, dynamic_counts={0, 1, 3})
    check_against_reference(outputs[0], reference.generate(prompt, 100), "no eviction")
    for case, out in zip(CASES, outputs[1:]):
        expected = reference.replay(prompt, 100, parse_request({"vllm_evict": case}), page_size=PAGE)
        check_against_reference(out, expected, str(case))
    pool = scheduler_of(engine).kv_cache_manager.block_pool
    assert pool.get_num_free_blocks() == pool.num_gpu_blocks - 1 and not scheduler_of(engine).evictions


def record_draft_writes(monkeypatch) -> list[tuple[torch.Tensor, torch.Tensor, int]]:
    """Records, for each later draft step, the slots the drafter writes, the slots of its rows' physical ends by
    the lengths it was given (the new draft token at seq_len - 1), and how many of its rows are shifted."""
    from vllm.v1.spec_decode import llm_base_proposer

    from vllm_evict.engine.worker import STATE

    hooked = llm_base_proposer.eagle_step_update_slot_mapping_and_metadata
    writes = []

    def recorded(positions_1d, block_table_tensor, seq_lens, block_size, max_model_len, out_clamped_positions,
                 out_slot_mapping, input_batch_size=None):
        hooked(positions_1d, block_table_tensor, seq_lens, block_size, max_model_len, out_clamped_positions,
               out_slot_mapping, input_batch_size)
        n = positions_1d.shape[0]
        last = seq_lens[:n].long() - 1
        table = block_table_tensor[:n].long()
        expected = table.gather(1, (last // block_size).unsqueeze(1)).squeeze(1) * block_size + last % block_size
        shift = STATE.draft_shift(n)
        writes.append((out_slot_mapping[:n].clone(), expected, 0 if shift is None else int(shift.count_nonzero())))

    monkeypatch.setattr(llm_base_proposer, "eagle_step_update_slot_mapping_and_metadata", recorded)
    return writes


def test_draft_cache_keeps_the_target_layers_tokens(engine, monkeypatch):
    """A plain and an evicted request of one prompt: each kept token of the evicted request's last target
    layer is found among the plain request's rows (its position), and the draft layer holds that position's
    draft K/V there. Meanwhile every slot the drafter's later steps write is the row's last physical slot."""
    writes = record_draft_writes(monkeypatch)
    llm = engine.llm_engine
    prompt = random_prompt(12, 230)
    # alone in its first step, the whole prompt is one chunk: the drafter writes all of it in the compaction step
    llm.add_request("evicted", {"prompt_token_ids": prompt}, params({"policy": "snapkv", "budget": 0.5}, 40))
    llm.step()
    llm.add_request("plain", {"prompt_token_ids": prompt}, params(None, 40))
    for _ in range(5):  # decode steps with drafts, the plain request prefilled beside them
        llm.step()
    kept = 112  # every head keeps at least 115 tokens of 230 (0.5): the first 7 pages are full
    plain_target, _ = held(engine, "plain", TARGET_LAYER, len(prompt))
    evicted_target, _ = held(engine, "evicted", TARGET_LAYER, kept)
    plain_keys, plain_values = held(engine, "plain", DRAFT_LAYER, len(prompt))
    draft_keys, draft_values = held(engine, "evicted", DRAFT_LAYER, kept)
    # each kept row's position: the plain request's nearest row of the same head (same prompt, same weights;
    # the two prefills were chunked apart, so rows agree to float32 rounding, far closer than to any other)
    distance = torch.cdist(evicted_target.transpose(0, 1), plain_target.transpose(0, 1))  # [H, kept, n]
    values, indices = distance.topk(2, dim=-1, largest=False)
    positions = indices[..., 0]
    assert (values[..., 0] < 0.01 * values[..., 1]).all(), (values[..., 0].max(), values[..., 1].min())
    assert (positions.diff(dim=-1) > 0).all()  # kept tokens in order, a strict subset of the prompt
    assert (positions[:, -1] > kept).any()  # something was evicted before them
    # the draft layer holds those positions' draft K/V: the same nearest-row test on its keys and values
    # (dummy weights make them small, so a test relative to the other rows, not an absolute tolerance)
    for evicted_rows, plain_rows in ((draft_keys, plain_keys), (draft_values, plain_values)):
        distance = torch.cdist(evicted_rows.transpose(0, 1), plain_rows.transpose(0, 1))
        values, indices = distance.topk(2, dim=-1, largest=False)
        assert torch.equal(indices[..., 0], positions)
        assert (values[..., 0] < 0.01 * values[..., 1]).all(), (values[..., 0].max(), values[..., 1].min())
    assert writes and all(torch.equal(slots, expected) for slots, expected, _ in writes)
    llm.abort_request(["plain", "evicted"])
    while llm.has_unfinished_requests():
        llm.step()


def test_adakv_is_refused(engine):
    from vllm_evict.engine.request_config import parse_request
    from vllm_evict.engine.layout import check_on_engine

    config = engine.llm_engine.vllm_config
    with pytest.raises(ValueError, match="draft model that keeps its own KV cache"):
        check_on_engine(parse_request({"vllm_evict": {"policy": "snapkv", "budget": 0.3, "allocation": "adakv"}}),
                        config)
    check_on_engine(parse_request({"vllm_evict": {"policy": "snapkv", "budget": 0.3}}), config)


def test_decode_budget_is_refused_under_asynchronous_scheduling(engine):
    """Asynchronous scheduling (vLLM's default on CUDA; the CPU platform runs synchronously) plans a step before the
    last one's drafts are verified, so a decode point cannot be placed on verified tokens: decode budgets are refused
    there, with the flag that allows them; prompt evictions are placed in prefill, where no step carries drafts."""
    import copy

    from vllm_evict.engine.layout import check_on_engine
    from vllm_evict.engine.request_config import parse_request

    synchronous = engine.llm_engine.vllm_config
    assert not synchronous.scheduler_config.async_scheduling
    asynchronous = copy.copy(synchronous)
    asynchronous.scheduler_config = copy.copy(synchronous.scheduler_config)
    asynchronous.scheduler_config.async_scheduling = True
    decode_budget = parse_request({"vllm_evict": {"policy": "dropkv", "decode_budget": 48, "decode_every": 32}})
    with pytest.raises(ValueError, match="--no-async-scheduling"):
        check_on_engine(decode_budget, asynchronous)
    check_on_engine(decode_budget, synchronous)
    check_on_engine(parse_request({"vllm_evict": {"policy": "snapkv", "budget": 0.3}}), asynchronous)
    check_on_engine(parse_request({"vllm_evict": {"policy": "keydiff", "budget": 0.3, "chunked": True,
                                                  "chunk_size": 64}}), asynchronous)
