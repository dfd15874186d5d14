"""Per-head virtual tables of a mixed batch, all layers at once, against a per-(layer, head, row) loop.

Pure torch (no vLLM kernels): rows that are not compacted, compacted rows decoding one token, and a
compacted row continuing with a multi-token chunk (question-agnostic protocol), over several layers
with uneven (Ada-KV-like) page counts."""

import pytest
import torch

from vllm_evict.engine import per_head
from vllm_evict.engine.compaction import LayerCompaction
from vllm_evict.engine.request_config import RequestEviction
from vllm_evict.engine.request_state import WorkerEviction, kept_most
from vllm_evict.engine.step import StepPlan
from vllm_evict.policies import EvictionConfig

N, H, L = 4, 3, 3  # page size, KV heads, layers


def compacted_state(rng, evict_at, num_fresh):
    config = EvictionConfig.from_dict({"policy": "keydiff", "budget": num_fresh * N, "allocation": "adakv"})
    state = WorkerEviction.for_prompt("r", RequestEviction(config), evict_at, N)
    assert state.pages == num_fresh
    state.advance()  # compacted
    for layer in range(L):
        # uneven pages per head (at least one each), P*H in all
        counts = 1 + torch.bincount(torch.randint(0, H, (num_fresh * H - H,), generator=rng), minlength=H)
        kept = torch.minimum(counts * N, torch.tensor(evict_at))
        state.layers[layer] = LayerCompaction(page_counts=counts.to(torch.int64), kept=kept.to(torch.int64))
    return state


