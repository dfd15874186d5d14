"""per_head.DecodeGraphTables, the per-head FULL decode graphs' tables: a mixed batch (two Ada-KV rows, a
stock row, rows past the batch) loaded and laid out per layer, against kernels/per_head_tables.py's
reference. Each layer's order lists the virtual sequences longest first, its first n*H entries permute
0 .. n*H - 1 for every graph size n >= the batch, and the layer's pages and lengths sit at those positions
while the token slots stay by (row, head). CPU (CI): in the Triton interpreter (subprocess). GPU: compiled."""

from __future__ import annotations

import pytest
import torch

from tests.kernels.interpreter import check_in_interpreter

MAX_ROWS, WIDTH = 6, 8


def check(device: str, seed: int) -> None:
    from tests.engine.test_per_head_tables import H, L, N, compacted_state
    from vllm_evict.engine.per_head import DecodeGraphTables
    from vllm_evict.engine.worker import StepPlan
    from vllm_evict.kernels.per_head_tables import decode_tables_reference

    gen = torch.Generator().manual_seed(seed)
    tables = DecodeGraphTables(num_layers=L, max_rows=MAX_ROWS, num_heads=H, max_pages=WIDTH * H, page_size=N,
                               device=torch.device(device), num_q_heads=2 * H, head_dim=8, dtype=torch.float32,
                               output_dtype=torch.float32)
    first, third = compacted_state(gen, 20, 2), compacted_state(gen, 13, 3)
    plan = StepPlan(num_reqs=3, states=[first, None, third], captures=[], compacting=[], compacted_rows=[0, 2],
                    per_head_rows=[0, 2], per_head_tokens=[0, 2], page_size=N)
    seq_lens = torch.tensor([2 * N + 5, int(torch.randint(1, WIDTH * N, (), generator=gen)), 3 * N + 2],
                            dtype=torch.int32)
    block_table = torch.randperm(3 * WIDTH * 2, generator=gen)[: 3 * WIDTH].view(3, WIDTH).to(torch.int32)
    tables.load(plan, seq_lens.to(device))
    for layer in range(L):
        order = tables.order[layer].cpu()
        for n in range(3, MAX_ROWS + 1):
            assert sorted(order[: n * H].tolist()) == list(range(n * H)), (layer, n, order)
        pages, lens, slots = tables.layer(layer, block_table.to(device), seq_lens.to(device))
        ref_pages, ref_lens, ref_slots = decode_tables_reference(
            block_table, seq_lens, tables.fresh[:3].cpu(), tables.counts[layer, :3].cpu(),
            tables.kept[layer, :3].cpu(), 1, N)
        lens, pages = lens.cpu(), pages.cpu()
        assert torch.equal(lens, ref_lens.flatten()[order[: 3 * H]]), (layer, lens, ref_lens, order)
        assert lens.tolist() == sorted(lens.tolist(), reverse=True)  # longest first
        assert torch.equal(slots.cpu(), ref_slots.flatten())
        for position, sequence in enumerate(order[: 3 * H].tolist()):
            row, head = divmod(sequence, H)
            expected = ref_pages[row][head]
            assert pages[position, : len(expected)].tolist() == expected, (layer, position, row, head)
    # The per-head rows' layouts stay; a shorter batch reorders (its first n*H entries permute 0 .. n*H - 1).
    plan.num_reqs, plan.states, plan.per_head_rows = 1, [first], [0]
    tables.load(plan, seq_lens.to(device))
    assert tables.ordered_rows == 1 and sorted(tables.order[0, :H].tolist()) == list(range(H))
    assert int(tables.fresh[2]) == 0 and int(tables.counts[:, 2].abs().sum()) == 0  # row 2 left: zeroed


def test_in_triton_interpreter():
    pytest.importorskip("triton")
    check_in_interpreter("tests.engine.test_decode_graph_tables", seeds=2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_gpu():
    for seed in range(5):
        check("cuda", seed)
