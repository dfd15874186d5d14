"""DESIGN.md §3: budget parsing, pages, uniform and Ada-KV allocation (incl. the literal page-rounding loop)."""

from __future__ import annotations

import math
import random
from fractions import Fraction

import pytest
import torch

from vllm_evict.policies import allocate_pages, budget_tokens, num_pages, select_tokens
from vllm_evict.policies.budget import adakv_pages, round_pages

INF = float("inf")


def test_budget_tokens_ratio_and_int():
    assert budget_tokens(100, 0.1) == 10
    assert budget_tokens(100, 0.57) == 57  # 0.57*100 = 56.99999999999999 in float64; the +1e-6 makes it 57
    assert budget_tokens(100, 0.29) == 29  # 28.999999999999996
    assert budget_tokens(7, 0.1) == 1  # floor(0.7) = 0 -> at least one token
    assert budget_tokens(100, 1.0) == 100
    assert budget_tokens(100, 1) == 1  # int 1 is one token
    assert budget_tokens(100, 2048) == 2048


def test_num_pages_rules():
    # P = max(ceil(b_tok/bs), p_min), p_min = ceil(max(r,1)/bs); None when n <= P*bs
    assert num_pages(1000, 100, 16, 32) == 7
    assert num_pages(1000, 1, 16, 0) == 1
    assert num_pages(1000, 1, 16, 40) == 3  # budget below the protected set is raised
    assert num_pages(1000, 1000, 16, 0) is None
    assert num_pages(1000, 993, 16, 0) is None  # 63 pages = 1008 >= n
    assert num_pages(1000, 992, 16, 0) == 62
    assert num_pages(1000, 1.0, 16, 0) is None
    assert num_pages(10, 4, 2, 2) == 2


def literal_round(x, total, p_min, p_max):
    """DESIGN.md §3.4 step 3, one page at a time; p_max is an int, or one per head (ragged held sets, §4.8 a)."""
    p_max = [p_max] * len(x) if isinstance(p_max, int) else p_max
    p = [min(max(math.floor(xi), p_min), pm) for xi, pm in zip(x, p_max)]
    while sum(p) < total:
        cand = [i for i in range(len(x)) if p[i] < p_max[i]]
        best = max(cand, key=lambda i: (x[i] - p[i], -i))
        p[best] += 1
    while sum(p) > total:
        cand = [i for i in range(len(x)) if p[i] > p_min]
        best = min(cand, key=lambda i: (x[i] - p[i], -i))
        p[best] -= 1
    return p


def test_round_pages_matches_literal_loop():
    rng = random.Random(0)
    for _ in range(3000):
        h = rng.randint(1, 9)
        p_min = rng.randint(1, 4)
        p_max = p_min + rng.randint(0, 12)
        big = rng.randint(p_min, p_max)
        total = big * h
        # random positive weights summing to total, with frequent exact ties and extremes
        raw = [Fraction(rng.choice([0, 1, 2, 3, rng.randint(0, 40)]), rng.choice([1, 2, 4, 5])) for _ in range(h)]
        if sum(raw) == 0:
            raw = [Fraction(1)] * h
        x = [r * total / sum(raw) for r in raw]
        assert sum(x) == total
        want = literal_round(x, total, p_min, p_max)
        got = round_pages(x, total, p_min, p_max)
        assert got == want, (x, total, p_min, p_max)
        assert sum(got) == total and all(p_min <= p <= p_max for p in got)


def test_round_pages_tie_directions():
    # deficit: equal remainders -> lower head first
    assert round_pages([Fraction(3, 2), Fraction(3, 2), Fraction(3)], 6, 1, 5) == [2, 1, 3]
    # surplus via the p_min clamp: equal remainders -> higher head loses first
    assert round_pages([Fraction(0), Fraction(3), Fraction(3)], 6, 1, 5) == [1, 3, 2]


def rand_scores(h, n, seed, protect_last=0, sink=0, ties=False):
    gen = torch.Generator().manual_seed(seed)
    s = torch.rand(h, n, generator=gen)
    if ties:
        s = torch.round(s * 4) / 4
    if protect_last:
        s[:, n - protect_last :] = INF
    if sink:
        s[:, :sink] = INF
    return s


