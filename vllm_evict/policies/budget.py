"""DESIGN.md §3: budget parsing, pages per head P, and the uniform / Ada-KV page allocation.

All page arithmetic is exact: Ada-KV's B_i = (1-alpha) f_i + alpha B/H_kv and x_i = B_i/bs are
evaluated as integers over a common denominator (alpha is read as the decimal it prints as, so 0.2 is
exactly 1/5), which makes the floor / largest-remainder page rounding of §3.4 deterministic and
platform-free. The rounding runs in tensor arithmetic on the scores' device, so the engine allocates
without a host synchronisation (adakv_pages).
"""

from __future__ import annotations

import math
from fractions import Fraction
from typing import Sequence

import torch

from ._validate import INT_MAX, is_int, is_real
from .ragged import check_lengths, mask_padding

ALLOCATIONS = ("uniform", "adakv")


def check_budget(budget: object) -> int | float:
    """Validate a request budget (DESIGN.md §3.1): int >= 1 (tokens) or float in (0, 1] (ratio)."""
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
    """P of DESIGN.md §3.2, or None when n <= P*bs (nothing is evicted).

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


def _round_units(num: torch.Tensor, den: int, total: torch.Tensor, p_min: torch.Tensor, p_max: int | torch.Tensor,
                 units: int) -> torch.Tensor:
    """DESIGN.md §3.4 step 3 for x = num / den (num int64 [L, H] >= 0, sum_i x = total [L]) with bounds p_min [L]
    and p_max (an int, or int64 [L, H] per head), in integer tensor arithmetic on num's device, without host
    synchronisation.

    The one-page-at-a-time loop is a selection: head i's m-th extra page has priority x_i - p_i - m (the loop
    picks the largest, equal: lower head), its m-th page given back x_i - p_i + m (smallest first, equal:
    higher head). A head's priorities are monotone in m, so the loop's `count` steps take the `count` best
    units over all heads: a stable sort of [L, H * units] each way. `units` must bound what one head takes or gives
    (allocate_pages: H * p_min at most; over ragged held sets, its p_max,i <= ceil(n/bs) at most)."""
    num_layers, h = num.shape
    p = torch.clamp(torch.maximum(num // den, p_min.view(-1, 1)), max=p_max)
    p_max = p_max if isinstance(p_max, int) else p_max.unsqueeze(-1)
    deficit = (total - p.sum(dim=1)).view(-1, 1)  # > 0: pages to add; < 0: pages to give back
    m = torch.arange(units, device=num.device)
    rank = torch.arange(h * units, device=num.device)
    pm = p.unsqueeze(-1)
    big = torch.iinfo(torch.int64).max
    gain = (num.unsqueeze(-1) - (pm + m) * den).masked_fill(pm + m >= p_max, -big)
    order = torch.sort(gain.view(num_layers, -1), dim=1, descending=True, stable=True).indices
    add = torch.zeros_like(p).scatter_add_(1, order // units, (rank < deficit).to(torch.int64))
    loss = (num.unsqueeze(-1) - (pm - m) * den).masked_fill(pm - m <= p_min.view(-1, 1, 1), big).flip(1)
    order = torch.sort(loss.reshape(num_layers, -1), dim=1, stable=True).indices
    give = torch.zeros_like(p).scatter_add_(1, h - 1 - order // units, (rank < -deficit).to(torch.int64))
    return p + add - give


def round_pages(x: Sequence[Fraction], total: int, p_min: int, p_max: int) -> list[int]:
    """DESIGN.md §3.4 step 3 for one layer of rational x (sum x = total): the engine's rounding, on the host."""
    den = math.lcm(*(xi.denominator for xi in x))
    num = torch.tensor([[int(xi * den) for xi in x]], dtype=torch.int64)
    return _round_units(num, den, torch.tensor([total]), torch.tensor([p_min]), p_max,
                        max(p_max - p_min, 1))[0].tolist()


