"""Per-head virtual tables of a mixed batch, all layers at once, against a per-(layer, head, row) loop.

Pure torch (no vLLM kernels): rows that are not compacted, compacted rows decoding one token, and a
compacted row continuing with a multi-token chunk (question-agnostic protocol), over several layers
with uneven (Ada-KV-like) page counts."""

import pytest
import torch

from vllm_evict.engine import per_head
from vllm_evict.engine.compaction import LayerCompaction, assign_head_pages
from vllm_evict.engine.request_config import RequestEviction
from vllm_evict.engine.worker import StepPlan, WorkerEviction
from vllm_evict.policies import EvictionConfig

N, H, L = 4, 3, 3  # page size, KV heads, layers


def compacted_state(rng, evict_at, num_fresh, fresh_first):
    fresh = list(range(fresh_first, fresh_first + num_fresh))
    config = EvictionConfig.from_dict({"policy": "keydiff", "budget": 8})
    state = WorkerEviction(req_id="r", spec=RequestEviction(config), evict_at=evict_at, pages=num_fresh, window=0,
                           compacted=True)
    for layer in range(L):
        # uneven pages per head (at least one each), P*H in all
        counts = 1 + torch.bincount(torch.randint(0, H, (num_fresh * H - H,), generator=rng), minlength=H)
        pages = assign_head_pages(counts.tolist(), fresh, H)
        width = max(len(p) for p in pages)
        kept = torch.minimum(counts * N, torch.tensor(evict_at))
        state.layers[layer] = LayerCompaction(
            pages=torch.tensor([p + [0] * (width - len(p)) for p in pages], dtype=torch.int32),
            page_counts=counts.to(torch.int64), kept=kept.to(torch.int64))
    return state


def expected_pages(state, row_blocks, layer, head):
    """The page list of virtual sequence (layer, head) and its shift, built one entry at a time."""
    if state is None:
        return [b * H + head for b in row_blocks], 0
    layout = state.layers[layer]
    kept_pages = layout.pages[head, : int(layout.page_counts[head])].tolist()
    tail = [b * H + head for b in row_blocks[state.pages:]]
    return kept_pages + tail, state.evict_at - int(layout.kept[head])


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_virtual_tables_match_per_sequence_loop(seed):
    rng = torch.Generator().manual_seed(seed)
    # row 0: plain request prefilling 5 tokens at positions 7..11 (3 blocks)
    # row 1: compacted (E=20, P=2), decoding one token at position 26 (2 fresh + 2 tail blocks)
    # row 2: compacted (E=13, P=3), continuing with a 6-token chunk at positions 13..18 (3 fresh + 2 tail)
    s1 = compacted_state(rng, 20, 2, 40)
    s2 = compacted_state(rng, 13, 3, 50)
    rows = [[1, 2, 3], [40, 41, 60, 61], [50, 51, 52, 70, 71]]
    seq_lens = torch.tensor([12, 27, 19])
    chunk = [5, 1, 6]
    width = 6
    block_table = torch.tensor([r + [0] * (width - len(r)) for r in rows], dtype=torch.int32)
    qsl = torch.tensor([0, 5, 6, 12], dtype=torch.int32)
    states = [None, s1, s2]
    plan = StepPlan(num_reqs=3, states=states, captures=[], compacting=[], compacted_rows=[1, 2], page_size=N,
                    max_blocks=5, row_blocks=[len(r) for r in rows])
    for layer in range(L):
        tables = per_head.virtual_tables(plan, layer, block_table, seq_lens, qsl, 12, H)
        token = 0
        for r, (state, blocks) in enumerate(zip(states, rows)):
            for t in range(chunk[r]):
                pos = int(seq_lens[r]) - chunk[r] + t
                for h in range(H):
                    pages, shift = expected_pages(state, blocks, layer, h)
                    vpos = pos - shift
                    assert int(tables.slots[token + t, h]) == pages[vpos // N] * N + vpos % N
            for h in range(H):
                pages, shift = expected_pages(state, blocks, layer, h)
                vlen = int(seq_lens[r]) - shift
                assert int(tables.shift[h, r]) == shift
                assert int(tables.seq_lens[h, r]) == vlen
                used = -(-vlen // N)
                assert tables.pages[h, r, :used].tolist() == pages[:used]
            token += chunk[r]
    vqsl = plan.tables.query_start_loc
    assert vqsl.tolist() == [h * 12 + s for h in range(H) for s in (0, 5, 6)] + [H * 12]
