"""kernels/adakv_pages.py: Ada-KV's allocation kernel against its torch reference, policies.budget.adakv_pages.

Fresh random rows of descending scores: distinct, tied (a few distinct values, so tau falls inside a run of
ties shared by several heads), with +inf protected entries, with zeros of both signs, and ragged held sets
(-inf padding); several heads, page sizes, budgets P (a few pages too, where the rounding gives pages back)
and alphas. CPU (CI): the kernel in the Triton
interpreter (subprocess). GPU (``-m gpu``): the compiled kernel."""

from __future__ import annotations

import pytest
import torch

from tests.kernels.interpreter import check_in_interpreter


def random_case(gen: torch.Generator) -> dict:
    """One call's arguments: sorted scores [L, H, n], P, page size, alpha, max_protected, lengths or None."""
    layers = int(torch.randint(1, 5, (), generator=gen))
    heads = [2, 4, 8][int(torch.randint(0, 3, (), generator=gen))]
    page_size = [4, 16][int(torch.randint(0, 2, (), generator=gen))]
    n = int(torch.randint(3 * page_size, 2600, (), generator=gen))
    kind = int(torch.randint(0, 4, (), generator=gen))
    scores = torch.randn(layers, heads, n, generator=gen)
    if kind == 1:  # ties across heads
        scores = torch.randint(0, 6, (layers, heads, n), generator=gen).float()
    elif kind == 2:  # zeros of both signs among ties
        scores = torch.randint(-1, 2, (layers, heads, n), generator=gen).float() * 0.0
        scores[torch.rand(layers, heads, n, generator=gen) < 0.3] = 1.0
    protected = int(torch.randint(0, 3 * page_size, (), generator=gen))
    if protected:  # the first tokens of some heads are protected (+inf)
        for layer in range(layers):
            rows = torch.rand(heads, generator=gen) < 0.6
            scores[layer, rows, : min(protected, n)] = float("inf")
    lengths = None
    if kind == 3:  # ragged held sets: -inf past each head's count
        lengths = torch.randint(1, n + 1, (layers, heads), generator=gen)
        scores[torch.arange(n).view(1, 1, -1) >= lengths.unsqueeze(-1)] = float("-inf")
    # a few pages against a protected prefix of some: heads raised to p_min overshoot P*H, and pages go back
    few = bool(torch.rand((), generator=gen) < 0.3)
    pages = int(torch.randint(1, 4 if few else max(2, -(-n // page_size)), (), generator=gen))
    alpha = [0.0, 0.2, 0.35, 0.5, 1.0][int(torch.randint(0, 5, (), generator=gen))]
    sorted_scores = torch.sort(scores, dim=-1, descending=True).values
    return dict(sorted_scores=sorted_scores, pages=pages, page_size=page_size, alpha=alpha,
                max_protected=protected + int(torch.randint(0, 2 * page_size, (), generator=gen)), lengths=lengths)


def check(device: str, seed: int) -> None:
    from vllm_evict.kernels.adakv_pages import adakv_pages_fused
    from vllm_evict.policies.budget import adakv_pages

    gen = torch.Generator().manual_seed(seed)
    for case in range(12):
        args = random_case(gen)
        sorted_scores, lengths, pages = args.pop("sorted_scores"), args.pop("lengths"), args.pop("pages")
        expected = adakv_pages(sorted_scores, pages, sorted_scores=sorted_scores, lengths=lengths, **args)
        on_device = None if lengths is None else lengths.to(device)
        got = adakv_pages_fused(sorted_scores.to(device), pages, lengths=on_device, **args).cpu()
        assert torch.equal(got, expected), f"seed {seed} case {case} P={pages} {args} ragged={lengths is not None}: " \
                                           f"{got.tolist()} != {expected.tolist()}"


def test_kernel_in_triton_interpreter():
    pytest.importorskip("triton")
    check_in_interpreter("tests.kernels.test_adakv_pages", seeds=3)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_kernel_on_gpu():
    for seed in range(20):
        check("cuda", seed)
