"""Hand-checkable cases per policy, and the torch reference against a literal float64 transcription of DESIGN.md §4."""

from __future__ import annotations

import math

import pytest
import torch

from vllm_evict.policies import POLICIES, KeyPolicy, get_policy, raw_window_scores, score_tokens, select_tokens

from .conftest import random_qkv

WINDOW_POLICIES = [name for name, policy in POLICIES.items() if policy.window_raw]


def kept(row):
    return row.nonzero().flatten().tolist()


# ---------------------------------------------------------------- literal reference (float64, loops)
def literal_raw(policy, q, k, v, scale, gqa="mean"):
    """raw [H_kv, n] straight from the DESIGN.md §4 table, per (query head, window row), in float64."""
    q, k, v = q.double(), k.double(), v.double()
    w, h_q, _ = q.shape
    n, h_kv, _ = k.shape
    g = h_q // h_kv
    out = torch.zeros(h_kv, n, dtype=torch.float64)
    for i in range(h_kv):
        per_head = []
        for hh in range(i * g, (i + 1) * g):
            acc = torch.zeros(n, dtype=torch.float64)
            rows = []
            for t in range(w):
                vis = n - w + t + 1
                z = torch.zeros(n, dtype=torch.float64)
                z[:vis] = scale * (k[:vis, i] @ q[t, hh])
                p = torch.zeros(n, dtype=torch.float64)
                p[:vis] = torch.softmax(z[:vis], dim=0)
                a = p @ v[:, i]
                diff2 = ((a[None, :] - v[:, i]) ** 2).sum(-1)
                vv = (v[:, i] ** 2).sum(-1)
                if policy in ("snapkv", "h2o"):
                    acc += p
                elif policy == "dropkv":
                    acc += (p / (1 - p + 1e-6)) ** 2 * diff2
                elif policy == "obcache-value":
                    acc += p**2 * vv
                elif policy == "obcache-key":
                    acc += p**2 * z**2 * diff2
                elif policy == "obcache-joint":
                    acc += p**2 * (((1 + z)[:, None] * v[:, i] - z[:, None] * a[None, :]) ** 2).sum(-1)
                rows.append(p)
            if policy == "snapkv":
                acc = acc / w
            if policy == "tova":
                acc = rows[-1]
            per_head.append(acc)
        stack = torch.stack(per_head)
        out[i] = stack.mean(0) if gqa == "mean" else stack.amax(0)
    return out


@pytest.mark.parametrize("gqa", ["mean", "max"])
@pytest.mark.parametrize("policy", WINDOW_POLICIES)
def test_raw_matches_literal_spec(policy, gqa):
    q, k, v = random_qkv(n=30, w=5, h_kv=2, g=3, d=8, seed=1)
    scale = 1 / math.sqrt(8)
    got = raw_window_scores(policy, q, k, v, scale=scale, gqa=gqa)
    want = literal_raw(policy, q, k, v, scale, gqa).float()
    assert got.shape == (2, 30) and got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=2e-4, atol=1e-6)


def test_custom_scale_is_used():
    q, k, v = random_qkv(n=20, w=4, seed=2)
    a = raw_window_scores("snapkv", q, k, v, scale=0.1)
    b = raw_window_scores("snapkv", q, k, v)  # 1/sqrt(8)
    torch.testing.assert_close(a, literal_raw("snapkv", q, k, v, 0.1).float(), rtol=1e-4, atol=1e-7)
    assert not torch.allclose(a, b)
    s = score_tokens("h2o", q, k, v, scale=0.1)
    torch.testing.assert_close(s[:, :16], literal_raw("h2o", q, k, v, 0.1).float()[:, :16], rtol=1e-4, atol=1e-7)


# ---------------------------------------------------------------- per-policy hand checks
def test_registry_names_and_defaults():
    assert set(POLICIES) == {
        "snapkv", "dropkv", "keydiff", "obcache-value", "obcache-key", "obcache-joint",
        "caote", "fastcaote", "streaming", "tova", "h2o", "knorm", "random", "expected-attention",
    }
    table = {  # DESIGN.md §4: (w, kappa, sink)
        "snapkv": (32, 7, 0), "dropkv": (8, 11, 0), "keydiff": (0, 1, 0), "obcache-value": (32, 7, 0),
        "obcache-key": (32, 7, 0), "obcache-joint": (32, 7, 0), "streaming": (0, 1, 4), "tova": (1, 1, 0),
        "h2o": (32, 1, 0), "knorm": (0, 1, 0), "random": (0, 1, 0), "expected-attention": (32, 1, 4),
    }
    for name, (w, kappa, sink) in table.items():
        p = get_policy(name)
        assert (p.default_window, p.default_pool_kernel, p.default_sink) == (w, kappa, sink), name


