"""kernels/key_scores.py (KeyDiff, K-norm) against the policies' torch scores on fresh random inputs.

CPU (CI): the kernels in the Triton interpreter (subprocess), fp32 and fp16, small shapes with a partial
last block. GPU (``-m gpu``): the compiled kernels, bf16, engine-like shapes (a layer group folded into
the head axis, strided views) up to 32K tokens. Both also over ragged held sets (DESIGN.md §4.8 a: head i holds
its first n_i keys): each head against the reference over its held keys, -inf in the padding. Scores agree
to fp32 rounding (the sums run in another order): |S_tri - S_ref| <= 1e-5 * max(1, |S_ref|) elementwise;
kept sets then match up to near-ties."""

from __future__ import annotations

import pytest
import torch

from tests.kernels.interpreter import check_in_interpreter


def check(device: str, seed: int, shapes=((70, 3, 32), (1025, 2, 64), (5, 1, 16)), dtype=torch.float32) -> None:
    from vllm_evict.kernels.key_scores import POLICIES, key_scores, key_scores_reference

    gen = torch.Generator().manual_seed(seed)
    for n, H, D in shapes:
        # strided like the engine's [E, G, H, D] buffer viewed as [E, G*H, D], with a shared offset per head
        packed = torch.randn(n, H, 2 * D, generator=gen) + 0.5 * torch.randn(1, H, 2 * D, generator=gen)
        keys = packed.to(device=device, dtype=dtype)[..., :D]
        # ragged held sets: one head holds all n keys, one a single key (when H > 1), the others any count
        lengths = torch.randint(1, n + 1, (H,), generator=gen)
        lengths[0], lengths[-1] = n, 1 if H > 1 else n
        for policy in POLICIES:
            got = key_scores(policy, keys)
            want = key_scores_reference(policy, keys)
            assert got.shape == (H, n) and got.dtype == torch.float32
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
            ragged = key_scores(policy, keys, lengths.to(device))
            for i, m in enumerate(lengths.tolist()):
                torch.testing.assert_close(ragged[i, :m], key_scores_reference(policy, keys[:m, i:i + 1])[0],
                                           rtol=1e-5, atol=1e-5)
                assert torch.isneginf(ragged[i, m:]).all()


def test_kernels_in_triton_interpreter():
    check_in_interpreter("tests.kernels.test_key_scores", seeds=3)


def test_unknown_policy_and_bad_layout_are_refused():
    from vllm_evict.kernels.key_scores import key_scores

    with pytest.raises(ValueError, match="no key-score kernel"):
        key_scores("snapkv", torch.zeros(4, 1, 8))
    with pytest.raises(ValueError, match="unit stride"):
        key_scores("knorm", torch.zeros(8, 1, 4).transpose(0, 2))


gpu = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize("n", [1000, 8191, 32768])
@pytest.mark.parametrize("seed", [0, 1])
def test_kernel_vs_reference_gpu(n, seed):
    pytest.importorskip("triton")
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    check("cuda", seed, shapes=((n, 16, 128), (n, 8, 64)), dtype=torch.bfloat16)


def test_engine_scores_use_the_kernel_gpu():
    """score_tokens on CUDA keys runs the registered kernel for keydiff / knorm (and equals the reference), also
    over ragged held sets."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from vllm_evict.kernels import key_scores as module
    from vllm_evict.policies import register_key_kernel, score_tokens

    calls = []

    def counted(policy, keys, lengths=None):
        calls.append(policy)
        return module.key_scores(policy, keys, lengths)

    keys = torch.randn(3000, 8, 128, device="cuda", dtype=torch.bfloat16)
    lengths = torch.tensor([3000, 1, 700, 2999, 64, 1500, 3000, 17], device="cuda")
    register_key_kernel(counted)
    try:
        for policy in module.POLICIES:
            for held in (None, lengths):
                got = score_tokens(policy, None, keys, keys, lengths=held)
                register_key_kernel(None)
                want = score_tokens(policy, None, keys, keys, lengths=held)
                register_key_kernel(counted)
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    finally:
        register_key_kernel(module.key_scores)
    assert calls == [policy for policy in module.POLICIES for _ in range(2)]


def test_new_prompt_lengths_compile_nothing_gpu():
    """After one prompt length, other lengths and head counts (layer groups) reuse the compiled kernels."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from vllm_evict.kernels import key_scores as module

    kernels = (module._column_sum_kernel, module._key_score_kernel)

    def compiled() -> int:
        return sum(len(cache[0]) for k in kernels for cache in k.device_caches.values())

    def run(n, heads=8):
        for policy in module.POLICIES:
            module.key_scores(policy, torch.randn(n, heads, 128, device="cuda", dtype=torch.bfloat16))

    run(1000)
    before = compiled()
    assert before > 0
    for n in (1001, 4093, 8192, 33000):
        run(n)
    for heads in (16, 48, 128, 256):
        run(8192, heads)
    torch.cuda.synchronize()
    assert compiled() == before
