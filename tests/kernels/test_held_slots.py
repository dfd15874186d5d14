"""kernels/held_slots.py against its torch form, vllm_evict.engine.per_head.held_slots_torch.

Fresh random per-head layouts: pages per head (none to many), spans F, tail blocks, held counts below,
at and past what the pages and the gathered width n cover, counts and kept as layer-group views of [R, L, H]
tensors (strided, as the engine passes them) and fresh as a row of a [2, R] tensor; several head counts (a
power of two and not), page sizes and widths past one tile. CPU (CI): the kernel in the Triton interpreter
(subprocess). GPU (``-m gpu``): the compiled kernel."""

from __future__ import annotations

import pytest
import torch

from tests.kernels.interpreter import check_in_interpreter


def random_case(gen: torch.Generator) -> dict:
    """One layout (CPU tensors): counts and kept [R, L, H], scalars [2, R] (tokens since, spans F), row_blocks
    [R, Wb], the layer group (first, G), n and the page size."""
    R = int(torch.randint(1, 5, (), generator=gen))
    L = int(torch.randint(1, 5, (), generator=gen))
    H = [1, 2, 3, 8][int(torch.randint(0, 4, (), generator=gen))]
    page = [4, 16][int(torch.randint(0, 2, (), generator=gen))]
    spans = torch.randint(1, 6, (R,), generator=gen)
    counts = torch.randint(0, 7, (R, L, H), generator=gen)
    counts = torch.minimum(counts, (spans * H).view(R, 1, 1))           # a layout's pages fit its F blocks
    tail = int(torch.randint(0, 4, (), generator=gen))
    width_blocks = int(spans.max()) + tail + int(torch.randint(0, 2, (), generator=gen))
    row_blocks = torch.stack([torch.randperm(1000, generator=gen)[:width_blocks] for _ in range(R)])
    kept = counts * page - torch.randint(0, page, (R, L, H), generator=gen).clamp(max=counts * page)
    since = torch.randint(0, tail * page + 2, (R,), generator=gen)
    first = int(torch.randint(0, L, (), generator=gen))
    G = int(torch.randint(1, L - first + 1, (), generator=gen))
    most = int((kept.narrow(1, first, G) + since.view(R, 1, 1)).max())
    n = max(1, most + int(torch.randint(-page, page + 1, (), generator=gen)))  # below, at and past the most held
    return dict(counts=counts, kept=kept, scalars=torch.stack([since, spans]), row_blocks=row_blocks, first=first,
                G=G, n=n, page_size=page)


def arguments(case: dict, device: str) -> dict:
    """held_slots' arguments on `device` as _gather_heads passes them: the group's strided views of [R, L, H],
    held = kept + since, fresh a row of the [2, R] scalars."""
    counts, kept, scalars = (case[k].to(device) for k in ("counts", "kept", "scalars"))
    R = counts.shape[0]
    return dict(counts=counts.narrow(1, case["first"], case["G"]),
                held=kept.narrow(1, case["first"], case["G"]) + scalars[0].view(R, 1, 1), fresh=scalars[1],
                row_blocks=case["row_blocks"].to(device), n=case["n"], page_size=case["page_size"])


def check(device: str, seed: int) -> None:
    from vllm_evict.engine.per_head import held_slots_torch
    from vllm_evict.kernels.held_slots import held_slots_fused

    gen = torch.Generator().manual_seed(seed)
    for case in range(10):
        args = random_case(gen)
        expected = held_slots_torch(**arguments(args, "cpu"))
        got = held_slots_fused(**arguments(args, device))
        assert torch.equal(got.cpu(), expected), (
            f"seed {seed} case {case}: counts {tuple(args['counts'].shape)} group {args['first']}+{args['G']} "
            f"n {args['n']} page {args['page_size']}")


def test_kernel_in_triton_interpreter():
    pytest.importorskip("triton")
    check_in_interpreter("tests.kernels.test_held_slots", seeds=3)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_kernel_on_gpu():
    for seed in range(20):
        check("cuda", seed)
