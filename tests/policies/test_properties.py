"""Property tests on random inputs: GQA grouping, NaN-freedom, dtypes, selection vs numpy, config consistency."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from vllm_evict.policies import POLICIES, EvictionConfig, count_protected, score_tokens, select_tokens

from .conftest import random_qkv

QUERY = ["snapkv", "dropkv", "obcache-value", "obcache-key", "obcache-joint", "caote", "fastcaote", "tova", "h2o"]
ALL = list(POLICIES)


@pytest.mark.parametrize("gqa", ["mean", "max"])
@pytest.mark.parametrize("policy", QUERY)
def test_gqa_grouping(policy, gqa):
    q, k, v = random_qkv(n=40, w=5, h_kv=2, g=3, d=8, seed=20)
    base = score_tokens(policy, q, k, v, gqa=gqa)
    # permuting query heads inside a group does not change the scores (up to summation order)
    perm = torch.tensor([2, 0, 1, 4, 5, 3])
    torch.testing.assert_close(score_tokens(policy, q[:, perm], k, v, gqa=gqa), base, rtol=1e-5, atol=1e-7)
    # changing a query head of group 0 leaves KV head 1 untouched, and changes KV head 0
    q2 = q.clone()
    q2[:, 1] = torch.randn_like(q2[:, 1]) * 3
    s2 = score_tokens(policy, q2, k, v, gqa=gqa)
    assert torch.equal(s2[1], base[1])
    assert not torch.equal(s2[0], base[0])


@pytest.mark.parametrize("policy", ALL)
def test_kv_heads_are_independent(policy):
    q, k, v = random_qkv(n=30, w=4, h_kv=3, g=2, d=8, seed=21)
    base = score_tokens(policy, q, k, v)
    k2, v2 = k.clone(), v.clone()
    k2[:, 2] += 1.0
    v2[:, 2] *= -2.0
    s2 = score_tokens(policy, q, k2, v2)
    assert torch.equal(s2[:2], base[:2])


@pytest.mark.parametrize("policy", ALL)
@pytest.mark.parametrize("case", ["zero_kv", "zero_all", "large", "n_equals_w"])
def test_no_nan(policy, case):
    q, k, v = random_qkv(n=24, w=4, seed=22)
    if case == "zero_kv":
        k, v = torch.zeros_like(k), torch.zeros_like(v)
    elif case == "zero_all":
        q, k, v = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    elif case == "large":
        q, k, v = q * 30, k * 30, v * 100
    else:
        q, k, v = random_qkv(n=4, w=4, seed=23)
    s = score_tokens(policy, q, k, v)
    assert not torch.isnan(s).any()
    assert not torch.isneginf(s).any()
    mask = select_tokens(s, 0.5, page_size=2, allocation="adakv")
    assert mask.any(-1).all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("policy", ALL)
def test_low_precision_equals_fp32_upcast(policy, dtype):
    q, k, v = random_qkv(n=33, w=4, seed=24, dtype=dtype)
    low = score_tokens(policy, q, k, v, gqa="max")
    up = score_tokens(policy, q.float(), k.float(), v.float(), gqa="max")
    assert low.dtype == (torch.float64 if policy == "random" else torch.float32)  # random: 32-bit hash scores
    assert torch.equal(low, up)


@pytest.mark.parametrize("policy", ALL)
def test_selection_matches_numpy_stable_argsort(policy):
    q, k, v = random_qkv(n=64, w=8, seed=25)
    s = score_tokens(policy, q, k, v, window=8, sink=2)
    mask = select_tokens(s, 24, page_size=8)
    for i in range(s.shape[0]):
        order = np.argsort(-s[i].numpy(), kind="stable")
        assert set(mask[i].nonzero().flatten().tolist()) == set(order[:24].tolist())
        assert mask[i, :2].all() and mask[i, -8:].all()


@pytest.mark.parametrize("policy", ALL)
def test_config_matches_scores(policy):
    """EvictionConfig's r / P agree with what select_tokens sees in score_tokens' output."""
    cfg = EvictionConfig.from_dict({"policy": policy, "budget": 0.3, "window": 6, "sink": 1, "allocation": "adakv"})
    q, k, v = random_qkv(n=90, w=10, seed=26)
    s = score_tokens(policy, q, k, v, **cfg.score_options())
    assert count_protected(s) == cfg.protected_count(90) == 7
    P = cfg.num_pages(90, page_size=4)
    mask = select_tokens(s, cfg.budget, page_size=4, **cfg.select_options())
    assert int(mask.sum()) == P * 4 * 2
    if policy == "streaming":
        assert mask.sum(-1).tolist() == [P * 4] * 2  # adakv is ignored for streaming


def test_default_windows_from_config():
    q, k, v = random_qkv(n=100, w=40, seed=27)
    for policy in ALL:
        cfg = EvictionConfig(policy=policy, budget=0.5)
        w = cfg.window_size()
        s = score_tokens(policy, q[q.shape[0] - w :], k, v, **cfg.score_options())
        assert count_protected(s) == cfg.protected_count(100), policy
        # passing more rows with the config's options gives the same scores (the window option slices)
        if w:
            assert torch.equal(score_tokens(policy, q, k, v, **cfg.score_options()), s)
