"""SPEC §3: budget parsing, pages per head P, and the uniform / Ada-KV page allocation.

All page arithmetic is exact: Ada-KV's B_i = (1-alpha) f_i + alpha B/H_kv and x_i = B_i/bs are
evaluated as rational numbers (alpha is read as the decimal it prints as, so 0.2 is exactly 1/5),
which makes the floor / largest-remainder page rounding of §3.4 deterministic and platform-free.
"""

from __future__ import annotations

import math
from fractions import Fraction
from typing import Sequence

import torch

from ._validate import INT_MAX, is_int, is_real

ALLOCATIONS = ("uniform", "adakv")


def check_budget(budget: object) -> int | float:
    """Validate a request budget (SPEC §3.1): int >= 1 (tokens) or float in (0, 1] (ratio)."""
    if is_int(budget):
        if not 1 <= int(budget) <= INT_MAX:  # type: ignore[arg-type]
            raise ValueError(f"budget must be an int in [1, 2**63 - 1] or a float in (0, 1], got {budget!r}")
        return int(budget)  # type: ignore[arg-type]
    if is_real(budget):
        b = float(budget)  # type: ignore[arg-type]
        if not (0.0 < b <= 1.0):
            raise ValueError(f"budget must be an int >= 1 or a float in (0, 1], got {budget!r}")
        return b
    raise ValueError(f"budget must be an int >= 1 or a float in (0, 1], got {budget!r}")


def budget_tokens(n: int, budget: int | float) -> int:
    """b_tok (tokens per KV head). A float is a keep ratio: max(1, floor(budget*n + 1e-6)) in float64;
    an int is a token count. Integer 1 is one token; float 1.0 keeps everything."""
    b = check_budget(budget)
    if isinstance(b, int):
        return b
    return max(1, math.floor(b * n + 1e-6))


