"""Every evicting request's window queries, kept on the device between the steps that compute them and the
compaction that scores with them (DESIGN.md §2.3)."""

from __future__ import annotations

import torch


class WindowStore:
    """The window queries of every evicting request, one tensor [L, rows, Hq, D] for all layers: a request
    owns the rows [offset, offset + w) (row i: the query of position `point - w + i` of its next point). A
    step's captures are one gather and one scatter per layer (`capture`, from the attention call), or for all
    layers at once (`capture_all`, from the queries a FULL decode graph staged), whatever the number of
    requests. Rows are handed out per window size and reused once a request is gone; the tensor grows (its
    rows copied) when a new request needs more."""

    def __init__(self, num_layers: int) -> None:
        self.rows: torch.Tensor | None = None
        self.num_layers = num_layers             # layer indices of the model's attention layers: 0 .. L-1
        self.capacity = 0
        self.free: dict[int, list[int]] = {}  # window size -> free offsets

    def allocate(self, size: int) -> int:
        spare = self.free.get(size)
        if spare:
            return spare.pop()
        offset, self.capacity = self.capacity, self.capacity + size
        return offset

    def release(self, offset: int, size: int) -> None:
        self.free.setdefault(size, []).append(offset)

    def tensor(self, like: torch.Tensor) -> torch.Tensor:
        """All rows, grown to the current capacity (a query [T, Hq, D] of this step gives dtype and shape)."""
        rows = self.rows
        if rows is None or rows.shape[1] < self.capacity:
            grown = like.new_empty(self.num_layers, self.capacity, *like.shape[1:])
            if rows is not None:
                grown[:, : rows.shape[1]] = rows
            rows = self.rows = grown
        return rows

    def capture(self, layer: int, query: torch.Tensor, tokens: torch.Tensor, rows: torch.Tensor) -> None:
        """Copy one layer's queries [T, Hq, D] of batch tokens `tokens` into `rows` (device int64 tensors)."""
        indexable(self.tensor(query))[layer].index_copy_(0, rows, indexable(query).index_select(0, tokens))

    def capture_all(self, queries: torch.Tensor, tokens: torch.Tensor, rows: torch.Tensor) -> None:
        """The same for every layer at once, from staged queries [L, T, Hq, D]."""
        indexable(self.tensor(queries[0]))[: queries.shape[0]].index_copy_(1, rows,
                                                                           indexable(queries).index_select(1, tokens))

    def window(self, offset: int, size: int) -> torch.Tensor:
        """One request's rows of every layer [L, size, Hq, D] (a view)."""
        return self.rows[:, offset: offset + size]

    def shift(self, offset: int, size: int, step: int) -> None:
        """Rows [offset + step, offset + size) move to [offset, offset + size - step), in every layer."""
        if self.rows is not None:
            self.rows[:, offset: offset + size - step] = self.rows[:, offset + step: offset + size].clone()


def indexable(x: torch.Tensor) -> torch.Tensor:
    """x, or the bytes of fp8 queries (an fp8 cache): CUDA has no fp8 index_select / index_copy."""
    return x.view(torch.uint8) if x.dtype in (torch.float8_e4m3fn, torch.float8_e5m2) else x