def expected_pages(state, row_blocks, layer, head):
    """The page list of virtual sequence (layer, head) and its shift against the worker-shifted
    positions, built one entry at a time from the flat-slot rule (compaction.py)."""
    if state is None:
        return [b * H + head for b in row_blocks], 0
    layout, P = state.layers[layer], state.pages
    start = int(layout.page_counts[:head].sum())
    kept_pages = [row_blocks[s % P] * H + s // P for s in range(start, start + int(layout.page_counts[head]))]
    tail = [b * H + head for b in row_blocks[P:]]
    return kept_pages + tail, P * N - int(layout.kept[head])


def check_step(states, rows, seq_lens, chunk, cache):
    """Build one step's plan for rows (block lists) and check every layer against the loop."""
    width = 6
    block_table = torch.tensor([r + [0] * (width - len(r)) for r in rows], dtype=torch.int32)
    starts = [sum(chunk[:i]) for i in range(len(chunk))]
    qsl = torch.tensor(starts + [sum(chunk)], dtype=torch.int32)
    compacted_rows = [r for r, st in enumerate(states) if st is not None]
    tokens = [starts[r] + t for r in compacted_rows for t in range(chunk[r])]
    plan = StepPlan(num_reqs=len(rows), states=states, captures=[], compacting=[], compacted_rows=compacted_rows,
                    per_head_rows=compacted_rows, per_head_tokens=tokens, page_size=N,
                    max_blocks=max(len(r) for r in rows), row_blocks=[len(r) for r in rows], cache=cache)
    # the worker hands attention the compacted rows' lengths shifted by E - P*N
    seq_lens = seq_lens - torch.tensor([0 if st is None else st.shift for st in states], dtype=seq_lens.dtype)
    n = sum(chunk)
    for layer in range(L):
        tables = per_head.virtual_tables(plan, layer, block_table, seq_lens, qsl, n, H)
        for r, (state, blocks) in enumerate(zip(states, rows)):
            for t in range(chunk[r]):
                pos = int(seq_lens[r]) - chunk[r] + t
                for h in range(H):
                    pages, shift = expected_pages(state, blocks, layer, h)
                    vpos = pos - shift
                    assert int(tables.slots[starts[r] + t, h]) == pages[vpos // N] * N + vpos % N
            for h in range(H):
                pages, shift = expected_pages(state, blocks, layer, h)
                vlen = int(seq_lens[r]) - shift
                assert int(tables.shift[h, r]) == shift
                assert int(tables.seq_lens[h, r]) == vlen
                used = -(-vlen // N)
                assert tables.pages[h, r, :used].tolist() == pages[:used]
    vqsl = plan.tables.query_start_loc
    assert vqsl.tolist() == [h * n + s for h in range(H) for s in starts] + [H * n]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_virtual_tables_match_per_sequence_loop(seed):
    rng = torch.Generator().manual_seed(seed)
    # row 0: plain request prefilling 5 tokens at positions 7..11 (3 blocks)
    # row 1: compacted (E=20, P=2), decoding one token at position 26 (2 fresh + 2 tail blocks)
    # row 2: compacted (E=13, P=3), continuing with a 6-token chunk at positions 13..18 (3 fresh + 2 tail)
    s1 = compacted_state(rng, 20, 2)
    s2 = compacted_state(rng, 13, 3)
    rows = [[1, 2, 3], [40, 41, 60, 61], [50, 51, 52, 70, 71]]
    check_step([None, s1, s2], rows, torch.tensor([12, 27, 19]), [5, 1, 6], {})


def test_row_stack_cache_follows_the_batch():
    """Steps share the cross-step cache: same rows reuse it, a reordered or new request rebuilds it."""
    rng = torch.Generator().manual_seed(7)
    s1, s2 = compacted_state(rng, 20, 2), compacted_state(rng, 13, 3)
    cache = {}
    rows = [[1, 2, 3], [40, 41, 60, 61], [50, 51, 52, 70, 71]]
    check_step([None, s1, s2], rows, torch.tensor([12, 27, 19]), [5, 1, 6], cache)
    held = cache["stacked_rows"]
    # next step: same requests, one more block for rows 0 and 1, decode everywhere
    rows = [[1, 2, 3, 4], [40, 41, 60, 61, 62], [50, 51, 52, 70, 71]]
    check_step([None, s1, s2], rows, torch.tensor([13, 28, 20]), [1, 1, 1], cache)
    assert cache["stacked_rows"] is held
    # the batch reorders (row 1 <-> row 2), then a new eviction replaces s1 in the same row
    check_step([None, s2, s1], [rows[0], rows[2], rows[1]], torch.tensor([13, 20, 28]), [1, 1, 1], cache)
    assert cache["stacked_rows"] is not held
    s3 = compacted_state(rng, 20, 2)
    check_step([None, s2, s3], [rows[0], rows[2], rows[1]], torch.tensor([13, 20, 28]), [1, 1, 1], cache)


def test_split_kv_from_the_rows_lengths(monkeypatch):
    """A per-head graph step lets FlashAttention split KV only when the longest virtual sequence holds more
    than SPLIT_KV_RATIO times the batch's KV tokens per SM, and more than SPLIT_KV_MIN_TOKENS. A stock row's
    heads are at its (shifted) length; a per-head row's longest head is the most any head kept at its point
    plus the tokens written since."""
    assert not per_head.split_kv(per_head.SPLIT_KV_MIN_TOKENS, 1, 132)
    assert per_head.split_kv(per_head.SPLIT_KV_MIN_TOKENS + 1, 1, 132)
    monkeypatch.setattr(per_head, "SPLIT_KV_MIN_TOKENS", 0)  # this test's lengths are tiny
    from types import SimpleNamespace

    import numpy as np

    from vllm_evict.engine.worker import WorkerEvictionState

    state = compacted_state(torch.Generator().manual_seed(3), 40, 4)  # E=40, P=4: shift 24
    state.layers[1].kept[0] = 40  # one head of one layer kept every prompt token
    kept_most([state])
    plan = StepPlan(num_reqs=2, states=[None, state], captures=[], compacting=[], compacted_rows=[1],
                    per_head_rows=[1], per_head_tokens=[1], page_size=N,
                    row_shift=np.array([0, state.shift]))  # as shift_positions records it
    # row 0: plain, 30 tokens written with this step's; row 1: 50 written (26 after its shift), 10 since E
    runner = SimpleNamespace(query_start_loc=SimpleNamespace(np=np.array([0, 1, 2])),
                             input_batch=SimpleNamespace(num_computed_tokens_cpu=np.array([29, 49])))
    worker = WorkerEvictionState()
    worker.num_kv_heads = H
    longest, total = 40 + 10, (30 + 26) * H
    for num_sms in range(1, 12):
        worker.num_sms = num_sms
        expected = longest * num_sms > per_head.SPLIT_KV_RATIO * total
        assert worker._split_kv(runner, plan) == expected == per_head.split_kv(longest, total, num_sms)
    # Before its kept counts reach the host, the per-head row counts at its shifted length: 30 is longest.
    state.most_kept = state.fullest_offset = None
    worker.num_sms = 9  # 50 * 9 > 1.75 * 168 but 30 * 9 is not
    assert per_head.split_kv(50, total, 9) and not worker._split_kv(runner, plan)


def test_stacked_counts_follow_the_recorded_groups():
    """stacked_counts slices the layer groups a compaction recorded (a hybrid model's attention layers are not
    consecutive; groups of one batch hold several requests; a layer recorded again splits its group) instead
    of a view per layer: equal to stacking each layer's layout, with zero rows for the layers without
    attention."""
    from vllm_evict.engine.compaction import LayerLayouts

    torch.manual_seed(2)
    H, R = 4, 3
    groups = [[1, 3, 5], [7], [9, 11]]  # layer indices of three recorded groups, in layer order
    recorded = [(torch.randint(0, 9, (R, len(g), H)), torch.randint(0, 99, (R, len(g), H))) for g in groups]
    for r in range(R):
        state = WorkerEviction.for_prompt("r", RequestEviction(EvictionConfig.from_dict(
            {"policy": "snapkv", "budget": 32, "allocation": "adakv"})), 200, 16)
        state.layers = LayerLayouts()
        for indices, (counts, kept) in zip(groups, recorded):
            state.layers.record(indices, counts[r], kept[r])
        state.layers[3] = LayerCompaction(torch.full((H,), 7), torch.full((H,), 70))  # splits the first group
        counts, kept = per_head.stacked_counts(state, torch.device("cpu"))
        expected_counts, expected_kept = torch.zeros(12, H, dtype=torch.int64), torch.zeros(12, H, dtype=torch.int64)
        for index in state.layers:
            expected_counts[index], expected_kept[index] = state.layers[index].page_counts, state.layers[index].kept
        assert torch.equal(counts, expected_counts) and torch.equal(kept, expected_kept)
        assert counts[1:12:2].ne(0).any() and counts[0:12:2].eq(0).all()