def test_streaming_keeps_sink_and_recent():
    n = 20
    k = torch.randn(n, 2, 4)
    s = score_tokens("streaming", torch.empty(0, 2, 4), k, k)
    assert torch.isposinf(s[:, :4]).all()
    assert torch.equal(s[:, 4:], torch.arange(4, n, dtype=torch.float32).expand(2, -1))
    mask = select_tokens(s, 8, page_size=4)
    for row in mask:
        assert kept(row) == [0, 1, 2, 3, 16, 17, 18, 19]
    # q_window is ignored entirely (None allowed), a requested window is protected, sink override works
    s2 = score_tokens("streaming", None, k, k, sink=2, window=3)
    assert torch.isposinf(s2[:, :2]).all() and torch.isposinf(s2[:, -3:]).all()
    assert torch.isfinite(s2[:, 2:-3]).all()


def test_knorm_keeps_low_norm_keys():
    norms = torch.tensor([5.0, 1.0, 3.0, 0.5, 4.0, 2.0, 6.0, 0.1])
    k = torch.zeros(8, 1, 3)
    k[:, 0, 1] = norms
    s = score_tokens("knorm", None, k, k)
    torch.testing.assert_close(s[0], -norms)
    assert kept(select_tokens(s, 4, page_size=1)[0]) == [1, 3, 5, 7]


def test_keydiff_keeps_keys_far_from_mean():
    # 6 keys along +x, 2 along -x, then +y and -y: the mean points to +x. S = 1 for -x, 0 for +-y (a tie:
    # the lower position wins), -1 for +x.
    k = torch.tensor([[1.0, 0]] * 6 + [[-1.0, 0], [-2.0, 0], [0, 3.0], [0, -3.0]])[:, None, :]
    s = score_tokens("keydiff", None, k, k)
    torch.testing.assert_close(s[0], torch.tensor([-1.0] * 6 + [1.0, 1.0, 0.0, 0.0]))
    assert kept(select_tokens(s, 3, page_size=1)[0]) == [6, 7, 8]
    # window option protects the most recent positions
    s = score_tokens("keydiff", None, k, k, window=2)
    assert torch.isposinf(s[0, 8:]).all() and torch.isfinite(s[0, :8]).all()


def test_keydiff_all_zero_keys_is_finite():
    k = torch.zeros(10, 2, 4)
    s = score_tokens("keydiff", None, k, k)
    assert torch.equal(s.abs(), torch.zeros(2, 10))


def test_tova_is_last_row_attention():
    q, k, v = random_qkv(n=12, w=1, h_kv=1, g=2, d=4, seed=3)
    s = score_tokens("tova", q, k, v)
    logits = torch.einsum("hd,nd->hn", q[0], k[:, 0]) / 2.0
    want = torch.softmax(logits, -1).mean(0)
    torch.testing.assert_close(s[0, :11], want[:11])
    assert torch.isposinf(s[0, 11]) and torch.isfinite(s[0, :11]).all()
    # with more rows, still the last row's attention, all rows' positions protected
    q4, _, _ = random_qkv(n=12, w=4, h_kv=1, g=2, d=4, seed=4)
    q4[-1] = q[0]
    s4 = score_tokens("tova", q4, k, v)
    torch.testing.assert_close(s4[0, :8], want[:8])
    assert torch.isposinf(s4[0, 8:]).all()


def test_h2o_is_w_times_snapkv_without_pooling():
    q, k, v = random_qkv(n=25, w=5, seed=5)
    h2o = score_tokens("h2o", q, k, v)
    snap = score_tokens("snapkv", q, k, v, pool_kernel=1)
    torch.testing.assert_close(h2o[:, :20], 5 * snap[:, :20])
    # attention rows sum to one: the raw h2o score sums to w per query head (mean over g keeps it)
    torch.testing.assert_close(raw_window_scores("h2o", q, k, v).sum(-1), torch.full((2,), 5.0))


