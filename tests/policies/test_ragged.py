"""Ragged held sets (DESIGN.md §4.8 a): every policy scores and selects over heads holding different numbers of
tokens (padded tensors + `lengths`) exactly as over each head alone; Ada-KV and uniform allocation over the
held scores against a brute-force transcription of DESIGN.md §3.4 over per-head Python lists."""

from __future__ import annotations

import math
import random
from fractions import Fraction

import pytest
import torch

from vllm_evict.policies import POLICIES, allocate_pages, keep_mask, kept_counts, score_tokens, select_tokens
from vllm_evict.policies.budget import adakv_pages
from vllm_evict.policies.random import TokenContext
from vllm_evict.policies.selection import stable_sort

from .test_budget import literal_round

INF = float("inf")
H, G, D, N = 4, 2, 8, 40
OPTIONS = [  # score_tokens options; `window` is w (query-based) or the protected recent tokens (key-only)
    {"window": 5},
    {"window": 3, "sink": 2, "gqa": "max", "pool_kernel": 5, "caote_base": "dropkv"},
    {"window": 1, "pool_kernel": 1, "caote_base": "obcache-joint"},
]


def ragged_lengths(rng: random.Random, n: int, w: int, heads: int = H) -> torch.Tensor:
    """Held counts in [max(w, 1), n] with one head holding all n and one holding just the window."""
    counts = [n, max(w, 1)] + [rng.randint(max(w, 1), n) for _ in range(heads - 2)]
    rng.shuffle(counts)
    return torch.tensor(counts, dtype=torch.int64)


def ragged_inputs(seed: int, w: int, n: int = N):
    """q_window [w, H*G, D] and padded keys / values [n, H, D] whose padding is large and finite (a leak into a
    held token's score would show), with lengths and the `random` policy's padded context."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    lengths = ragged_lengths(rng, n, w)
    q = torch.randn(max(w, 1), H * G, D, generator=gen)
    k = torch.randn(n, H, D, generator=gen)
    v = torch.randn(n, H, D, generator=gen)
    for i, m in enumerate(lengths.tolist()):
        k[m:, i] = 50 * torch.randn(n - m, D, generator=gen)
        v[m:, i] = 1e3
    context = TokenContext(positions=torch.randint(0, 10**6, (H, n), generator=gen), heads=torch.tensor([5, 2, 7, 0]),
                           layers=torch.tensor([3, 3, 4, 4]), compaction=2, seed=9)
    return q, k, v, lengths, context


def head_context(context: TokenContext, i: int, m: int) -> TokenContext:
    return TokenContext(positions=context.positions[i:i + 1, :m], heads=context.heads[i:i + 1],
                        layers=context.layers[i:i + 1], compaction=context.compaction, seed=context.seed)


@pytest.mark.parametrize("options", OPTIONS, ids=["w5", "w3-sink-max-pool5", "w1"])
@pytest.mark.parametrize("policy", list(POLICIES))
def test_scores_over_ragged_heads_are_each_head_alone(policy, options):
    """Row i over its held n_i tokens equals score_tokens on head i alone (bit for bit on CPU: fp32, or fp64 for
    random), and is -inf over the padding."""
    for seed in range(3):
        q, k, v, lengths, context = ragged_inputs(seed, options["window"])
        got = score_tokens(policy, q, k, v, lengths=lengths, context=context, **options)
        assert got.shape == (H, N)
        for i, m in enumerate(lengths.tolist()):
            alone = score_tokens(policy, q[:, i * G:(i + 1) * G], k[:m, i:i + 1], v[:m, i:i + 1],
                                 context=head_context(context, i, m), **options)
            assert torch.equal(got[i, :m], alone[0]), (seed, i, m)
            assert torch.isneginf(got[i, m:]).all(), (seed, i, m)


def brute_force_budget(per_head: list[list[float]], budget, bs: int) -> tuple[int, int]:
    """(P, p_min) of DESIGN.md §3.2 for held sets: a ratio budget reads the longest held set; r = most +inf per head."""
    r = max(sum(s == INF for s in row) for row in per_head)
    longest = max(len(row) for row in per_head)
    b_tok = budget if isinstance(budget, int) else max(1, math.floor(budget * longest + 1e-6))
    p_min = -(-max(r, 1) // bs)
    return max(-(-b_tok // bs), p_min), p_min


def brute_force_pages(per_head: list[list[float]], budget, bs: int, alpha: float, allocation: str) -> list[int]:
    """DESIGN.md §3.4 over held sets (§4.8 a) in plain Python, from each head's held scores: uniform min(P, p_max,i),
    or Ada-KV's global top-B over the held entries in (head, position) order, safeguard and page rounding with
    per-head p_max,i."""
    h = len(per_head)
    pages, p_min = brute_force_budget(per_head, budget, bs)
    p_max = [-(-len(row) // bs) for row in per_head]
    if allocation == "uniform":
        return [min(pages, pm) for pm in p_max]
    total = pages * h
    if sum(p_max) <= total:  # the layer evicts nothing
        return p_max
    top = total * bs
    f = [0] * h
    for _, i, _ in sorted((-s, i, j) for i, row in enumerate(per_head) for j, s in enumerate(row))[:top]:
        f[i] += 1
    a = Fraction(str(alpha))
    x = [((1 - a) * fi + a * Fraction(top, h)) / bs for fi in f]
    return literal_round(x, total, p_min, p_max)


def brute_force_kept(per_head: list[list[float]], pages: list[int], bs: int) -> list[list[int]]:
    """Each head's min(n_i, p_i*bs) best held positions, equal scores: lower position first (DESIGN.md §7.1)."""
    return [sorted(sorted(range(len(row)), key=lambda j: (-row[j], j))[:min(len(row), p * bs)])
            for row, p in zip(per_head, pages)]


