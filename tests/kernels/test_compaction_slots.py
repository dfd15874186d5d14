"""kernels/compaction_slots.py against its torch form, vllm_evict.engine.compaction.compaction_slots_torch.

Fresh random kept masks (empty heads, full heads, ragged), page counts that cover each head's kept tokens
(and some spare pages), one request's fresh blocks [F] or R requests' [R, F] (int32 and int64), num_blocks
as None, an int or a device scalar, several head counts (a power of two and not), page sizes and token
counts past one tile. CPU (CI): the kernel in the Triton interpreter (subprocess). GPU (``-m gpu``): the
compiled kernel."""

from __future__ import annotations

import pytest
import torch

from tests.kernels.interpreter import check_in_interpreter


def random_case(gen: torch.Generator) -> dict:
    """One call's arguments (CPU tensors)."""
    requests = int(torch.randint(0, 3, (), generator=gen))   # 0: one request, fresh_blocks [F]
    layers = int(torch.randint(1, 4, (), generator=gen))
    heads = [1, 2, 3, 8][int(torch.randint(0, 4, (), generator=gen))]
    page_size = [4, 16][int(torch.randint(0, 2, (), generator=gen))]
    tokens = int(torch.randint(1, 1300, (), generator=gen))
    lead = (max(requests, 1), layers) if requests else (layers,)
    density = torch.rand(*lead, heads, 1, generator=gen)            # per head: from none kept to all
    keep = torch.rand(*lead, heads, tokens, generator=gen) < density
    keep[..., 0, :] &= bool(torch.rand((), generator=gen) < 0.8)     # sometimes a head keeps nothing
    needed = -(-keep.sum(-1) // page_size)
    page_counts = needed + torch.randint(0, 2, needed.shape, generator=gen)
    most = int(page_counts.sum(-1).max())
    blocks = max(1, -(-most // heads))                              # fresh blocks the pages fill
    F = blocks + int(torch.randint(0, 3, (), generator=gen))
    dtype = [torch.int32, torch.int64][int(torch.randint(0, 2, (), generator=gen))]
    fresh = torch.randperm(4 * F * max(requests, 1), generator=gen)[: F * max(requests, 1)].to(dtype)
    fresh = fresh.view(requests, F) if requests else fresh
    kind = int(torch.randint(0, 3, (), generator=gen))
    num_blocks = None if kind == 0 else blocks if kind == 1 else torch.tensor(blocks)  # None: all F blocks
    return dict(keep=keep, page_counts=page_counts, fresh_blocks=fresh, page_size=page_size, num_blocks=num_blocks)


def check(device: str, seed: int) -> None:
    from vllm_evict.engine.compaction import compaction_slots_torch
    from vllm_evict.kernels.compaction_slots import compaction_slots_fused

    gen = torch.Generator().manual_seed(seed)
    for case in range(10):
        args = random_case(gen)
        expected = compaction_slots_torch(**args)
        on_device = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in args.items()}
        got = compaction_slots_fused(**on_device)
        assert got.is_contiguous() and got.dtype == torch.int64
        assert torch.equal(got.cpu(), expected), (
            f"seed {seed} case {case}: keep {tuple(args['keep'].shape)} fresh {tuple(args['fresh_blocks'].shape)} "
            f"page {args['page_size']} num_blocks {args['num_blocks']}")


def test_kernel_in_triton_interpreter():
    pytest.importorskip("triton")
    check_in_interpreter("tests.kernels.test_compaction_slots", seeds=3)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_kernel_on_gpu():
    for seed in range(20):
        check("cuda", seed)