def test_snapkv_pooling_kernel_override():
    q, k, v = random_qkv(n=25, w=5, seed=6)
    raw = raw_window_scores("snapkv", q, k, v)
    s = score_tokens("snapkv", q, k, v, pool_kernel=5)
    padded = torch.nn.functional.pad(raw, (2, 2), value=float("-inf"))
    want = padded.unfold(-1, 5, 1).amax(-1)
    torch.testing.assert_close(s[:, :20], want[:, :20])


def test_window_option_uses_last_rows():
    q, k, v = random_qkv(n=30, w=8, seed=7)
    a = score_tokens("dropkv", q, k, v, window=3)
    b = score_tokens("dropkv", q[-3:], k, v)
    assert torch.equal(a, b)
    assert torch.isposinf(a[:, 27:]).all() and torch.isfinite(a[:, :27]).all()


def test_sink_option_protects_prefix():
    q, k, v = random_qkv(n=30, w=4, seed=8)
    s = score_tokens("snapkv", q, k, v, sink=3)
    assert torch.isposinf(s[:, :3]).all() and torch.isposinf(s[:, 26:]).all()
    assert torch.isfinite(s[:, 3:26]).all()
    s = score_tokens("snapkv", q, k, v, sink=100)  # larger than n: everything protected
    assert torch.isposinf(s).all()


def test_dropkv_equal_values_cost_zero():
    q, k, _ = random_qkv(n=16, w=3, seed=9)
    v = torch.ones(16, 2, 8)
    raw = raw_window_scores("dropkv", q, k, v)
    assert torch.all(raw >= 0) and torch.all(raw < 1e-6)


def test_dropkv_exact_single_eviction_change():
    """Evicting token j changes window output t by p_j/(1-p_j) (a - v_j) (exact renormalisation)."""
    q, k, v = random_qkv(n=10, w=1, h_kv=1, g=1, d=4, seed=10)
    q, k, v = q.double(), k.double(), v.double()
    z = (k[:, 0] @ q[0, 0]) / 2.0
    p = torch.softmax(z, 0)
    a = p @ v[:, 0]
    cost = []
    for j in range(10):
        keep = torch.arange(10) != j
        a_j = torch.softmax(z[keep], 0) @ v[keep, 0]
        cost.append(((a_j - a) ** 2).sum())
    cost = torch.stack(cost)
    raw = raw_window_scores("dropkv", q.float(), k.float(), v.float())[0].double()
    # (p/(1-p+eps))^2 vs (p/(1-p))^2: relative difference ~ 1e-6/(1-p)
    torch.testing.assert_close(raw, cost, rtol=1e-4, atol=1e-7)


def test_obcache_zero_value_or_key():
    q, k, v = random_qkv(n=12, w=2, h_kv=1, g=2, d=4, seed=11)
    v[3] = 0
    k[5] = 0
    assert raw_window_scores("obcache-value", q, k, v)[0, 3] == 0
    assert raw_window_scores("obcache-key", q, k, v)[0, 5] == 0  # Z = 0
    # joint with Z = 0 reduces to value: p^2 ||v||^2
    torch.testing.assert_close(
        raw_window_scores("obcache-joint", q, k, v)[0, 5], raw_window_scores("obcache-value", q, k, v)[0, 5]
    )


def test_obcache_joint_is_value_plus_key_plus_cross():
    q, k, v = random_qkv(n=14, w=3, h_kv=1, g=1, d=4, seed=12)
    from vllm_evict.policies import window_stats

    st = window_stats(q, k, v, 0, 0.5)
    cross = (2 * st.p**2 * st.z * (st.vv - st.av)).sum(1)[0]
    joint = raw_window_scores("obcache-joint", q, k, v)[0]
    val = raw_window_scores("obcache-value", q, k, v)[0]
    key = raw_window_scores("obcache-key", q, k, v)[0]
    torch.testing.assert_close(joint, val + key + cross, rtol=1e-4, atol=1e-6)


def test_caote_zero_base_uses_uniform_weights():
    """obcache-key with all-zero keys scores 0 everywhere: h_n = 1/n, so caote's X is the mean value = fastcaote."""
    q, _, v = random_qkv(n=12, w=2, seed=13)
    k = torch.zeros(12, 2, 8)
    a = score_tokens("caote", q, k, v, caote_base="obcache-key")
    b = score_tokens("fastcaote", q, k, v, caote_base="obcache-key")
    torch.testing.assert_close(a, b)
    hn = 1 / 12
    want = hn / (1 - hn + 1e-6) * torch.linalg.vector_norm(v.mean(0, keepdim=True) - v, dim=-1).T
    torch.testing.assert_close(a[:, :10], want[:, :10])
    assert torch.isposinf(a[:, 10:]).all()


