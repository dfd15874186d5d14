"""Shared inputs for the policy tests: DESIGN.md §7.4 worked example A and random GQA tensors."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture
def example_a():
    """One KV head, g = 2, d = 2, n = 10; window rows are positions 8 and 9."""
    k = torch.tensor(
        [(-1, 1), (0, 1), (2, 0), (1, 2), (-1, -1), (0, 1), (0, 0), (-2, -2), (0, -1), (-2, 0)], dtype=torch.float32
    )[:, None, :]
    v = torch.tensor(
        [(-2, 2), (1, 1), (1, 0), (-1, -2), (-1, -1), (1, -2), (2, 0), (-1, 0), (1, 1), (1, 0)], dtype=torch.float32
    )[:, None, :]
    # q_window [w=2, H_q=2, d=2]: row t=0 is position 8, row t=1 position 9; head 0 then head 1.
    q = torch.tensor([[(-2, 0), (-1, -2)], [(1, -1), (-2, 2)]], dtype=torch.float32)
    return q, k, v


def random_qkv(n=40, w=6, h_kv=2, g=3, d=8, seed=0, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(w, h_kv * g, d, generator=gen)
    k = torch.randn(n, h_kv, d, generator=gen)
    v = torch.randn(n, h_kv, d, generator=gen)
    return q.to(dtype), k.to(dtype), v.to(dtype)
