"""Every invalid input raises ValueError whose message names the bad value."""

from __future__ import annotations

import pytest
import torch

from vllm_evict.policies import allocate_pages, num_pages, raw_window_scores, score_tokens, select_tokens

from .conftest import random_qkv


@pytest.fixture
def qkv():
    return random_qkv(n=20, w=4, h_kv=2, g=2, d=8, seed=30)


@pytest.mark.parametrize(
    "mutate, needle",
    [
        (lambda q, k, v: ("bogus", q, k, v, {}), "bogus"),
        (lambda q, k, v: ("snapkv", q, k, v[:19], {}), "(19, 2, 8)"),  # n mismatch
        (lambda q, k, v: ("snapkv", q, k, v[:, :1], {}), "(20, 1, 8)"),  # H_kv mismatch
        (lambda q, k, v: ("snapkv", q, k, v, {"window": 21}), "21"),  # window > n
        (lambda q, k, v: ("keydiff", q, k, v, {"window": 25}), "25"),
        (lambda q, k, v: ("snapkv", q, k, v, {"window": 6}), "6"),  # more than the q rows
        (lambda q, k, v: ("snapkv", q, k, v, {"window": 0}), "0"),
        (lambda q, k, v: ("snapkv", q, k, v, {"window": -1}), "-1"),
        (lambda q, k, v: ("snapkv", q[:, :, :4], k, v, {}), "D=4"),  # D mismatch
        (lambda q, k, v: ("snapkv", q[:, :3], k, v, {}), "H_q=3"),  # not a multiple of H_kv
        (lambda q, k, v: ("snapkv", q[:0], k, v, {}), "w=0"),
        (lambda q, k, v: ("snapkv", None, k, v, {}), "NoneType"),
        (lambda q, k, v: ("snapkv", q[0], k, v, {}), "(4, 8)"),
        (lambda q, k, v: ("snapkv", torch.cat([q] * 6), k, v, {}), "w=24"),  # w > n
        (lambda q, k, v: ("snapkv", q, k, v, {"pool_kernel": 4}), "4"),
        (lambda q, k, v: ("snapkv", q, k, v, {"pool_kernel": 0}), "0"),
        (lambda q, k, v: ("snapkv", q, k, v, {"sink": -2}), "-2"),
        (lambda q, k, v: ("snapkv", q, k, v, {"gqa": "sum"}), "sum"),
        (lambda q, k, v: ("snapkv", q, k, v, {"scale": -1.0}), "-1.0"),
        (lambda q, k, v: ("snapkv", q, k, v, {"budget": 3}), "budget"),  # unknown option
        (lambda q, k, v: ("caote", q, k, v, {"caote_base": "keydiff"}), "keydiff"),
        (lambda q, k, v: ("caote", q, k, v, {"caote_base": "fastcaote"}), "fastcaote"),
        (lambda q, k, v: ("snapkv", q, k[:0], v[:0], {}), "n=0"),
        (lambda q, k, v: ("knorm", None, k[:, :, None], v, {}), "keys"),
    ],
)
def test_score_tokens_errors(qkv, mutate, needle):
    policy, q, k, v, opts = mutate(*qkv)
    with pytest.raises(ValueError) as err:
        score_tokens(policy, q, k, v, **opts)
    assert needle in str(err.value)


def test_raw_window_scores_errors(qkv):
    q, k, v = qkv
    with pytest.raises(ValueError, match="keydiff"):
        raw_window_scores("keydiff", q, k, v, scale=0.3, gqa="mean")
    with pytest.raises(ValueError, match="caote"):
        raw_window_scores("caote", q, k, v, scale=0.3, gqa="mean")
    with pytest.raises(ValueError, match="median"):
        raw_window_scores("snapkv", q, k, v, scale=0.3, gqa="median")
    with pytest.raises(ValueError, match="H_q=3"):
        raw_window_scores("snapkv", q[:, :3], k, v, scale=0.3, gqa="mean")


@pytest.mark.parametrize(
    "budget, needle",
    [(0, "0"), (-3, "-3"), (0.0, "0.0"), (-0.5, "-0.5"), (1.5, "1.5"), (True, "True"), ("0.5", "'0.5'"),
     (None, "None"), (float("nan"), "nan")],
)
def test_select_tokens_bad_budget(budget, needle):
    s = torch.rand(2, 10)
    with pytest.raises(ValueError) as err:
        select_tokens(s, budget)
    assert needle in str(err.value) and "budget" in str(err.value)
    with pytest.raises(ValueError):
        allocate_pages(s, budget)


@pytest.mark.parametrize(
    "scores, kwargs, needle",
    [
        (torch.rand(10), {}, "(10,)"),
        (torch.rand(2, 0), {}, "(2, 0)"),
        (torch.tensor([[1.0, float("nan"), 2.0]]), {}, "NaN"),
        (torch.randint(0, 3, (2, 5)), {}, "int64"),
        (torch.rand(2, 10), {"allocation": "pyramid"}, "pyramid"),
        (torch.rand(2, 10), {"page_size": 0}, "page_size"),
        (torch.rand(2, 10), {"alpha": 1.5}, "1.5"),
        (torch.rand(2, 10), {"alpha": -0.1}, "-0.1"),
        ([[1.0, 2.0]], {}, "list"),
    ],
)
def test_select_tokens_bad_inputs(scores, kwargs, needle):
    with pytest.raises(ValueError) as err:
        select_tokens(scores, 4, **kwargs)
    assert needle in str(err.value)


def test_num_pages_errors():
    with pytest.raises(ValueError, match="0"):
        num_pages(0, 4, 16, 0)
    with pytest.raises(ValueError, match="page_size"):
        num_pages(10, 4, 0, 0)
    with pytest.raises(ValueError, match="-1"):
        num_pages(10, 4, 16, -1)
    with pytest.raises(ValueError, match="1.01"):
        num_pages(10, 1.01, 16, 0)
