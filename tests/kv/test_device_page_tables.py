"""The persistent block table (rollout/kv/device_page_tables.py): rows follow the scheduler's lists incrementally.

Engine-level exactness with it (every architecture, sliding windows, preemption, prefix sharing) is in
test_correctness.py, test_cpu_kernels.py and test_prefix_cache.py; here the bookkeeping itself.
"""

from __future__ import annotations

import torch

from rollout.kv.device_page_tables import MIN_ROWS, MIN_WIDTH, DevicePageTables


class Req:
    """A stand-in request (the table keys rows by object)."""


def rows_of(bt: DevicePageTables, reqs, tables):
    """Sync `tables[i][g]` (request i's list of group g) and read the rows back in that layout."""
    rows = bt.sync(reqs, [list(col) for col in zip(*tables, strict=True)])
    return [[bt.group(g)[r, : len(t)].tolist() for g, t in enumerate(ts)] for r, ts in zip(rows, tables, strict=True)]


def test_rows_follow_appends_new_lists_and_release():
    bt = DevicePageTables(2, torch.device("cpu"))
    a, b = Req(), Req()
    ta, tb = [[3, 4], [7]], [[9], [1, 2, 5]]
    assert rows_of(bt, [a, b], [ta, tb]) == [ta, tb]
    assert bt.group(0).dtype == torch.int32
    written = bt.rows_written
    ta[0].append(11)  # NOTE: an appended page: only it is written
    assert rows_of(bt, [a, b], [ta, tb]) == [ta, tb]
    assert bt.rows_written == written
    ta[1] = [8, 6, 4]  # NOTE: a new list object (fork, preemption): the whole row
    assert rows_of(bt, [a], [ta]) == [ta]
    assert bt.rows_written == written + 1
    row_a = bt.row_of(a)
    bt.release(a)
    c = Req()
    assert bt.row_of(c) == row_a  # NOTE: a freed row is reused
    assert rows_of(bt, [c, b], [[[5], [6]], tb]) == [[[5], [6]], tb]


def test_rows_and_width_grow_keeping_contents():
    bt = DevicePageTables(1, torch.device("cpu"))
    reqs = [Req() for _ in range(MIN_ROWS + 5)]
    tables = [[[i, i + 1]] for i in range(len(reqs))]
    assert rows_of(bt, reqs, tables) == tables
    long = [list(range(MIN_WIDTH * 3))]
    tables[0] = long
    assert rows_of(bt, reqs, tables) == tables
    assert bt.group(0).shape[0] >= len(reqs) and bt.group(0).shape[1] >= len(long[0])
