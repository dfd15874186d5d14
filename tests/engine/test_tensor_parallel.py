"""Eviction at tensor_parallel_size=2 (CPU, two worker processes, tiny GQA Llama with 2 KV heads,
so each rank holds one) against the independent torch reference, which is also what TP=1 produces
(tests/engine/test_eviction.py), uniform and Ada-KV. One engine for the module, engine core in this process so the block
pool can be read."""

from __future__ import annotations

import pytest
import torch

from tests.engine.inprocess import inprocess_llm, cpu_workers
from tests.engine.test_eviction import (PAGE, check_mixed_batch, params, random_prompt,
                                       scheduler_of)

pytestmark = pytest.mark.engine

MAX_TOKENS = 24


@pytest.fixture(scope="module")
def engine(tiny_llama):
    with cpu_workers():
        with inprocess_llm(tiny_llama, block_size=PAGE, max_num_batched_tokens=256, tensor_parallel_size=2,
                           distributed_executor_backend="mp") as llm:
            yield llm


def test_tp_group_uses_the_communicator_this_build_offers(engine):
    """The TP=2 tests of this module run through vLLM's CPU shared-memory communicator where this build has
    it (AVX-512: `torch.ops._C.init_shm_manager`), else through torch.distributed; this says which, and
    checks that the workers took the path the build offers. The shared-memory path gathers only float32,
    bf16 and fp16 (Ada-KV's int64 page counts once failed there)."""
    import torch  # noqa: F401  (torch.ops._C is vLLM's, loaded with it)
    import vllm._custom_ops  # noqa: F401

    def communicator(worker) -> str:
        import torch.distributed
        from vllm.distributed import get_tp_group

        module = get_tp_group().device_communicator.dist_module
        return "torch.distributed" if module is torch.distributed else type(module).__name__

    expected = "_CPUSHMDistributed" if hasattr(torch.ops._C, "init_shm_manager") else "torch.distributed"
    paths = engine.collective_rpc(communicator)
    print(f"TP=2 communicator path: {paths}")
    assert paths == [expected] * 2


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


def test_decode_time_eviction_matches_the_reference_at_tp2(engine, reference):
    """Decode-time eviction (DESIGN.md §4.8) under TP: each rank compacts its own heads at the same points; the
    random policy hashes the global KV head index (rank 1's head is head 1, not its local head 0), so the
    tokens equal the TP=1 reference's replay."""
    from vllm_evict.engine.request_config import parse_request

    prompt = random_prompt(14, 200)
    cases = [{"policy": "random", "decode_budget": 48, "decode_every": 32, "seed": 3},
             {"policy": "snapkv", "budget": 0.25, "decode_budget": 64, "decode_every": 32},
             {"policy": "keydiff", "budget": 64, "chunked": True, "chunk_size": 64, "decode_budget": 48,
              "decode_every": 32, "protect_prompt": True}]
    max_tokens = 100
    outputs = engine.generate([{"prompt_token_ids": prompt}] * len(cases), [params(c, max_tokens) for c in cases])
    for case, out in zip(cases, outputs):
        expected = reference.replay(prompt, max_tokens, parse_request({"vllm_evict": case}), page_size=PAGE)
        assert list(out.outputs[0].token_ids) == expected.token_ids, case
        assert out.kv_transfer_params["vllm_evict"]["decode_compactions"] >= 2, case


def test_adakv_allocates_over_all_heads_as_at_tp1(engine, reference):
    """Ada-KV under TP allocates each layer's P*H_kv pages over all H_kv heads (DESIGN.md §3.4), as TP=1 does:
    the ranks all-gather their heads' scores. Here each rank holds one of the 2 KV heads, so a rank-local
    allocation would be the uniform one; the reference's Ada-KV keeps different counts per head, and the
    tokens must equal it. The block pool is back at idle afterwards."""
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
    for case in cases[:3]:
        kept = reference.generate(prompt, 1, EvictionConfig.from_dict(case), page_size=PAGE,
                                  prefill=prefill).kept_per_layer
        uneven += any(len(set(heads)) > 1 for heads in kept)
    assert uneven >= 2  # the global allocation is not the uniform one here
    assert pool.get_num_free_blocks() == idle_free