def allocate_pages(
    scores: torch.Tensor,
    budget: int | float,
    *,
    allocation: str = "uniform",
    page_size: int = 16,
    alpha: float = 0.2,
    pages: int | None = None,
    lengths: torch.Tensor | None = None,
) -> torch.Tensor:
    """Pages per KV head p_i (CPU int64 [H_kv]) for final scores [H_kv, n] (protected = +inf); or
    [L, H_kv] for scores [L, H_kv, n], each layer allocated on its own. P per layer comes from the budget
    and the protected count r read off the scores, or is `pages` when given.

    When nothing is evicted (num_pages is None) every head gets p_max = ceil(n/bs) pages, i.e. keeps all n.
    Kept tokens of head i: K_i = min(n, p_i * page_size).

    lengths: ragged held sets (DESIGN.md §4.8 a): an integer tensor [H_kv] (for [L, H_kv, n] scores [L, H_kv], or
    [L*H_kv] layer-major) with 1 <= n_i <= n; head i holds its first n_i scores, the rest is padding and never
    counts. n is replaced by n_i per head: p_max,i = ceil(n_i/bs), K_i = min(n_i, p_i * page_size); a float
    budget is a ratio of the layer's longest held set. Uniform: p_i = min(P, p_max,i). Ada-KV: a layer whose
    held pages sum_i p_max,i fit its P*H_kv evicts nothing (p_i = p_max,i), any other runs DESIGN.md §3.4 over the
    held scores.
    """
    scores = _check_scores(scores)
    check_budget(budget)
    _check_alloc(allocation, page_size, alpha)
    layers = scores.unsqueeze(0) if scores.dim() == 2 else scores
    num_layers, h, n = layers.shape
    if lengths is None:
        held = torch.full((num_layers, h), n)
    else:
        held = check_lengths(lengths, num_layers * h, n, read=True).to("cpu", torch.int64).reshape(num_layers, h)
        layers = mask_padding(layers, lengths)
    if bool(torch.isnan(layers).any()):
        raise ValueError("scores contain NaN (a scoring bug; DESIGN.md §7.1)")
    r = torch.isposinf(layers).sum(dim=-1).amax(dim=-1).tolist()
    if pages is not None and pages > -(-n // page_size):
        raise ValueError(f"pages={pages} exceeds the {-(-n // page_size)} pages of n={n} tokens")
    p_max = (held + page_size - 1) // page_size
    per_layer = [num_pages(int(longest), budget, page_size, ri) if pages is None else pages
                 for longest, ri in zip(held.amax(dim=1), r)]
    # P of a layer that evicts nothing: its longest head's pages, so that every head keeps all it holds
    total = torch.tensor([[int(pm.max()) if p is None else p] for p, pm in zip(per_layer, p_max)])
    out = torch.minimum(total, p_max)
    if allocation == "adakv" and h > 1:
        fits = p_max.sum(dim=1, keepdim=True) <= total * h  # DESIGN.md §4.8 a: the layer evicts nothing
        out = torch.where(fits, p_max, out)
        rows = (~fits).flatten().nonzero().flatten().tolist()
        if rows:
            index = torch.tensor(rows, device=layers.device)
            out[rows] = adakv_pages(layers[index], total[rows].flatten().tolist(), page_size=page_size, alpha=alpha,
                                    max_protected=max(r),
                                    lengths=None if lengths is None else held[rows].to(layers.device)).cpu()
    return out[0] if scores.dim() == 2 else out


def adakv_pages(scores: torch.Tensor, pages: int | list[int], *, page_size: int, alpha: float, max_protected: int,
                sorted_scores: torch.Tensor | None = None, lengths: torch.Tensor | None = None) -> torch.Tensor:
    """Ada-KV pages per head (DESIGN.md §3.4) [L, H] (int64, on the scores' device) for scores [L, H, n] with
    P = `pages` (one int, or one per layer; P * page_size < n), without host synchronisation.

    `sorted_scores`: each head's scores in descending order, when the caller sorted them already (the
    engine does, for its kept masks). r is read off the scores per layer, as the reference does;
    `max_protected` (the engine: the config's r) bounds it, which bounds the units of the rounding's sort.
    alpha is exact as the decimal it prints as.

    `lengths`: ragged held sets (DESIGN.md §4.8 a): held counts [L, H] (or [L*H], layer-major) on the scores'
    device; head i's scores past its n_i are padding and must be -inf (score_tokens' are). The global top-B
    then counts held entries only (all of them when B exceeds their number), p_max,i = ceil(n_i/bs), and a
    layer whose held pages sum_i p_max,i fit its P*H evicts nothing (p_i = p_max,i; P * page_size < n is not
    required)."""
    num_layers, h, n = scores.shape
    device = scores.device
    per_layer = [pages] * num_layers if isinstance(pages, int) else list(pages)
    a, p_min_cap, units = adakv_terms(h, n, page_size, alpha, max_protected, ragged=lengths is not None)
    q = a.denominator
    if lengths is None:
        held, p_max = None, -(-n // page_size)
    else:
        held = lengths.to(device, torch.int64).reshape(num_layers, h)
        p_max = (held + page_size - 1) // page_size
    if sorted_scores is None:
        sorted_scores = torch.sort(scores, dim=-1, descending=True).values
    f = torch.empty(num_layers, h, dtype=torch.int64, device=device)
    for p in set(per_layer):  # the engine: one P for all layers
        rows = [i for i, pi in enumerate(per_layer) if pi == p]
        index = torch.tensor(rows, device=device) if len(rows) < num_layers else slice(None)
        f[index] = _head_counts(scores[index], sorted_scores[index], p * h * page_size,
                                None if held is None else held[index])
    if isinstance(pages, int):  # built on the device: a pageable host-to-device copy would wait for the stream
        pages_t = torch.full((num_layers,), pages, dtype=torch.int64, device=device)
    else:
        pages_t = torch.tensor(per_layer, dtype=torch.int64).to(device)
    num = (q - a.numerator) * h * f + (a.numerator * h * page_size) * pages_t.view(-1, 1)
    r = torch.isposinf(scores).sum(dim=-1).amax(dim=-1)
    p_min = torch.clamp((torch.clamp(r, min=1) + page_size - 1) // page_size, max=p_min_cap)
    out = _round_units(num, q * h * page_size, pages_t * h, p_min, p_max, units)
    if held is None:
        return out
    return torch.where(p_max.sum(dim=1, keepdim=True) <= pages_t.view(-1, 1) * h, p_max, out)


def adakv_terms(h: int, n: int, page_size: int, alpha: float, max_protected: int,
                ragged: bool) -> tuple[Fraction, int, int]:
    """adakv_pages' exact constants for H = h heads of n scores: alpha as a fraction a (x_i = ((1-a) f_i + a B/H) / bs
    with B = P*H*bs, over the common denominator q*H*bs, q = a's denominator), the cap on p_min, and the units one
    head may take or give in the rounding (`_round_units`). Raises where int64 could not hold the rounding."""
    a = Fraction(repr(float(alpha)))
    p_min_cap = -(-max(max_protected, 1) // page_size)
    # over ragged held sets a head clamped at its p_max,i (it holds less than its safeguard share) leaves pages to
    # the others: a head may take (or give) up to all its pages
    units = -(-n // page_size) if ragged else h * p_min_cap
    if a.denominator * h * (2 * n + (units + 1) * page_size) >= 1 << 62:
        raise ValueError(f"alpha={alpha!r} has too many decimal digits for exact page rounding at n={n}")
    return a, p_min_cap, units


def _head_counts(scores: torch.Tensor, sorted_scores: torch.Tensor, top: int,
                 held: torch.Tensor | None = None) -> torch.Tensor:
    """DESIGN.md §3.4 step 1: f [L, H], each head's share of its layer's global stable top-`top` over the
    head-major flattening of scores [L, H, n] (ties: lower flat index first), from the B-th largest score
    tau and each head's counts above and at tau in its descending scores, without a global sort.

    `held` [L, H]: held counts of ragged held sets, whose -inf padding is no entry (it never takes a tie; when
    `top` exceeds a layer's held entries, all of them count)."""
    num_layers, h, n = scores.shape
    top = min(top, h * n)
    tau = torch.kthvalue(scores.reshape(num_layers, h * n), h * n - top + 1, dim=1).values
    ascending = -sorted_scores
    at = (-tau).view(-1, 1, 1).expand(num_layers, h, 1).contiguous()
    above = torch.searchsorted(ascending, at, right=False).view(num_layers, h)   # scores > tau
    ties = torch.searchsorted(ascending, at, right=True).view(num_layers, h) - above
    if held is not None:
        ties = torch.minimum(ties, held - above)  # -inf padding sorts after the held entries
    need = top - above.sum(dim=1, keepdim=True)  # entries equal to tau in the top: lower heads take them first
    return above + torch.clamp(need - (torch.cumsum(ties, dim=1) - ties), min=0).minimum(ties)


def kept_counts(pages: torch.Tensor, n: int | torch.Tensor, page_size: int = 16) -> torch.Tensor:
    """K_i = min(n_i, p_i * bs): n is an int (every head holds n tokens) or, for ragged held sets (DESIGN.md §4.8 a),
    the held counts n_i: a tensor with one entry per entry of pages."""
    kept = pages.to(torch.long) * page_size
    return torch.clamp(kept, max=n if is_int(n) else n.to(kept.device, torch.long).reshape(kept.shape))