def held_lists(scores: torch.Tensor, lengths: torch.Tensor) -> list[list[float]]:
    return [row[:m].tolist() for row, m in zip(scores, lengths.tolist())]


def kept_lists(mask: torch.Tensor) -> list[list[int]]:
    return [row.nonzero().flatten().tolist() for row in mask]


@pytest.mark.parametrize("allocation", ["uniform", "adakv"])
@pytest.mark.parametrize("policy", list(POLICIES))
def test_selection_over_ragged_heads_matches_brute_force(policy, allocation):
    """select_tokens / allocate_pages over every policy's ragged scores = DESIGN.md §3.4 over the per-head held
    scores; the padding is never kept; uniform keeps min(n_i, P*bs) per head."""
    for seed in range(4):
        rng = random.Random(100 + seed)
        options = OPTIONS[seed % len(OPTIONS)]
        q, k, v, lengths, context = ragged_inputs(seed, options["window"])
        scores = score_tokens(policy, q, k, v, lengths=lengths, context=context, **options)
        per_head = held_lists(scores, lengths)
        for budget, bs in ((rng.randint(1, N // 2), rng.choice([1, 2, 4])), (0.3, 4), (8, 16)):
            alpha = rng.choice([0.0, 0.2, 0.5])
            pages = allocate_pages(scores, budget, allocation=allocation, page_size=bs, alpha=alpha, lengths=lengths)
            want = brute_force_pages(per_head, budget, bs, alpha, allocation)
            assert pages.tolist() == want, (seed, budget, bs)
            mask = select_tokens(scores, budget, allocation=allocation, page_size=bs, alpha=alpha, lengths=lengths)
            assert kept_lists(mask) == brute_force_kept(per_head, want, bs), (seed, budget, bs)
            if allocation == "uniform":
                pages_per_head, _ = brute_force_budget(per_head, budget, bs)
                assert mask.sum(dim=1).tolist() == [min(m, pages_per_head * bs) for m in lengths.tolist()]


def random_held_scores(rng: random.Random, gen: torch.Generator, heads: int, n: int, bs: int):
    """Scores [heads, n] of ragged held sets: ties, a protected window of each head's last w held tokens and a
    sink, one head holding all n and one only its window; padding is garbage (select_tokens must ignore it)."""
    w, sink = rng.randint(0, 6), rng.randint(0, 2)
    lengths = ragged_lengths(rng, n, max(w + sink, 1), heads)
    scores = torch.randint(0, 6, (heads, n), generator=gen).double() / 4 if rng.random() < 0.5 \
        else torch.rand(heads, n, generator=gen, dtype=torch.float64)
    for i, m in enumerate(lengths.tolist()):
        scores[i, :sink] = INF
        scores[i, m - w:m] = INF
        scores[i, m:] = rng.choice([1e9, INF, 0.5])
    return scores, lengths


def test_random_ragged_selection_matches_brute_force():
    """Many shapes, tied scores, protected entries, every budget kind; padding holding large or +inf garbage."""
    for seed in range(150):
        rng = random.Random(700 + seed)
        gen = torch.Generator().manual_seed(seed)
        heads, n, bs = rng.randint(2, 7), rng.randint(8, 120), rng.choice([1, 2, 4, 16])
        scores, lengths = random_held_scores(rng, gen, heads, n, bs)
        budget = rng.choice([rng.randint(1, n), round(rng.uniform(0.05, 1.0), 2)])
        alpha = rng.choice([0.0, 0.2, 0.37, 1.0])
        per_head = held_lists(scores, lengths)
        for allocation in ("uniform", "adakv"):
            want = brute_force_pages(per_head, budget, bs, alpha, allocation)
            pages = allocate_pages(scores, budget, allocation=allocation, page_size=bs, alpha=alpha, lengths=lengths)
            assert pages.tolist() == want, (seed, allocation)
            mask = select_tokens(scores, budget, allocation=allocation, page_size=bs, alpha=alpha, lengths=lengths)
            assert kept_lists(mask) == brute_force_kept(per_head, want, bs), (seed, allocation)


def test_adakv_budget_beyond_the_held_entries_selects_them_all():
    """B = T*bs may exceed the held entries while the held pages still exceed T (heads holding part pages):
    every held entry is then selected (f_i = n_i) and the -inf padding takes none of the B."""
    checked = 0
    for seed in range(1500):
        rng = random.Random(seed)
        heads, bs = rng.randint(2, 4), rng.choice([2, 4, 16])
        n = rng.randint(bs, 6 * bs)
        lengths = torch.tensor([n] + [rng.randint(1, n) for _ in range(heads - 1)])
        scores = torch.rand(heads, n, generator=torch.Generator().manual_seed(seed))
        per_head = held_lists(scores, lengths)
        budget = rng.randint(1, -(-n // bs)) * bs
        pages, _ = brute_force_budget(per_head, budget, bs)
        if sum(-(-m // bs) for m in lengths.tolist()) <= pages * heads or pages * heads * bs <= int(lengths.sum()):
            continue
        checked += 1
        got = allocate_pages(scores, budget, allocation="adakv", page_size=bs, lengths=lengths)
        assert got.tolist() == brute_force_pages(per_head, budget, bs, 0.2, "adakv"), seed
    assert checked > 40


def test_engine_call_pattern_over_ragged_layers():
    """The engine's select_group over L layers folded into the head axis: score_tokens with lengths [L*H], one
    stable sort, adakv_pages on the sorted [L, H, n] scores with lengths [L*H] (or [L, H]), kept_counts with
    the lengths, keep_mask with the sort's order; each layer equals the brute force with budget P*bs."""
    for seed in range(20):
        rng = random.Random(900 + seed)
        layers, w, bs = rng.randint(1, 3), rng.randint(1, 6), rng.choice([1, 2, 4])
        policy = rng.choice([name for name, p in POLICIES.items() if p.supports_adakv])
        per_layer = [ragged_inputs(10 * seed + i, w) for i in range(layers)]
        q, k, v = (torch.cat([x[j] for x in per_layer], dim=1) for j in range(3))
        lengths = torch.cat([x[3] for x in per_layer])
        scores = score_tokens(policy, q, k, v, lengths=lengths, window=w)
        pages = rng.randint(-(-w // bs), -(-N // bs) - 1)
        ordered, order = stable_sort(scores)
        sorted_layers = ordered.view(layers, H, N)
        for held in (lengths, lengths.view(layers, H)):
            page_counts = adakv_pages(sorted_layers, pages, page_size=bs, alpha=0.2, max_protected=w,
                                      sorted_scores=sorted_layers, lengths=held).reshape(-1)
            mask = keep_mask(scores, kept_counts(page_counts, held, bs), order)
            for layer in range(layers):
                rows = slice(layer * H, (layer + 1) * H)
                per_head = held_lists(scores[rows], lengths[rows])
                want = brute_force_pages(per_head, pages * bs, bs, 0.2, "adakv")
                assert page_counts[rows].tolist() == want, (seed, layer)
                assert kept_lists(mask[rows]) == brute_force_kept(per_head, want, bs), (seed, layer)


def test_kept_counts_take_held_counts():
    pages = torch.tensor([[3, 1], [0, 5]])
    assert kept_counts(pages, 10, 4).tolist() == [[10, 4], [0, 10]]
    assert kept_counts(pages, torch.tensor([9, 2, 7, 30]), 4).tolist() == [[9, 2], [0, 20]]


@pytest.mark.parametrize(
    "lengths, options, needle",
    [
        (torch.tensor([20, 20]), {}, "(2,)"),
        (torch.tensor([20.0, 20.0, 20.0]), {}, "float"),
        (torch.tensor([20, 21, 20]), {}, "21"),
        (torch.tensor([20, 3, 20]), {"window": 4}, "[4, n=20]"),
        (torch.tensor([20, 0, 20]), {}, "[0, 20]"),
        ([20, 20, 20], {}, "list"),
    ],
)
def test_bad_lengths_are_refused(lengths, options, needle):
    gen = torch.Generator().manual_seed(0)
    q, k = torch.randn(4, 6, 8, generator=gen), torch.randn(20, 3, 8, generator=gen)
    for policy in ("snapkv", "knorm"):
        with pytest.raises(ValueError) as err:
            score_tokens(policy, q, k, k, lengths=lengths, **options)
        assert needle in str(err.value)
    if not options:
        with pytest.raises(ValueError) as err:
            select_tokens(torch.rand(3, 20), 4, page_size=2, lengths=lengths)
        assert needle in str(err.value)
