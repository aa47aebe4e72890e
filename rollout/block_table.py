"""`BlockTable`: the block tables of the running requests as one persistent int32 tensor per layer group.

The scheduler keeps each request's block table as a Python list per layer group (`ScheduledRequest.tables`).
Turning those lists into a `[B, P]` tensor every step costs time in the number of pages (B x P Python
ints per group, ~25 ms at 512 requests x 4k tokens with 16-token pages). Here each request owns a row
of a `[rows, width]` int32 tensor per group, kept across steps (as vLLM's `BlockTable`); a step writes
only what changed: the pages appended since the last sync, or the whole row when the request's list
is another list object than the one synced (a fork, a preemption, a restore build new lists).

What a row may hold beyond the request's list is never read: attention reads positions below each
request's own length only, and page entries recycled by a sliding window (`FREED`) are outside it.
Rows are freed by `release` when a request is finalised.
"""

from __future__ import annotations

import torch

MIN_ROWS = 16
MIN_WIDTH = 8


class BlockTable:
    """Args: num_groups: layer groups (one table each); device: where the tables live."""

    def __init__(self, num_groups: int, device: torch.device) -> None:
        self.num_groups = num_groups
        self.device = device
        self.tables = torch.zeros(num_groups, MIN_ROWS, MIN_WIDTH, dtype=torch.int32, device=device)  # [G, R, W]
        self._row: dict[int, int] = {}  # id(request) -> row
        self._owner: list[object | None] = [None] * MIN_ROWS
        self._synced: list[list[tuple[list[int] | None, int]]] = [[(None, 0)] * num_groups for _ in range(MIN_ROWS)]
        self._free = list(range(MIN_ROWS - 1, -1, -1))
        self.rows_written = 0  # whole-row syncs, for tests and profiles

    def group(self, g: int) -> torch.Tensor:
        """Group `g`'s table `[rows, width]` (int32), valid for the rows of the last `sync`."""
        return self.tables[g]

    def row_of(self, request) -> int:
        row = self._row.get(id(request))
        if row is None or self._owner[row] is not request:  # NOTE: a recycled id()
            if not self._free:
                self._grow_rows()
            row = self._free.pop()
            self._row[id(request)] = row
            self._owner[row] = request
            self._synced[row] = [(None, 0)] * self.num_groups
        return row

    def release(self, request) -> None:
        """The request is final: its row is free for another."""
        row = self._row.pop(id(request), None)
        if row is not None and self._owner[row] is request:
            self._owner[row] = None
            self._synced[row] = [(None, 0)] * self.num_groups
            self._free.append(row)

    def sync(self, requests: list, tables: list[list[list[int]]]) -> list[int]:
        """Bring the rows of `requests` (with `tables[i][g]`, their lists) up to date; returns their rows."""
        of, owner = self._row, self._owner
        rows = []
        for r in requests:
            row = of.get(id(r))
            rows.append(row if row is not None and owner[row] is r else self.row_of(r))
        width = max((len(t) for ts in tables for t in ts), default=0)
        if width > self.tables.shape[2]:
            self._grow_width(width)
        at: list[int] = []  # flat index (g, row, col) of each entry written
        values: list[int] = []
        stride_g, stride_r = self.tables.shape[1] * self.tables.shape[2], self.tables.shape[2]
        for row, ts in zip(rows, tables, strict=True):
            synced = self._synced[row]
            for g, t in enumerate(ts):
                obj, n = synced[g]
                if obj is t and len(t) == n:
                    continue
                if obj is not t:  # NOTE: a new list: the whole row
                    n = 0
                    self.rows_written += 1
                if len(t) > n:
                    base = g * stride_g + row * stride_r
                    at.extend(range(base + n, base + len(t)))
                    values.extend(t[n:])
                synced[g] = (t, len(t))
        if at:
            flat = self.tables.view(-1)
            flat[torch.tensor(at, device=self.device)] = torch.tensor(values, dtype=torch.int32, device=self.device)
        return rows

    def _grow_rows(self) -> None:
        old = self.tables.shape[1]
        new = torch.zeros(self.num_groups, 2 * old, self.tables.shape[2], dtype=torch.int32, device=self.device)
        new[:, :old] = self.tables
        self.tables = new
        self._owner += [None] * old
        self._synced += [[(None, 0)] * self.num_groups for _ in range(old)]
        self._free = list(range(2 * old - 1, old - 1, -1)) + self._free

    def _grow_width(self, width: int) -> None:
        old = self.tables.shape[2]
        new_width = max(width, 2 * old)
        new = torch.zeros(self.num_groups, self.tables.shape[1], new_width, dtype=torch.int32, device=self.device)
        new[:, :, :old] = self.tables
        self.tables = new
