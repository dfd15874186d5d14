"""The engine-start warm-up runs the engine's own compaction path (worker.compact_one) for every policy and
allocation: every layer of every state is compacted to P pages per head on average (DESIGN.md §3), on the CPU
backend's cache adapter (the CUDA one runs in the GPU engine tests)."""

from __future__ import annotations

import torch

from vllm_evict.policies import ALLOCATIONS, POLICIES


def test_warm_up_compacts_every_policy_and_allocation():
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    from vllm_evict.engine.cpu_backend import CpuPagedCache
    from vllm_evict.engine.warm_up import warm_up

    num_kv, page = 2, 16
    isa = _get_attn_isa(torch.float32, page, 32)
    states = warm_up(lambda kv: CpuPagedCache(kv, isa, 1.0, 1.0, "auto"), torch.device("cpu"), 8, num_kv, 32,
                     torch.float32, page)
    assert len(states) == len(POLICIES) * len(ALLOCATIONS) and {s.spec.config.policy for s in states} == set(POLICIES)
    assert any(s.spec.config.allocation == "adakv" for s in states)
    for state in states:
        assert sorted(state.layers) == [0, 1]
        again = state.spec.config.allocation == "adakv"  # then compacted again at a decode point, in place
        assert state.done == (2 if again else 0)
        for layer in state.layers.values():
            assert int(layer.page_counts.sum()) == state.pages * num_kv  # P_d = P here
            expected = torch.clamp(layer.page_counts * page, max=state.evict_at)
            if again:  # a head that keeps all it held ends in a partly filled page
                assert (layer.kept <= expected).all() and (layer.kept > expected - page).all()
            else:
                assert torch.equal(layer.kept, expected), (state.spec.config.policy, state.spec.config.allocation)
