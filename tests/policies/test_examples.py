"""DESIGN.md §7.1, §7.4 (worked example A) and §7.5 (worked example B)."""

from __future__ import annotations

import pytest
import torch

from vllm_evict.policies import allocate_pages, num_pages, raw_window_scores, score_tokens, select_tokens, window_stats

INF = float("inf")
TOL = dict(rtol=1e-4, atol=1e-6)
OPTS = dict(pool_kernel=3, sink=0, gqa="mean")  # w = 2 from the two window rows


def t(xs):
    return torch.tensor(xs, dtype=torch.float32)


def kept(mask_row):
    return set(mask_row.nonzero().flatten().tolist())


def close(actual, expected):
    torch.testing.assert_close(actual, t(expected), **TOL)


# ---------------------------------------------------------------- §7.1
def test_selection_example_7_1():
    s = t([[3, 5, 5, 5, 1]])
    # K = 2 with bs = 1 and an int budget of 2 tokens (no protected entries: p_min = 1).
    mask = select_tokens(s, 2, page_size=1)
    assert kept(mask[0]) == {1, 2}


def test_selection_ties_keep_lower_index_every_k():
    s = t([[3, 5, 5, 5, 1]])
    expected = {1: {1}, 2: {1, 2}, 3: {1, 2, 3}, 4: {0, 1, 2, 3}}
    for k, want in expected.items():
        assert kept(select_tokens(s, k, page_size=1)[0]) == want


# ---------------------------------------------------------------- §7.4 example A
def test_example_a_intermediates(example_a):
    q, k, v = example_a
    st = window_stats(q, k, v, 0, 2**-0.5)
    a = st.a.reshape(4, 2)  # (head0 pos8, head0 pos9, head1 pos8, head1 pos9)
    close(a, [(-0.830038, 0.123169), (0.575442, 0.003164), (-0.855369, -0.042043), (-0.252697, 0.419183)])
    close(st.p[0, 0], [0.139681, 0.033959, 0.002007, 0.008256, 0.139681, 0.033959, 0.033959, 0.574541, 0.033959, 0])
    close(st.p[0, 1], [0.021889, 0.044393, 0.370336, 0.044393, 0.090035, 0.044393, 0.090035, 0.090035, 0.182601, 0.021889])
    assert st.p[0, 0, 9] == 0.0  # causal mask: position 8 does not see position 9


def test_example_a_pages(example_a):
    _, k, _ = example_a
    assert num_pages(10, 4, 2, 2) == 2  # P = 2, K = 4


def _check(policy, example_a, raw=None, pooled=None, keep=None, **extra):
    q, k, v = example_a
    opts = {**OPTS, **extra}
    if raw is not None:
        close(raw_window_scores(policy, q, k, v, scale=2**-0.5, gqa=opts["gqa"])[0], raw)
    s = score_tokens(policy, q, k, v, **opts)
    assert s.shape == (1, 10) and s.dtype == torch.float32
    assert torch.isposinf(s[0, 8:]).all()  # window protected
    if pooled is not None:
        close(s[0, :8], pooled[:8])
    if keep is not None:
        assert kept(select_tokens(s, 4, page_size=2)[0]) == keep
    return s


def test_example_a_snapkv(example_a):
    _check(
        "snapkv", example_a,
        raw=[0.127338, 0.041092, 0.094105, 0.034031, 0.087221, 0.041092, 0.039017, 0.377581, 0.067567, 0.090956],
        pooled=[0.127338, 0.127338, 0.094105, 0.094105, 0.087221, 0.087221, 0.377581, 0.377581, 0.377581, 0.090956],
        keep={6, 7, 8, 9},
    )


def test_example_a_snapkv_pooled_window_values(example_a):
    """Pooling runs over all n positions; the window positions carry their masked raw scores (seen before protection)."""
    from vllm_evict.policies import max_pool

    q, k, v = example_a
    pooled = max_pool(raw_window_scores("snapkv", q, k, v, gqa="mean"), 3)[0]
    close(pooled, [0.127338, 0.127338, 0.094105, 0.094105, 0.087221, 0.087221, 0.377581, 0.377581, 0.377581, 0.090956])


def test_example_a_dropkv(example_a):
    _check(
        "dropkv", example_a,
        raw=[0.816724, 0.011667, 0.031200, 0.033516, 0.040291, 0.039914, 0.016596, 0.306446, 0.037817, 0.235607],
        pooled=[0.816724, 0.816724, 0.033516, 0.040291, 0.040291, 0.040291, 0.306446, 0.306446],
        keep={0, 1, 8, 9},
    )


def test_example_a_dropkv_gqa_max(example_a):
    s = _check("dropkv", example_a, keep={0, 1, 8, 9}, gqa="max")
    torch.testing.assert_close(s[0, 0], torch.tensor(1.499192), **TOL)


def test_example_a_obcache_value(example_a):
    _check(
        "obcache-value", example_a,
        pooled=[0.547775, 0.547775, 0.068581, 0.068581, 0.037818, 0.037818, 0.510062, 0.510062],
        keep={0, 1, 8, 9},
    )


def test_example_a_obcache_key(example_a):
    _check(
        "obcache-key", example_a,
        raw=[2.697144, 0.013792, 0.024815, 0.047815, 0.045858, 0.053415, 0, 0.197318, 0.020613, 0.816169],
        keep={0, 1, 8, 9},
    )