def test_adakv_keeps_only_the_fresh_blocks_its_fullest_rank_fills(engine, reference):
    """An Ada-KV request under TP is given F = min(2P, ceil(E/16)) fresh blocks at compaction (a rank may
    win all 2P pages of a layer); the workers lay the kept pages over the F' blocks the fullest rank
    fills, over all layers, and report F'; the scheduler frees the other F - F'. At every step the
    request holds the blocks of its compacted length (F' once reported), F' is the reference's (one KV
    head per rank: the most pages one head keeps in any layer) and the report says it; the pool returns
    to idle."""

    llm_engine, scheduler = engine.llm_engine, scheduler_of(engine)
    manager = scheduler.kv_cache_manager.coordinator.single_type_managers[0]
    pool = scheduler.kv_cache_manager.block_pool
    idle_free = pool.get_num_free_blocks()
    prompt = random_prompt(13, 450)
    cases = {"adasnap": {"policy": "snapkv", "budget": 0.25, "allocation": "adakv"},
             "adadrop": {"policy": "dropkv", "budget": 0.3, "allocation": "adakv"},
             "uniform": {"policy": "dropkv", "budget": 0.3}}
    for req_id, case in cases.items():
        llm_engine.add_request(req_id, {"prompt_token_ids": prompt}, params(case, MAX_TOKENS))
    reports, settled = {}, set()
    while llm_engine.has_unfinished_requests():
        for out in llm_engine.step():
            if out.finished:
                reports[out.request_id] = out.kv_transfer_params["vllm_evict"]
        for req_id, ev in scheduler.evictions.items():
            if ev.compacted:
                physical = ev.held_blocks * PAGE + scheduler.requests[req_id].num_computed_tokens - ev.evict_at
                assert len(manager.req_to_blocks[req_id]) == -(-physical // PAGE), req_id
                if ev.unused is not None and ev.blocks > ev.pages:
                    settled.add(req_id.rsplit("-", 1)[0])
    assert settled == {"adasnap", "adadrop"}
    check_fresh_blocks(reference, prompt, cases, reports)
    assert pool.get_num_free_blocks() == idle_free


def test_adakv_evicts_again_at_tp2_as_the_reference(engine, reference):
    """Ada-KV evicting again under TP (DESIGN.md §4.8): an in-place point writes over the request's first
    min(2 P_d, its held blocks) blocks, as many as one rank's heads can win, and the scheduler frees those
    its fullest rank left empty once the workers report them (CompactionSchedule.written_blocks). Block-wise
    prompt points that another may follow in the next step keep them all. Tokens equal the TP=1 reference's
    replay; at every step each request holds the blocks of its compacted length; blocks were trimmed at one
    point at least; the pool returns to idle."""
    from vllm_evict.engine.request_config import parse_request

    llm_engine, scheduler = engine.llm_engine, scheduler_of(engine)
    manager = scheduler.kv_cache_manager.coordinator.single_type_managers[0]
    pool = scheduler.kv_cache_manager.block_pool
    idle_free = pool.get_num_free_blocks()
    prompt = random_prompt(15, 300)
    cases = {"decode": {"policy": "snapkv", "decode_budget": 48, "decode_every": 32, "allocation": "adakv"},
             "one-shot": {"policy": "dropkv", "budget": 0.3, "decode_budget": 64, "decode_every": 32,
                          "allocation": "adakv"},
             "block-wise": {"policy": "keydiff", "budget": 96, "chunked": True, "chunk_size": 64, "chunk_budget": 96,
                            "decode_budget": 64, "decode_every": 48, "allocation": "adakv"},  # in-place points
             "uniform": {"policy": "tova", "budget": 0.3, "decode_budget": 48, "decode_every": 32}}
    max_tokens = 100
    kv_manager, trims = scheduler.kv_cache_manager, []

    def recording_trim(request_id, ev, used):  # (blocks written, F') of every report
        trims.append((ev.trimming, used))
        type(kv_manager).trim(kv_manager, request_id, ev, used)

    kv_manager.trim = recording_trim
    try:
        for req_id, case in cases.items():
            llm_engine.add_request(req_id, {"prompt_token_ids": prompt}, params(case, max_tokens))
        tokens, reports = {}, {}
        while llm_engine.has_unfinished_requests():
            for out in llm_engine.step():
                if out.finished:
                    tokens[out.request_id] = list(out.outputs[0].token_ids)
                    reports[out.request_id] = out.kv_transfer_params["vllm_evict"]
            for req_id, ev in scheduler.evictions.items():
                if ev.compacted and not ev.swap_pending:
                    physical = scheduler.requests[req_id].num_computed_tokens - ev.removed
                    assert len(manager.req_to_blocks[req_id]) == -(-physical // PAGE), req_id
    finally:
        del kv_manager.trim
    for req_id, case in cases.items():
        expected = reference.replay(prompt, max_tokens, parse_request({"vllm_evict": case}), page_size=PAGE)
        assert tokens[req_id] == expected.token_ids, case
        assert reports[req_id]["decode_compactions"] >= 2, case
    assert any(used < written for written, used in trims), trims
    assert pool.get_num_free_blocks() == idle_free


def check_fresh_blocks(reference, prompt, cases, reports):
    """Each report's blocks_after is F' of the reference's allocation (one KV head per rank: the most pages
    one head keeps in any layer; P under uniform allocation), and F' < F for one Ada-KV case at least."""
    from vllm_evict.policies import EvictionConfig

    prefill = reference.prefill(prompt)
    trimmed = 0
    for req_id, case in cases.items():
        config = EvictionConfig.from_dict(case)
        pages = config.num_pages(len(prompt), PAGE)
        expected = pages
        if config.allocation == "adakv":
            kept = reference.generate(prompt, 1, config, page_size=PAGE, prefill=prefill).kept_per_layer
            expected = max(-(-k // PAGE) for heads in kept for k in heads)
            trimmed += expected < min(2 * pages, -(-len(prompt) // PAGE))
        assert (reports[req_id]["pages_per_head"], reports[req_id]["blocks_after"]) == (pages, expected), req_id
    assert trimmed >= 1  # F' < F: blocks were freed after compaction


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


@pytest.mark.parametrize("dtype", [torch.int64, torch.float64, torch.float32, torch.bfloat16])
def test_scores_and_counts_cross_ranks_through_a_float_only_gather(dtype):
    """Ada-KV gathers int64 page counts and sorted scores (float64 for the random policy); vLLM's CPU
    shared-memory all-gather implements only float32/bf16/fp16 and raises for anything else. Through
    a gather with that restriction, every value comes back bit for bit (int64 words whose float32
    halves are NaN or denormal patterns included)."""
    from vllm_evict.engine.compaction import GATHERED_DTYPES, KVHeadGroup, gather_as_float

    world, num_layers, total = 2, 3, 4
    owned = [[0, 1], [2, 3]]
    if dtype.is_floating_point:
        every = torch.randn(num_layers, total, 7, dtype=torch.float64).to(dtype)
    else:
        every = torch.randint(-(1 << 62), 1 << 62, (num_layers, total, 7), dtype=dtype)
        every[0, 0, :3] = torch.tensor([-1, (0x7FC00001 << 32) | 0x7FC00001, 1])  # NaN and denormal halves
    ranks = [every[:, heads].unsqueeze(0).contiguous() for heads in owned]

    def float_only_all_gather(local, dim):  # what each rank sees: the ranks' inputs concatenated on dim 0
        if local.dtype not in GATHERED_DTYPES:
            raise NotImplementedError(f'"shm_all_gather_impl" not implemented for {local.dtype}')
        assert dim == 0
        return torch.cat([r.view(local.dtype) for r in ranks], dim=0)

    if dtype not in GATHERED_DTYPES:  # gathered as it is, it fails as on the AVX-512 machine
        with pytest.raises(NotImplementedError):
            float_only_all_gather(ranks[0], dim=0)
    gathered = gather_as_float(float_only_all_gather, ranks[0])
    assert gathered.dtype == dtype
    merged = KVHeadGroup(rank=0, world=world, total=total).merge(gathered)
    assert torch.equal(merged.contiguous().view(torch.uint8), every.view(torch.uint8))