def num_pages(n: int, budget: int | float, page_size: int = 16, protected: int = 0) -> int | None:
    """P of SPEC §3.2, or None when n <= P*bs (nothing is evicted).

    p_min = ceil(max(r, 1)/bs) with r = `protected`; P = max(ceil(b_tok/bs), p_min).
    """
    if not is_int(n) or n < 1:
        raise ValueError(f"n must be an integer >= 1, got {n!r}")
    if not is_int(page_size) or page_size < 1:
        raise ValueError(f"page_size must be an integer >= 1, got {page_size!r}")
    if not is_int(protected) or protected < 0:
        raise ValueError(f"protected must be an integer >= 0, got {protected!r}")
    b_tok = budget_tokens(n, budget)
    p_min = -(-max(protected, 1) // page_size)
    pages = max(-(-b_tok // page_size), p_min)
    if n <= pages * page_size:
        return None
    return pages


def count_protected(scores: torch.Tensor) -> int:
    """r as seen by the allocator: the number of +inf scores per head, max over heads."""
    if scores.numel() == 0:
        return 0
    return int(torch.isposinf(scores).sum(dim=-1).max().item())


def _check_scores(scores: object) -> torch.Tensor:
    if not isinstance(scores, torch.Tensor):
        raise ValueError(f"scores must be a torch.Tensor [H_kv, n], got {type(scores).__name__}")
    if scores.dim() not in (2, 3):
        raise ValueError(f"scores must have shape [H_kv, n] or [L, H_kv, n], got shape {tuple(scores.shape)}")
    if min(scores.shape) < 1:
        raise ValueError(f"scores must be non-empty [H_kv, n], got shape {tuple(scores.shape)}")
    if not scores.is_floating_point():
        raise ValueError(f"scores must be floating point, got dtype {scores.dtype}")
    return scores


def _check_alloc(allocation: object, page_size: object, alpha: object) -> None:
    if allocation not in ALLOCATIONS:
        raise ValueError(f"allocation must be one of {ALLOCATIONS}, got {allocation!r}")
    if not is_int(page_size) or int(page_size) < 1:  # type: ignore[arg-type]
        raise ValueError(f"page_size must be an integer >= 1, got {page_size!r}")
    if not is_real(alpha) or not (0.0 <= float(alpha) <= 1.0):  # type: ignore[arg-type]
        raise ValueError(f"alpha must be a number in [0, 1], got {alpha!r}")


def _take_units(rem: Sequence[Fraction], cap: Sequence[int], count: int, low_index_first: bool) -> list[int]:
    """Bulk form of the greedy "+1 to the largest remainder" loop.

    Head i offers cap[i] units; its m-th unit (m = 0, 1, ...) has priority rem[i] - m (giving the head one
    page lowers its remainder by one). Returns how many of the `count` best units (priority descending,
    equal priority: lower head first if low_index_first else higher head first) each head gets, which is
    exactly what the one-page-at-a-time loop of SPEC §3.4 produces, in O(H^2) instead of O(pages).
    """
    h = len(rem)
    take = [0] * h
    if count <= 0:
        return take
    if count > sum(cap):
        raise AssertionError("page rounding is infeasible (internal error)")
    fl = [math.floor(r) for r in rem]
    frac = [r - f for r, f in zip(rem, fl)]
    heads = [i for i in range(h) if cap[i] > 0]
    # Integer level L holds the unit of head i with priority fl[i] - m + frac[i], when lo[i] < L <= fl[i].
    lo = {i: fl[i] - cap[i] for i in heads}
    level = max(fl[i] for i in heads)
    while count > 0:
        active = [i for i in heads if lo[i] < level <= fl[i]]
        below = [fl[j] for j in heads if fl[j] < level] + [lo[i] for i in active]
        nxt = max(below)  # levels level, level-1, ..., nxt+1 share the same active set
        if not active:
            level = nxt
            continue
        span = level - nxt
        full = min(span, count // len(active))
        for i in active:
            take[i] += full
        count -= full * len(active)
        if full < span and count > 0:
            order = sorted(active, key=lambda i: (-frac[i], i if low_index_first else -i))
            for i in order[:count]:
                take[i] += 1
            count = 0
        level -= full
    return take


def round_pages(x: Sequence[Fraction], total: int, p_min: int, p_max: int) -> list[int]:
    """SPEC §3.4 step 3: deterministic largest-remainder rounding of x (sum x = total) with bounds."""
    p = [min(max(math.floor(xi), p_min), p_max) for xi in x]
    s = sum(p)
    if s < total:  # +1 to the largest (x_i - p_i) among p_i < p_max; tie -> lower i
        add = _take_units([xi - pi for xi, pi in zip(x, p)], [p_max - pi for pi in p], total - s, True)
        p = [pi + a for pi, a in zip(p, add)]
    elif s > total:  # -1 to the smallest (x_i - p_i) among p_i > p_min; tie -> higher i
        sub = _take_units([-(xi - pi) for xi, pi in zip(x, p)], [pi - p_min for pi in p], s - total, False)
        p = [pi - d for pi, d in zip(p, sub)]
    return p


def allocate_pages(
    scores: torch.Tensor,
    budget: int | float,
    *,
    allocation: str = "uniform",
    page_size: int = 16,
    alpha: float = 0.2,
    pages: int | None = None,
) -> torch.Tensor:
    """Pages per KV head p_i (CPU int64 [H_kv]) for final scores [H_kv, n] (protected = +inf); or
    [L, H_kv] for scores [L, H_kv, n], each layer allocated on its own (the engine's path). `pages` is P
    when the caller already has it (the engine: the scheduler reserved exactly P*H_kv pages per layer);
    otherwise it is derived here from the budget and the protected count r read off the scores.

    When nothing is evicted (num_pages is None) every head gets p_max = ceil(n/bs) pages, i.e. keeps all n.
    Kept tokens of head i: K_i = min(n, p_i * page_size).
    """
    return PageAllocation(scores, budget, allocation=allocation, page_size=page_size, alpha=alpha,
                          pages=pages).result()


class PageAllocation:
    """allocate_pages in two stages, so that a caller can overlap the host part with later device work.

    The constructor validates and enqueues the device work (NaN check, r, and with `pages` given the
    Ada-KV head counts f of every layer) and one non-blocking copy of it to the host. `result()` waits for
    that copy only, not for work enqueued after it, then rounds on the host (SPEC §3.4, exact). Without
    `pages`, the head counts need the pages derived from r: one more transfer in `result()`."""

    def __init__(self, scores: torch.Tensor, budget: int | float, *, allocation: str = "uniform",
                 page_size: int = 16, alpha: float = 0.2, pages: int | None = None) -> None:
        scores = _check_scores(scores)
        check_budget(budget)
        _check_alloc(allocation, page_size, alpha)
        self.single = scores.dim() == 2
        self.layers = scores.unsqueeze(0) if self.single else scores
        self.budget, self.allocation, self.page_size, self.alpha, self.pages = budget, allocation, page_size, alpha, pages
        num_layers, h, _ = self.layers.shape
        parts = [torch.isnan(self.layers).any().view(1).to(torch.int64),
                 torch.isposinf(self.layers).sum(dim=-1).amax(dim=-1).to(torch.int64)]
        self.counts_known = pages is not None and allocation == "adakv" and h > 1
        if self.counts_known:
            parts.append(self._head_counts(list(range(num_layers)), [pages] * num_layers).view(-1))
        stats = torch.cat(parts)
        self.ready = None
        if stats.is_cuda:
            self.host = torch.empty(stats.shape, dtype=stats.dtype, pin_memory=True)
            self.host.copy_(stats, non_blocking=True)
            self.ready = torch.cuda.Event()
            self.ready.record()
        else:
            self.host = stats

    def _head_counts(self, rows: list[int], per_layer: list[int]) -> torch.Tensor:
        """Ada-KV step 1 (SPEC §3.4): f [len(rows), H], the heads' shares of each layer's global stable
        top-(P*H*page_size) over its head-major flattening."""
        layers, (_, h, n) = self.layers, self.layers.shape
        index = torch.tensor(rows, device=layers.device)
        order = torch.sort(layers[index].reshape(len(rows), h * n), dim=1, descending=True, stable=True).indices
        top = torch.tensor([p * h * self.page_size for p in per_layer], device=layers.device)
        in_top = torch.arange(h * n, device=layers.device) < top.view(-1, 1)
        f = torch.zeros(len(rows), h, dtype=torch.int64, device=layers.device)
        return f.scatter_add_(1, torch.div(order, n, rounding_mode="floor"), in_top.to(torch.int64))

    def result(self) -> torch.Tensor:
        if self.ready is not None:
            self.ready.synchronize()
        num_layers, h, n = self.layers.shape
        stats = self.host.tolist()
        if stats[0]:
            raise ValueError("scores contain NaN (a scoring bug; SPEC §7.1)")
        r = stats[1: 1 + num_layers]
        per_layer = [num_pages(n, self.budget, self.page_size, ri) if self.pages is None else self.pages for ri in r]
        p_max = -(-n // self.page_size)
        out = [[p_max if p is None else p] * h for p in per_layer]
        adakv = [i for i, p in enumerate(per_layer) if p is not None and self.allocation == "adakv" and h > 1]
        if adakv:
            if self.counts_known:
                flat = stats[1 + num_layers:]
                f = [flat[i * h: (i + 1) * h] for i in adakv]
            else:
                f = self._head_counts(adakv, [per_layer[i] for i in adakv]).tolist()
            for i, fi in zip(adakv, f):
                out[i] = _adakv_round(fi, per_layer[i], r[i], n, self.page_size, self.alpha)
        result = torch.tensor(out, dtype=torch.long)
        return result[0] if self.single else result


def _adakv_round(f: list[int], pages: int, r: int, n: int, page_size: int, alpha: float) -> list[int]:
    """SPEC §3.4 steps 2-3 for one layer: safeguard and page rounding, exactly (host arithmetic)."""
    h = len(f)
    total = pages * h
    b = total * page_size
    a = Fraction(repr(float(alpha)))
    x = [((1 - a) * fi + a * Fraction(b, h)) / page_size for fi in f]
    p_min = -(-max(r, 1) // page_size)
    return round_pages(x, total, p_min, -(-n // page_size))


def kept_counts(pages: torch.Tensor, n: int, page_size: int = 16) -> torch.Tensor:
    """K_i = min(n, p_i * bs)."""
    return torch.clamp(pages.to(torch.long) * page_size, max=n)