def test_example_a_obcache_joint(example_a):
    _check(
        "obcache-joint", example_a,
        raw=[5.607915, 0.039739, 0.175695, 0.116573, 0.142262, 0.131808, 0.019617, 1.284252, 0.100720, 1.288846],
        keep={0, 1, 8, 9},
    )


def test_example_a_caote(example_a):
    from vllm_evict.policies import max_pool

    q, k, v = example_a
    h = max_pool(raw_window_scores("snapkv", q, k, v, gqa="mean"), 3)[0]
    torch.testing.assert_close(h.sum(), torch.tensor(1.841027), **TOL)
    hn = h / h.sum()
    close(hn @ v[:, 0, :], [0.390423, 0.168233])  # X
    _check(
        "caote", example_a,
        pooled=[0.223778, 0.076627, 0.034065, 0.138754, 0.090317, 0.112012, 0.417545, 0.361355],
        keep={6, 7, 8, 9},
    )


def test_example_a_fastcaote(example_a):
    _, _, v = example_a
    close(v[:, 0, :].mean(0), [0.2, -0.1])  # X
    _check(
        "fastcaote", example_a,
        pooled=[0.225994, 0.101068, 0.043431, 0.121056, 0.074599, 0.102526, 0.465129, 0.310682],
        keep={6, 7, 8, 9},
    )


def test_example_a_caote_unprotected_values(example_a):
    """c at the window positions (before protection) from the spec's full c vector."""
    from vllm_evict.policies import get_policy

    q, k, v = example_a
    c = get_policy("caote").base_scores(q, k, v, pool_kernel=3, gqa="mean", scale=2**-0.5, caote_base="snapkv")[0]
    close(c, [0.223778, 0.076627, 0.034065, 0.138754, 0.090317, 0.112012, 0.417545, 0.361355, 0.266063, 0.032866])
    c = get_policy("fastcaote").base_scores(q, k, v, pool_kernel=3, gqa="mean", scale=2**-0.5, caote_base="snapkv")[0]
    close(c, [0.225994, 0.101068, 0.043431, 0.121056, 0.074599, 0.102526, 0.465129, 0.310682, 0.350928, 0.041902])


@pytest.mark.parametrize("q_rows", [0, 2])
def test_example_a_keydiff(example_a, q_rows):
    q, k, v = example_a
    s = score_tokens("keydiff", q[:q_rows], k, v)
    assert torch.isfinite(s).all()  # no protection by default
    close(s[0], [-0.894427, -0.316228, 0.948683, 0.141421, -0.447214, -0.316228, 0, -0.447214, 0.316228, -0.948683])
    assert kept(select_tokens(s, 4, page_size=2)[0]) == {2, 3, 6, 8}
    close(k[:, 0, :].mean(0), [-0.3, 0.1])  # mu


def test_example_a_bf16_same_as_fp32(example_a):
    q, k, v = example_a  # the example's values are exact in bf16
    for pol in ("snapkv", "dropkv", "obcache-joint", "caote", "keydiff"):
        a = score_tokens(pol, q, k, v, **OPTS)
        b = score_tokens(pol, q.bfloat16(), k.bfloat16(), v.bfloat16(), **OPTS)
        assert torch.equal(a, b), pol


# ---------------------------------------------------------------- §7.5 example B
@pytest.fixture
def example_b():
    cand = t(
        [
            [0.9, 0.8, 0.7, 0.5, 0.05, 0.01],
            [0.6, 0.5, 0.02, 0.02, 0.01, 0],
            [0.5, 0.03, 0.02, 0.01, 0.01, 0],
        ]
    )
    return torch.cat([cand, torch.full((3, 2), INF)], dim=1)  # positions 6, 7 protected


def test_example_b_adakv_pages(example_b):
    p = allocate_pages(example_b, 4, allocation="adakv", page_size=2, alpha=0.2)
    assert p.dtype == torch.long
    assert p.tolist() == [3, 2, 1]
    assert int(p.sum()) == 6  # T = P * H_kv


def test_example_b_adakv_kept(example_b):
    mask = select_tokens(example_b, 4, allocation="adakv", page_size=2, alpha=0.2)
    assert [kept(r) for r in mask] == [{0, 1, 2, 3, 6, 7}, {0, 1, 6, 7}, {6, 7}]


def test_example_b_uniform(example_b):
    assert allocate_pages(example_b, 4, page_size=2).tolist() == [2, 2, 2]
    mask = select_tokens(example_b, 4, page_size=2)
    assert [kept(r) for r in mask] == [{0, 1, 6, 7}] * 3


def test_example_b_tie_goes_to_lower_head(example_b):
    """Swapping heads 1 and 2 moves the tie winner: the 0.5 of (new) head 1 now wins over head 2's."""
    s = example_b[[0, 2, 1]]
    # global top-12: protected 6 + 0.9 .8 .7 .6(h2) .5(h0 j3) .5(h1 j0) -> f = (6, 3, 3)
    # B_i = 0.8 f + 0.8 = (5.6, 3.2, 3.2) -> x = (2.8, 1.6, 1.6) -> floor (2, 1, 1) sum 4, +1 h0 (0.8), +1 h1 (0.6 tie -> lower)
    assert allocate_pages(s, 4, allocation="adakv", page_size=2).tolist() == [3, 2, 1]