@pytest.mark.parametrize("allocation", ["uniform", "adakv"])
def test_kept_counts_are_whole_pages(allocation):
    for seed in range(40):
        rng = random.Random(seed)
        h, n, bs = rng.randint(1, 6), rng.randint(1, 300), rng.choice([1, 2, 4, 16])
        w = rng.randint(0, min(n, 40))
        budget = rng.choice([rng.randint(1, n + 20), round(rng.uniform(0.01, 1.0), 3)])
        s = rand_scores(h, n, seed, protect_last=w, ties=seed % 2 == 0)
        p = allocate_pages(s, budget, allocation=allocation, page_size=bs)
        mask = select_tokens(s, budget, allocation=allocation, page_size=bs)
        P = num_pages(n, budget, bs, w)
        if P is None:
            assert mask.all()
        else:
            assert int(p.sum()) == P * h  # T exactly
            p_min = -(-max(w, 1) // bs)
            assert all(p_min <= pi <= -(-n // bs) for pi in p.tolist())
        assert mask.sum(-1).tolist() == [min(n, pi * bs) for pi in p.tolist()]
        if w:
            assert mask[:, n - w :].all()  # protected entries always kept


def test_budget_at_least_n_keeps_all():
    s = rand_scores(3, 50, 1)
    for budget in (50, 51, 1000, 1.0):
        for alloc in ("uniform", "adakv"):
            assert select_tokens(s, budget, allocation=alloc).all()


def test_int_one_keeps_minimum_pages():
    s = rand_scores(4, 200, 2, protect_last=20)
    for alloc in ("uniform", "adakv"):
        mask = select_tokens(s, 1, allocation=alloc, page_size=16)
        assert mask.sum().item() == 4 * 32  # p_min = ceil(20/16) = 2 pages per head
        assert mask[:, 180:].all()
    s = rand_scores(4, 200, 2)
    assert select_tokens(s, 1, page_size=16).sum(-1).tolist() == [16] * 4


def test_adakv_global_topb_and_safeguard():
    """One head has all the high scores; alpha guarantees every head alpha*B/H_kv tokens."""
    h, n, bs = 4, 256, 16
    s = torch.rand(h, n) * 0.1
    s[0] += 1.0
    s[:, -16:] = INF
    budget = 64  # P = 4, T = 16, B = 256
    p = allocate_pages(s, budget, allocation="adakv", page_size=bs, alpha=0.2)
    # f = (16*... ) head 0 takes all free slots it can: f0 = 16 + min(240, 256-64) = 208, others 16
    # B_i = 0.8 f + 0.2*64 = (179.2, 25.6, 25.6, 25.6) -> x = (11.2, 1.6, 1.6, 1.6) -> (11,1,1,1)=14, +1 h1, +1 h2
    assert p.tolist() == [11, 2, 2, 1]
    assert allocate_pages(s, budget, allocation="adakv", page_size=bs, alpha=0.0).tolist() == [13, 1, 1, 1]
    assert allocate_pages(s, budget, allocation="adakv", page_size=bs, alpha=1.0).tolist() == [4, 4, 4, 4]


def test_adakv_respects_p_max():
    h, n, bs = 3, 64, 16
    s = torch.rand(h, n) * 0.1
    s[0] += 1
    p = allocate_pages(s, 48, allocation="adakv", page_size=bs, alpha=0.0)  # P = 3, T = 9; head 0 wants 6 > p_max = 4
    assert p.tolist()[0] == 4 and int(p.sum()) == 9


def literal_adakv(s, budget, bs, alpha, r):
    """DESIGN.md §3.4 one head-page at a time, in plain Python (pages per head of one layer)."""
    h, n = s.shape
    P = num_pages(n, budget, bs, r)
    if P is None:
        return [-(-n // bs)] * h
    T, B = P * h, P * h * bs
    flat = s.flatten().tolist()
    order = sorted(range(h * n), key=lambda i: (-flat[i], i))[:B]
    f = [0] * h
    for i in order:
        f[i // n] += 1
    a = Fraction(str(alpha))
    x = [((1 - a) * fi + a * Fraction(B, h)) / bs for fi in f]
    return literal_round(x, T, -(-max(r, 1) // bs), -(-n // bs))


def test_adakv_matches_literal_algorithm_random():
    for seed in range(60):
        rng = random.Random(100 + seed)
        h, n, bs = rng.randint(1, 8), rng.randint(20, 200), rng.choice([2, 4, 16])
        w, sink = rng.randint(0, 10), rng.randint(0, 4)
        s = rand_scores(h, n, seed, protect_last=w, sink=sink, ties=seed % 3 == 0)
        budget = rng.randint(1, n)
        alpha = rng.choice([0.0, 0.2, 0.5, 1.0])
        got = allocate_pages(s, budget, allocation="adakv", page_size=bs, alpha=alpha).tolist()
        assert got == literal_adakv(s, budget, bs, alpha, min(n, w + sink))


@pytest.mark.parametrize("allocation", ["uniform", "adakv"])
def test_layers_at_once_match_each_layer(allocation):
    """scores [L, H, n] (the engine's path): each layer allocated on its own, with its own protected count
    (so some layers may evict nothing)."""
    for seed in range(30):
        rng = random.Random(500 + seed)
        L, h, n, bs = rng.randint(1, 5), rng.randint(1, 6), rng.randint(20, 150), rng.choice([2, 4, 16])
        budget, alpha = rng.randint(1, n // 2), rng.choice([0.0, 0.2, 1.0])
        protect = [rng.randint(0, n if rng.random() < 0.2 else 12) for _ in range(L)]
        layers = torch.stack([rand_scores(h, n, 10 * seed + i, protect_last=protect[i], ties=i % 2 == 0)
                              for i in range(L)])
        got = allocate_pages(layers, budget, allocation=allocation, page_size=bs, alpha=alpha)
        assert got.shape == (L, h)
        for i in range(L):
            if allocation == "adakv":
                want = literal_adakv(layers[i], budget, bs, alpha, min(n, protect[i]))
            else:
                P = num_pages(n, budget, bs, min(n, protect[i]))
                want = [-(-n // bs) if P is None else P] * h
            assert got[i].tolist() == want, (seed, i)


def test_engine_allocation_of_many_layers_matches_literal():
    """adakv_pages (the engine's sync-free form, P per layer as a tensor, r bounded by the config's): heavy
    give-back (heads clamped up to p_min, one head holding every high score), odd alphas, many layers."""
    for seed in range(40):
        rng = random.Random(1300 + seed)
        L, h, n, bs = rng.randint(1, 6), rng.choice([2, 3, 8]), rng.randint(40, 260), rng.choice([1, 2, 4, 16])
        alpha = rng.choice([0.0, 0.2, 0.37, 1.0])
        w = rng.randint(1, 40)
        layers = []
        for i in range(L):
            s = rand_scores(h, n, 31 * seed + i, protect_last=w, ties=i % 2 == 1)
            if i % 2:  # head 0 alone is protected and wins the whole global top-B: the others sit at p_min
                s[0, : n - w] += 2.0
                s[1:, n - w:] = torch.rand(h - 1, w)
            layers.append(s)
        layers = torch.stack(layers)
        p_min, p_max = -(-w // bs), -(-n // bs)
        pages = [rng.randint(p_min, p_max - 1) for _ in range(L)]
        if any(p * bs >= n for p in pages):
            continue
        got = adakv_pages(layers, pages, page_size=bs, alpha=alpha, max_protected=w)
        for i in range(L):
            budget = pages[i] * bs
            assert num_pages(n, budget, bs, w) == pages[i]
            assert got[i].tolist() == literal_adakv(layers[i], budget, bs, alpha, w), (seed, i)


def test_allocate_pages_streaming_like_uniform_for_single_head():
    s = rand_scores(1, 100, 3)
    assert allocate_pages(s, 32, allocation="adakv").tolist() == [2]


def test_given_pages_are_the_total():
    """The engine passes P (the scheduler reserved exactly P*H pages per layer): the allocation uses it,
    and equals the derived one when they agree."""
    for seed in range(20):
        rng = random.Random(900 + seed)
        h, n, bs, w = rng.randint(2, 6), rng.randint(60, 200), rng.choice([4, 16]), rng.randint(0, 8)
        s = rand_scores(h, n, seed, protect_last=w)
        budget = rng.randint(1, n // 3)
        P = num_pages(n, budget, bs, w)
        if P is None:
            continue
        derived = allocate_pages(s, budget, allocation="adakv", page_size=bs)
        assert torch.equal(allocate_pages(s, budget, allocation="adakv", page_size=bs, pages=P), derived)
        more = allocate_pages(s, budget, allocation="adakv", page_size=bs, pages=P + 1)
        assert int(more.sum()) == (P + 1) * h