@pytest.mark.parametrize("base", ["snapkv", "dropkv", "obcache-value", "obcache-key", "obcache-joint", "tova", "h2o"])
def test_caote_bases_inherit_base_protection(base):
    q, k, v = random_qkv(n=40, w=4, seed=14)
    s = score_tokens("caote", q, k, v, caote_base=base)
    assert torch.isposinf(s[:, 36:]).all() and torch.isfinite(s[:, :36]).all()
    assert (s[:, :36] >= 0).all()
    s2 = score_tokens("fastcaote", q, k, v, caote_base=base, sink=2)
    assert torch.isposinf(s2[:, :2]).all()


def test_gqa_max_dominates_mean():
    q, k, v = random_qkv(n=30, w=4, seed=15)
    for pol in WINDOW_POLICIES:
        mean = raw_window_scores(pol, q, k, v, gqa="mean")
        mx = raw_window_scores(pol, q, k, v, gqa="max")
        assert (mx >= mean - 1e-6).all(), pol


def test_score_tokens_is_scale_default_one_over_sqrt_d():
    q, k, v = random_qkv(n=20, w=3, d=16, seed=16)
    a = score_tokens("snapkv", q, k, v)
    b = score_tokens("snapkv", q, k, v, scale=0.25)
    assert torch.equal(a, b)


def test_overflowing_score_is_not_protected():
    """+inf marks protected positions only: an overflowing score saturates to the largest float32."""
    from vllm_evict.policies import count_protected

    class Huge(KeyPolicy):
        name = "huge"

        def key_score(self, k):
            return k[..., 0] * float("inf")  # k [heads, n, D]

    k = torch.tensor([[1.0], [0.5], [-1.0], [2.0]])[:, None, :]
    s = Huge().score(None, k, k, window=1, pool_kernel=1, sink=0, gqa="mean", scale=1.0)
    assert count_protected(s) == 1
    assert s[0, :3].tolist() == [torch.finfo(torch.float32).max] * 2 + [float("-inf")]


def test_kernel_support_is_declared_by_the_registry():
    """`has_kernel` on a registry entry is what routes a policy to a Triton kernel on CUDA: it must name
    exactly the policies the kernels implement (a policy without it runs the torch reference)."""
    from vllm_evict.kernels.key_scores import POLICIES as KEY_KERNEL_POLICIES
    from vllm_evict.kernels.window_scores import POLICIES as KERNEL_POLICIES

    assert {name for name, policy in POLICIES.items() if policy.has_kernel} == {*KERNEL_POLICIES, *KEY_KERNEL_POLICIES}
    assert all(POLICIES[name].window_raw for name in KERNEL_POLICIES)
    assert all(isinstance(POLICIES[name], KeyPolicy) for name in KEY_KERNEL_POLICIES)



def test_random_scores_are_the_spec_hash_of_where_each_token_sits():
    """DESIGN.md §4.8 e: S_j = h(h(h(h(h(j) ^ c) ^ i) ^ l) ^ s) / 2^32, h the 32-bit hash, from the original
    position j, compaction index c, global KV head i, layer l and seed s mod 2^32 (here in plain Python)."""
    from vllm_evict.policies.random import TokenContext

    def h(x: int) -> int:
        x ^= x >> 16
        x = (x * 0x7FEB352D) % 2**32
        x ^= x >> 15
        x = (x * 0x1B873593) % 2**32
        return x ^ (x >> 16)

    positions = torch.tensor([[0, 5, 17, 4_000_000_000], [3, 9, 200, 70_000]])
    context = TokenContext(positions=positions, heads=torch.tensor([6, 1]), layers=torch.tensor([30, 30]),
                           compaction=7, seed=-2)
    keys = torch.randn(4, 2, 8)
    scores = score_tokens("random", None, keys, keys, context=context)
    assert scores.dtype == torch.float64
    for row, (head, layer) in enumerate([(6, 30), (1, 30)]):
        for col in range(4):
            j = int(positions[row, col])
            want = h(h(h(h(h(j) ^ 7) ^ head) ^ layer) ^ (-2 % 2**32)) / 2**32
            assert float(scores[row, col]) == want
    # without a context: positions 0..n-1, heads 0..H-1, layer 0, c = 0, seed 0; pages still whole
    plain = score_tokens("random", None, keys, keys)
    assert plain[1, 2] == h(h(h(h(h(2) ^ 0) ^ 1) ^ 0) ^ 0) / 2**32
    assert select_tokens(plain, 2, page_size=2).sum(dim=1).tolist() == [2, 2]


