"""kernels/paged_kv.py: multi-layer prompt gather and kept-token scatter against their torch references.

Fresh random inputs: separate cache tensors per layer (as vLLM allocates them, so the launch reaches them
through offsets from the first, in either direction), three requests' shuffled prompt block lists with a
partial last page gathered in one launch, strided [n, R*G, H, D] buffers (token-major and head-major), and uneven per-head kept sets (-1 = evicted). CPU (CI): the kernels in
the Triton interpreter (subprocess). GPU (``-m gpu``): the compiled kernels, bf16."""

from __future__ import annotations

import pytest
import torch

from tests.kernels.interpreter import check_in_interpreter



def check(device: str, seed: int, dtype=torch.float32) -> None:
    from vllm_evict.kernels.paged_kv import (gather_prompt, gather_prompt_reference, gather_slots,
                                             gather_slots_reference, scatter_kept, scatter_kept_reference)

    gen = torch.Generator().manual_seed(seed)
    for num_layers, H, page, D, n in [(3, 2, 16, 32, 70), (1, 4, 16, 64, 16), (5, 1, 8, 16, 33)]:
        num_blocks = 2 * (-(-n // page)) + 4
        caches = [torch.randn(num_blocks, H, page, 2 * D, generator=gen).to(device=device, dtype=dtype)
                  for _ in range(num_layers)]
        if seed % 2:
            caches.reverse()  # negative offsets from the first cache
        # three requests' prompts (rows of block ids, one padded past what its n tokens read)
        blocks = torch.stack([torch.randperm(num_blocks, generator=gen)[: -(-n // page) + 1] for _ in range(3)])
        blocks = blocks.to(device=device, dtype=torch.int32)

        # gather into strided buffers ([n, R*G, H, 2D] split into K and V halves)
        packed = torch.full((n, 3 * num_layers, H, 2 * D), float("nan"), device=device, dtype=dtype)
        keys, values = packed[..., :D], packed[..., D:]
        gather_prompt(caches, blocks, n, keys, values)
        ref_k = torch.empty(n, 3 * num_layers, H, D, device=device, dtype=dtype)
        ref_v = torch.empty_like(ref_k)
        gather_prompt_reference(caches, blocks, n, ref_k, ref_v)
        assert torch.equal(keys, ref_k) and torch.equal(values, ref_v)
        # head-major buffers (each head's n tokens contiguous, as the engine stages them)
        head_major = torch.full((3 * num_layers, H, n, 2 * D), float("nan"), device=device, dtype=dtype)
        head_major = head_major.permute(2, 0, 1, 3)
        gather_prompt(caches, blocks, n, head_major[..., :D], head_major[..., D:])
        assert torch.equal(head_major[..., :D], ref_k) and torch.equal(head_major[..., D:], ref_v)
        one = torch.empty(n, num_layers, H, D, device=device, dtype=dtype)
        gather_prompt_reference(caches, blocks[2:], n, one, torch.empty_like(one))  # request 2 alone
        assert torch.equal(keys[:, 2 * num_layers:], one)

        # scatter: each (layer, head) keeps a random subset to distinct fresh slots
        fresh = torch.stack([torch.randperm(num_blocks * H * page, generator=gen)[: n * H].view(n, H)
                             for _ in range(num_layers)])
        keep = torch.rand(num_layers, n, H, generator=gen) < 0.3
        slots = torch.where(keep, fresh, -1).to(device)
        new_k = torch.randn(num_layers, H, n, D, generator=gen).to(device=device, dtype=dtype).permute(2, 0, 1, 3)
        new_v = torch.randn(n, num_layers, H, D, generator=gen).to(device=device, dtype=dtype)
        expected = [c.clone() for c in caches]
        scatter_kept_reference(expected, new_k, new_v, slots)
        scatter_kept(caches, new_k, new_v, slots)
        for got, want in zip(caches, expected):
            assert torch.equal(got, want)

        # gather by the same slots (the kept sets of a per-head layout), repeated caches (requests x layers)
        both = caches + caches[:1]
        slots = torch.cat([slots, slots[:1].flip(1)]).contiguous()
        packed = torch.full((n, len(both), H, 2 * D), float("nan"), device=device, dtype=dtype)
        keys, values = packed[..., :D], packed[..., D:]
        gather_slots(both, slots, keys, values)
        ref_k = torch.empty(n, len(both), H, D, device=device, dtype=dtype)
        ref_v = torch.empty_like(ref_k)
        gather_slots_reference(both, slots, ref_k, ref_v)
        assert torch.equal(keys, ref_k) and torch.equal(values, ref_v)
        assert torch.equal(keys[:, :num_layers][slots[:num_layers].transpose(0, 1) >= 0], new_k[slots[:num_layers].transpose(0, 1) >= 0])


def test_reference_by_hand():
    """The references on a hand-made cache: token t of head h in block b at ((b*H + h)*page + t%page)*2D."""
    from vllm_evict.kernels.paged_kv import gather_prompt_reference, gather_slots_reference, scatter_kept_reference

    H, page, D = 2, 2, 1
    cache = torch.arange(4 * H * page * 2 * D, dtype=torch.float32).view(4, H, page, 2 * D)
    keys, values = torch.empty(3, 1, H, D), torch.empty(3, 1, H, D)
    gather_prompt_reference([cache], torch.tensor([[2, 0]]), 3, keys, values)
    # token 0 -> block 2 offset 0; token 2 -> block 0 offset 0; head 1 is 2*page*2D = 4 further on
    assert keys[:, 0, 0, 0].tolist() == [16.0, 18.0, 0.0] and values[:, 0, 1, 0].tolist() == [21.0, 23.0, 5.0]
    slots = torch.tensor([[[-1, 3], [0, -1], [-1, -1]]])                       # [G=1, n=3, H=2]
    scatter_kept_reference([cache], torch.full((3, 1, H, D), -1.0), torch.full((3, 1, H, D), -2.0), slots)
    assert cache.view(-1, 2)[3].tolist() == [-1.0, -2.0] and cache.view(-1, 2)[0].tolist() == [-1.0, -2.0]
    assert cache.view(-1, 2)[1].tolist() == [2.0, 3.0]
    gather_slots_reference([cache], slots, keys, values)
    assert keys[:, 0, 1, 0].tolist() == [-1.0, 0.0, 0.0] and values[:, 0, 0, 0].tolist() == [0.0, -2.0, 0.0]


def test_kernels_in_triton_interpreter():
    pytest.importorskip("triton")
    check_in_interpreter("tests.kernels.test_paged_kv")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_kernels_on_gpu():
    for seed in range(6):
        check("cuda", seed, torch.bfloat16)
