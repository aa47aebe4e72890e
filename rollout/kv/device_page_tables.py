"""`DevicePageTables`: the page tables of the running requests as one persistent int32 tensor per layer group.

The scheduler keeps each request's page table as a Python list per layer group (`ScheduledRequest.tables`).
Turning those lists into a `[B, P]` tensor every step costs time in the number of pages (B x P Python
ints per group, ~25 ms at 512 requests x 4k tokens with 16-token pages). Here each request owns a row
of a `[rows, width]` int32 tensor per group, kept across steps (as vLLM's `DevicePageTables`); a step writes
only what changed: the pages appended since the last sync, or the whole row when the request's list
is another list object than the one synced (a fork, a preemption, a restore build new lists).

What a row may hold beyond the request's list is never read: attention reads positions below each
request's own length only, and page entries recycled by a sliding window (`FREED`) are outside it.
Rows are freed by `release` when a request is finalised.
"""

from __future__ import annotations

import torch

from rollout.tensors import int_tensor

MIN_ROWS = 16
MIN_WIDTH = 8


class DevicePageTables:
    """Args: num_groups: layer groups (one table each); device: where the tables live."""

    def __init__(self, num_groups: int, device: torch.device) -> None:
        self.num_groups = num_groups
        self.device = device
        self.tables = torch.zeros(num_groups, MIN_ROWS, MIN_WIDTH, dtype=torch.int32, device=device)  # [G, R, W]
        self._row: dict[object, int] = {}  # request -> row (keyed by the object: the dict keeps it alive)
        # NOTE: per group and row, the list last synced and its length then (None: nothing synced)
        self._lists: list[list[list[int] | None]] = [[None] * MIN_ROWS for _ in range(num_groups)]
        self._lens: list[list[int]] = [[0] * MIN_ROWS for _ in range(num_groups)]
        self._free = list(range(MIN_ROWS - 1, -1, -1))
        self.rows_written = 0  # whole-row syncs, for tests and profiles

    def group(self, g: int) -> torch.Tensor:
        """Group `g`'s table `[rows, width]` (int32), valid for the rows of the last `sync`."""
        return self.tables[g]

    def row_of(self, request) -> int:
        row = self._row.get(request)
        if row is None:
            if not self._free:
                self._grow_rows()
            row = self._row[request] = self._free.pop()
            self._forget(row)
        return row

    def release(self, request) -> None:
        """The request is final: its row is free for another."""
        row = self._row.pop(request, None)
        if row is not None:
            self._forget(row)
            self._free.append(row)

    def _forget(self, row: int) -> None:
        for g in range(self.num_groups):
            self._lists[g][row] = None
            self._lens[g][row] = 0

    def sync(self, requests: list, tables: list[list[list[int]]]) -> list[int]:
        """Bring the rows of `requests` up to date; `tables[g][i]` is request i's list of group g.

        Returns their rows. Costs one identity and one length check per request and group, plus the
        entries written: pages appended since the last sync, or the whole row for a new list object."""
        rows = list(map(self._row.get, requests))
        if None in rows:
            rows = [self.row_of(r) if row is None else row for r, row in zip(requests, rows, strict=True)]
        changed = []  # per group, the indices of the requests whose list moved since the last sync
        for g, ts in enumerate(tables):
            lists, lens = self._lists[g], self._lens[g]
            changed.append([i for i, (row, t) in enumerate(zip(rows, ts, strict=True))
                            if lists[row] is not t or lens[row] != len(t)])
        width = max((len(tables[g][i]) for g, idx in enumerate(changed) for i in idx), default=0)
        if width > self.tables.shape[2]:
            self._grow_width(width)
        at: list[int] = []  # flat index (g, row, col) of each entry written
        values: list[int] = []
        stride_g, stride_r = self.tables.shape[1] * self.tables.shape[2], self.tables.shape[2]
        for g, idx in enumerate(changed):
            lists, lens, ts = self._lists[g], self._lens[g], tables[g]
            for i in idx:
                row, t = rows[i], ts[i]
                n = lens[row]
                if lists[row] is not t:  # NOTE: a new list: the whole row
                    n = 0
                    self.rows_written += 1
                if len(t) > n:
                    base = g * stride_g + row * stride_r
                    at.extend(range(base + n, base + len(t)))
                    values.extend(t[n:])
                lists[row], lens[row] = t, len(t)
        if at:
            flat = self.tables.view(-1)
            flat[int_tensor(at, self.device)] = int_tensor(values, self.device, torch.int32)
        return rows

    def _grow_rows(self) -> None:
        old = self.tables.shape[1]
        new = torch.zeros(self.num_groups, 2 * old, self.tables.shape[2], dtype=torch.int32, device=self.device)
        new[:, :old] = self.tables
        self.tables = new
        for g in range(self.num_groups):
            self._lists[g] += [None] * old
            self._lens[g] += [0] * old
        self._free = list(range(2 * old - 1, old - 1, -1)) + self._free

    def _grow_width(self, width: int) -> None:
        old = self.tables.shape[2]
        new_width = max(width, 2 * old)
        new = torch.zeros(self.num_groups, self.tables.shape[1], new_width, dtype=torch.int32, device=self.device)
        new[:, :, :old] = self.tables
        self.tables = new