# ---------------------------------------------------------------- expected attention (DESIGN.md §4.9)
def literal_expected_attention(q, k, v, scale, rotation, gqa="mean"):
    """The paper's closed form in float64 with explicit covariance matrices: per query head, mu and the
    biased covariance of the window rows, moved by `rotation`; softmax over keys of
    s mu'.k + s^2/2 k^T Sigma' k; the group's mean (or max); times ||v||."""
    q, k, v, r = q.double(), k.double(), v.double(), rotation.double()
    w, h_q, d = q.shape
    n, h_kv, _ = k.shape
    g = h_q // h_kv
    out = torch.zeros(h_kv, n, dtype=torch.float64)
    for i in range(h_kv):
        per_head = []
        for hh in range(i * g, (i + 1) * g):
            mu = q[:, hh].mean(0)
            cov = sum(torch.outer(q[t, hh] - mu, q[t, hh] - mu) for t in range(w)) / w
            mu, cov = r @ mu, r @ cov @ r.T
            z = torch.stack([scale * mu @ k[j, i] + scale ** 2 / 2 * k[j, i] @ cov @ k[j, i] for j in range(n)])
            per_head.append(torch.softmax(z, dim=0))
        stack = torch.stack(per_head)
        out[i] = (stack.mean(0) if gqa == "mean" else stack.amax(0)) * v[:, i].norm(dim=-1)
    return out


@pytest.mark.parametrize("gqa", ["mean", "max"])
@pytest.mark.parametrize("rotated", [False, True])
def test_expected_attention_matches_closed_form(gqa, rotated):
    from vllm_evict.policies.expected_attention import mean_rotation

    q, k, v = random_qkv(n=40, w=6, h_kv=2, g=3, d=8, seed=5)
    scale = 1 / math.sqrt(8)
    gen = torch.Generator().manual_seed(6)
    angles = torch.rand(50, 4, generator=gen, dtype=torch.float64) * 6
    rotation = mean_rotation(angles.cos(), angles.sin(), 8, neox=True) if rotated else torch.eye(8)
    got = score_tokens("expected-attention", q, k, v, scale=scale, gqa=gqa, window=6, sink=0,
                       future_rotation=rotation if rotated else None)
    want = literal_expected_attention(q, k, v, scale, rotation, gqa).float()
    assert torch.isposinf(got[:, -6:]).all()
    torch.testing.assert_close(got[:, :-6], want[:, :-6], rtol=1e-5, atol=1e-8)
    if rotated:  # the rotation changes the scores
        unrotated = score_tokens("expected-attention", q, k, v, scale=scale, gqa=gqa, window=6, sink=0)
        assert not torch.allclose(got[:, :-6], unrotated[:, :-6])


@pytest.mark.parametrize("neox", [True, False])
def test_mean_rotation_is_the_mean_of_rope_moves(neox):
    """R q equals the mean over offsets of q moved by RoPE, written as complex multiplication of each
    rotated pair (partial rotary: the last dimensions unrotated)."""
    from vllm_evict.policies.expected_attention import mean_rotation

    head_dim, rotary_dim, offsets = 10, 8, torch.arange(1, 33, dtype=torch.float64)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim))
    angles = offsets[:, None] * inv_freq[None, :]                                  # [32, 4]
    q = torch.randn(head_dim, dtype=torch.float64, generator=torch.Generator().manual_seed(7))
    half = rotary_dim // 2
    first, second = (torch.arange(half), torch.arange(half) + half) if neox else \
        (torch.arange(0, rotary_dim, 2), torch.arange(1, rotary_dim, 2))
    moved = torch.zeros(len(offsets), head_dim, dtype=torch.float64)
    pairs = torch.complex(q[first], q[second]) * torch.exp(1j * angles)
    moved[:, first], moved[:, second] = pairs.real, pairs.imag
    moved[:, rotary_dim:] = q[rotary_dim:]
    rotation = mean_rotation(angles.cos(), angles.sin(), head_dim, neox=neox)
    torch.testing.assert_close(rotation.double() @ q, moved.mean(0), rtol=1e-6, atol=1e-6)
