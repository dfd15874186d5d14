"""Issue 16: eviction at tensor_parallel_size=2 (CPU, two worker processes, tiny GQA Llama with 2 KV heads,
so each rank holds one) against the independent torch reference, which is also what TP=1 produces
(tests/engine/test_eviction.py), uniform and Ada-KV. One engine for the module, engine core in this process so the block
pool can be read."""

from __future__ import annotations

import pytest
import torch

from tests.engine.inprocess import inprocess_llm, two_cpu_workers
from tests.engine.test_eviction import (PAGE, check_against_reference, check_mixed_batch, params, random_prompt,
                                       scheduler_of)

pytestmark = pytest.mark.engine

MAX_TOKENS = 24


@pytest.fixture(scope="module")
def engine(tiny_llama):
    with two_cpu_workers():
        with inprocess_llm(tiny_llama, block_size=PAGE, max_num_batched_tokens=256, tensor_parallel_size=2,
                           distributed_executor_backend="mp") as llm:
            yield llm


def test_uniform_policies_match_reference_in_one_mixed_batch(engine, reference):
    """Uniform allocation keeps each head's own top pages, so TP cannot change it: four policies and two
    budgets, plain requests around them, one prompt longer than a 256-token prefill chunk; tokens equal
    the reference and the block pool is back at idle afterwards."""
    assert engine.llm_engine.vllm_config.parallel_config.tensor_parallel_size == 2
    pool = scheduler_of(engine).kv_cache_manager.block_pool
    idle_free = pool.get_num_free_blocks()
    prompt = random_prompt(11, 450)
    cases = [{"policy": p, "budget": b} for p in ("snapkv", "dropkv", "keydiff", "streaming") for b in (0.25, 64)]
    requests = [None] + cases + [None]
    outputs = engine.generate([{"prompt_token_ids": prompt}] * len(requests),
                              [params(c, MAX_TOKENS) for c in requests])
    check_mixed_batch(outputs, cases, reference, prompt, MAX_TOKENS, label="TP=2 ")
    assert pool.get_num_free_blocks() == idle_free


def test_adakv_allocates_over_all_heads_as_at_tp1(engine, reference):
    """Ada-KV under TP allocates each layer's P*H_kv pages over all H_kv heads (SPEC §3.4), as TP=1 does:
    the ranks all-gather their heads' scores. Here each rank holds one of the 2 KV heads, so a rank-local
    allocation would be the uniform one; the reference's Ada-KV keeps different counts per head, and the
    tokens must equal it. A rank may hold up to F = min(2P, ceil(E/16)) fresh blocks (the report says so),
    and the block pool is back at idle afterwards."""
    from vllm_evict.policies import EvictionConfig

    pool = scheduler_of(engine).kv_cache_manager.block_pool
    idle_free = pool.get_num_free_blocks()
    prompt = random_prompt(12, 450)
    cases = [{"policy": "snapkv", "budget": 0.25, "allocation": "adakv"},
             {"policy": "dropkv", "budget": 0.3, "allocation": "adakv"},
             {"policy": "keydiff", "budget": 64, "allocation": "adakv"},
             {"policy": "dropkv", "budget": 0.3}]
    requests = [None] + cases + [None]
    outputs = engine.generate([{"prompt_token_ids": prompt}] * len(requests),
                              [params(c, MAX_TOKENS) for c in requests])
    check_mixed_batch(outputs, cases, reference, prompt, MAX_TOKENS, label="TP=2 ")
    prefill = reference.prefill(prompt)
    uneven = 0
    for case, out in zip(cases, outputs[1:-1]):
        config = EvictionConfig.from_dict(case)
        pages = config.num_pages(len(prompt), PAGE)
        report = out.kv_transfer_params["vllm_evict"]
        fresh = min(2 * pages, -(-len(prompt) // PAGE)) if config.allocation == "adakv" else pages
        assert (report["pages_per_head"], report["blocks_after"]) == (pages, fresh), case
        if config.allocation == "adakv":
            kept = reference.generate(prompt, 1, config, page_size=PAGE, prefill=prefill).kept_per_layer
            uneven += any(len(set(heads)) > 1 for heads in kept)
    assert uneven >= 2  # the global allocation is not the uniform one here
    assert pool.get_num_free_blocks() == idle_free


@pytest.mark.parametrize("world,total,rank,heads", [(2, 4, 1, [2, 3]), (4, 8, 2, [4, 5]), (4, 2, 3, [1]),
                                                    (4, 2, 1, [0]), (2, 2, 0, [0])])
def test_kv_head_group_merges_and_slices_vllms_head_split(world, total, rank, heads):
    """KVHeadGroup follows vLLM's split of KV heads over TP ranks: rank r holds heads [r*H, (r+1)*H), or
    with H_kv < TP the replicated head r // (TP/H_kv); merge keeps each head once, in head order."""
    from vllm_evict.engine.compaction import KVHeadGroup

    group = KVHeadGroup(rank=rank, world=world, total=total)
    per_rank = max(1, total // world)
    owned = [[r * per_rank + i if total >= world else r // (world // total) for i in range(per_rank)]
             for r in range(world)]
    assert owned[rank] == heads
    num_layers, n = 3, 5
    every = torch.randn(num_layers, total, n)
    gathered = torch.stack([every[:, owned[r]] for r in range(world)])       # what the all-gather returns
    torch.testing.assert_close(group.merge(gathered), every, rtol=0, atol=0)
    torch.testing.assert_close(group.local(every), every[:, heads], rtol=0, atol=0)


def test_adakv_fresh_blocks_cover_the_fullest_rank():
    """F: P at TP=1 and for uniform allocation; for Ada-KV under TP the most one rank's heads can win,
    P*H_kv pages over its H heads, bounded by whole prefixes."""
    from vllm_evict.engine.request_config import parse_request
    from vllm_evict.engine.scheduler import plan_eviction

    def fresh(allocation, budget, groups, n=1000):
        spec = parse_request({"vllm_evict": {"policy": "snapkv", "budget": budget, "allocation": allocation}})
        ev = plan_eviction(spec, n, 16, groups)
        return ev.pages, ev.blocks

    assert fresh("adakv", 0.1, 1) == (7, 7)
    assert fresh("uniform", 0.1, 4) == (7, 7)
    assert fresh("adakv", 0.1, 2) == (7, 14)
    assert fresh("adakv", 0.1, 4) == (7, 28)
    assert fresh("adakv", 0.5, 4) == (32, 63)  # ceil(1000/16): no head keeps more than its prefix
