"""The reference on CUDA (run through the device tool): same scores as on CPU, TF32 off, state restored."""

from __future__ import annotations

import pytest
import torch

from vllm_evict.policies import POLICIES, allocate_pages, score_tokens, select_tokens

from .conftest import random_qkv

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def near_tie_ok(ref, mask_a, mask_b, kept):
    """DESIGN.md §7.3: kept sets equal except at entries within 1e-3 relative of the K-th largest reference score."""
    for i in range(ref.shape[0]):
        diff = (mask_a[i] ^ mask_b[i]).nonzero().flatten()
        if len(diff) == 0:
            continue
        tau = torch.sort(ref[i], descending=True, stable=True).values[kept[i] - 1]
        assert torch.all((ref[i, diff] - tau).abs() <= 1e-3 * tau.abs() + 1e-30)


@pytest.mark.parametrize("policy", list(POLICIES))
def test_cuda_matches_cpu_with_tf32_requested(policy):
    q, k, v = random_qkv(n=700, w=32, h_kv=4, g=4, d=64, seed=40, dtype=torch.bfloat16)
    ref = score_tokens(policy, q, k, v)
    old = torch.backends.cuda.matmul.fp32_precision
    torch.backends.cuda.matmul.fp32_precision = "tf32"  # a caller that enabled TF32 globally
    try:
        got = score_tokens(policy, q.cuda(), k.cuda(), v.cuda())
        assert torch.backends.cuda.matmul.fp32_precision == "tf32"  # restored
    finally:
        torch.backends.cuda.matmul.fp32_precision = old
    assert got.is_cuda and got.dtype == (torch.float64 if policy == "random" else torch.float32)
    # keydiff is a cosine in [-1, 1]: near-zero cosines only agree to fp32 rounding of the dot product
    atol = 1e-6 if policy == "keydiff" else 1e-30
    torch.testing.assert_close(got.cpu(), ref, rtol=1e-4, atol=atol)
    for alloc in ("uniform", "adakv"):
        pr = allocate_pages(ref, 0.2, allocation=alloc)
        pg = allocate_pages(got, 0.2, allocation=alloc)
        mr = select_tokens(ref, 0.2, allocation=alloc)
        mg = select_tokens(got, 0.2, allocation=alloc)
        assert mg.is_cuda
        if torch.equal(pr, pg):
            near_tie_ok(ref, mr, mg.cpu(), (pr * 16).tolist())


@pytest.mark.parametrize("policy", list(POLICIES))
def test_ragged_held_sets_on_cuda_match_cpu(policy):
    """DESIGN.md §4.8 a on CUDA (lengths on the device): scores as on the CPU, -inf in the same padding, and the
    same pages and kept sets when the pages agree."""
    q, k, v = random_qkv(n=500, w=16, h_kv=4, g=4, d=64, seed=41, dtype=torch.bfloat16)
    lengths = torch.tensor([500, 16, 301, 130])
    ref = score_tokens(policy, q, k, v, lengths=lengths)
    got = score_tokens(policy, q.cuda(), k.cuda(), v.cuda(), lengths=lengths.cuda())
    assert torch.equal(torch.isneginf(got.cpu()), torch.isneginf(ref))
    atol = 1e-6 if policy == "keydiff" else 1e-30
    torch.testing.assert_close(got.cpu(), ref, rtol=1e-4, atol=atol)
    for alloc in ("uniform", "adakv"):
        pr = allocate_pages(ref, 64, allocation=alloc, lengths=lengths)
        pg = allocate_pages(got, 64, allocation=alloc, lengths=lengths.cuda())
        mr = select_tokens(ref, 64, allocation=alloc, lengths=lengths)
        mg = select_tokens(got, 64, allocation=alloc, lengths=lengths.cuda())
        if torch.equal(pr, pg):
            near_tie_ok(ref, mr, mg.cpu(), torch.minimum(pr * 16, lengths).tolist())


def test_policy_without_kernel_runs_the_reference_on_cuda(monkeypatch):
    """A window policy that does not declare `has_kernel` never reaches the registered CUDA kernel."""
    from vllm_evict.policies import register_raw_kernel
    from vllm_evict.policies import window as window_module
    from vllm_evict.policies.base import WindowPolicy

    class PeakAttention(WindowPolicy):
        name = "toy-peak"
        default_window = 8

        def head_raw(self, st):
            return st.p.amax(dim=1)

    def kernel(*args, **kwargs):
        raise AssertionError("the kernel was called for a policy it does not implement")

    monkeypatch.setitem(POLICIES, PeakAttention.name, PeakAttention())
    monkeypatch.setattr(window_module, "_RAW_KERNEL", window_module._RAW_KERNEL)  # restored afterwards
    register_raw_kernel(kernel)
    q, k, v = random_qkv(n=300, w=8, h_kv=2, g=2, d=32, seed=5)
    got = score_tokens("toy-peak", q.cuda(), k.cuda(), v.cuda())
    torch.testing.assert_close(got.cpu(), score_tokens("toy-peak", q, k, v), rtol=1e-5, atol=1e-30)


def test_engine_allocation_never_waits_for_the_device():
    """The engine's Ada-KV allocation (adakv_pages) enqueues only device work: CUDA's sync debug mode raises
    on any synchronising call. Its result equals the host API's."""
    from vllm_evict.policies.budget import adakv_pages

    gen = torch.Generator().manual_seed(7)
    scores = torch.rand(4, 8, 2000, generator=gen)
    scores[..., -32:] = float("inf")
    cuda_scores = scores.cuda()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        got = adakv_pages(cuda_scores, 20, page_size=16, alpha=0.2, max_protected=32)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    want = allocate_pages(scores, 320, allocation="adakv", page_size=16, pages=20)
    assert torch.equal(got.cpu(), want)
    # over ragged held sets (DESIGN.md §4.8 a) too, the padding at -inf as score_tokens leaves it
    lengths = torch.randint(32, 2001, (4, 8), generator=gen)
    lengths[0, 0] = 2000
    ragged = torch.where(torch.arange(2000) < lengths.unsqueeze(-1), scores, float("-inf"))
    for layer, heads in enumerate(lengths.tolist()):
        for i, m in enumerate(heads):
            ragged[layer, i, m - 32:m] = float("inf")
    cuda_ragged, cuda_lengths = ragged.cuda(), lengths.cuda()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        got = adakv_pages(cuda_ragged, 20, page_size=16, alpha=0.2, max_protected=32, lengths=cuda_lengths)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    want = allocate_pages(ragged, 320, allocation="adakv", page_size=16, pages=20, lengths=lengths)
    assert torch.equal(got.cpu(), want)
