"""Per-request page tables: which pages of the pool hold each live request's KV, one table per layer group.

A model's layers fall into groups by attention window (full attention, or one sliding window). Each
group keeps its own page table per request over the one shared `PagePool`; all tables of a request
have the same logical length (one entry per `page_size` tokens), and an entry of a sliding table whose
page the window can no longer see is recycled and set to `FREED`. Pure Python: no torch.
"""

from __future__ import annotations

from collections.abc import Sequence

from rollout.kv.page_pool import PagePool

FREED = -1


class FullAttentionAllocator:
    """Page tables of full-attention layers: every page of the sequence is kept.

    Args:
        pool: the shared page pool.
    """

    window: int | None = None

    def __init__(self, pool: PagePool) -> None:
        self.pool = pool
        self.page_size = pool.page_size

    def first_live_page(self, num_computed: int) -> int:
        """First logical page that a query at position >= `num_computed` can still read."""
        return 0

    def max_pages(self, num_tokens: int) -> int:
        """Most pages a table of a `num_tokens`-token request holds at once (with 1-token steps)."""
        return self.pool.pages_needed(num_tokens)

    def grow(self, table: list[int], num_tokens: int) -> None:
        """Extend `table` in place with fresh pages until it covers `num_tokens` tokens."""
        need = self.pool.pages_needed(num_tokens) - len(table)
        if need > 0:
            table += self.pool.allocate(need)

    def recycle(self, table: list[int], num_computed: int) -> list[int]:
        """Release the pages no future query can see; returns their ids (none for full attention)."""
        return []


class SlidingWindowAllocator(FullAttentionAllocator):
    """Page tables of sliding-window layers: only the pages the window can still see are held.

    A query at position i reads keys j with i - window < j <= i (Hugging Face's convention), so once
    `num_computed` tokens exist, page p is dead when its last token (p+1)*page_size - 1 is
    <= num_computed - window.

    Args:
        pool: the shared page pool.
        window: the layers' `sliding_window`.
    """

    def __init__(self, pool: PagePool, window: int) -> None:
        super().__init__(pool)
        if window < 1:
            raise ValueError(f"sliding window must be >= 1, got {window}")
        self.window = window

    def first_live_page(self, num_computed: int) -> int:
        return max(0, num_computed - self.window + 1) // self.page_size

    def max_pages(self, num_tokens: int) -> int:
        # NOTE: one query plus its window - 1 past keys span at most ceil((window-1)/ps) + 1 pages.
        return min(self.pool.pages_needed(num_tokens), -(-(self.window - 1) // self.page_size) + 1)

    def recycle(self, table: list[int], num_computed: int) -> list[int]:
        # NOTE: dead pages are a prefix of the table and already-recycled ones a prefix of that, so
        # walking back from the first live page stops at the first FREED entry: O(pages recycled).
        dead: list[int] = []
        p = min(self.first_live_page(num_computed), len(table)) - 1
        while p >= 0 and table[p] != FREED:
            dead.append(table[p])
            table[p] = FREED
            p -= 1
        dead.reverse()
        if dead:
            self.pool.free(dead)
        return dead


def make_allocators(pool: PagePool, windows: Sequence[int | None]) -> list[FullAttentionAllocator]:
    """One allocator per layer group, in the order of `windows` (None = full attention)."""
    return [FullAttentionAllocator(pool) if w is None else SlidingWindowAllocator(pool, w) for w in windows]


class PageTables:
    """Every layer group's page table of every live request, over one shared pool.

    Group 0's table is the request's own `page_ids` (so a model with one full-attention group is
    exactly the single-table case); the other groups' tables are kept here, keyed by request. All
    tables of a request have the same logical length, so growing to `n` tokens costs
    `num_groups * (pages(n) - length)` pages.

    Args:
        pool: the shared page pool.
        windows: the attention window of each group (None = full attention).
    """

    def __init__(self, pool: PagePool, windows: Sequence[int | None] = (None,)) -> None:
        self.pool = pool
        self.allocators = make_allocators(pool, windows)
        self.num_groups = len(self.allocators)
        self.sliding = any(a.window is not None for a in self.allocators)
        self._more: dict[object, list[list[int]]] = {}  # request -> tables of groups 1..

    def of(self, req) -> list[list[int]]:
        """The request's table of every group (the lists themselves: mutate only through this class)."""
        if self.num_groups == 1:
            return [req.page_ids]
        more = self._more.get(req)
        if more is None:
            more = self._more[req] = [[] for _ in self.allocators[1:]]
        return [req.page_ids, *more]

    def max_pages(self, num_tokens: int) -> int:
        """Most pages one request of `num_tokens` tokens ever holds at once (1-token steps)."""
        return sum(a.max_pages(num_tokens) for a in self.allocators)

    def growth(self, req, num_tokens: int) -> int:
        """Pages `grow(req, num_tokens)` takes from the pool."""
        return self.num_groups * max(0, self.pool.pages_needed(num_tokens) - len(req.page_ids))

    def footprint(self, computed: int, num_tokens: int) -> int:
        """Pages held by a request with `computed` tokens (recycled) once it covers `num_tokens`."""
        pages = self.pool.pages_needed(num_tokens)
        return sum(pages - a.first_live_page(computed) for a in self.allocators)

    def fit(self, start: int, n: int) -> int:
        """Largest chunk <= n (and >= 1) whose footprint still fits in the whole pool.

        Only binds for sliding windows (a full-attention request that fits was checked at
        submission): a long prompt chunk needs pages for all its tokens until the step has run."""
        recycled = sum(a.first_live_page(start) for a in self.allocators)
        max_pages = (self.pool.num_pages + recycled) // self.num_groups
        return max(1, min(n, max_pages * self.pool.page_size - start))

    def grow(self, req, num_tokens: int) -> None:
        for alloc, table in zip(self.allocators, self.of(req), strict=True):
            alloc.grow(table, num_tokens)

    def truncate(self, req, num_tokens: int) -> int:
        """Give back the pages past the first `num_tokens` tokens (a speculative step's rejected tail); returns
        how many. Each shortened table is a new list, so `DevicePageTables.sync` rewrites its row."""
        keep, freed = self.pool.pages_needed(num_tokens), 0
        if len(req.page_ids) <= keep:
            return 0
        tables = self.of(req)
        for i, table in enumerate(tables):
            tail = [b for b in table[keep:] if b != FREED]
            if tail:
                self.pool.free(tail)
            freed += len(tail)
            if i == 0:
                req.page_ids = table[:keep]
            else:
                self._more[req][i - 1] = table[:keep]
        return freed

    def recycle(self, req) -> int:
        """Release the pages no future query of `req` can see; returns how many."""
        if not self.sliding:
            return 0
        tables = self.of(req)
        return sum(len(a.recycle(t, req.num_computed_tokens)) for a, t in zip(self.allocators, tables, strict=True))

    def free(self, req) -> None:
        """Give back every page `req` holds and forget its tables."""
        for table in self.of(req):
            live = [b for b in table if b != FREED]
            if live:
                self.pool.free(live)
        req.page_ids = []
        self._more.pop(req, None)
        if req.fork_alias is not None:  # NOTE: the pages its partial page was copied from (Request.fork_alias)
            self.pool.free(req.fork_alias[1])
            req.fork_alias = None

    def live_pages(self, req) -> list[int]:
        """The pages holding computed KV some future query of `req` reads, group after group."""
        computed = req.num_computed_tokens
        end = self.pool.pages_needed(computed)
        tables = self.of(req)
        pages = [b for a, t in zip(self.allocators, tables, strict=True) for b in t[a.first_live_page(computed) : end]]
        assert FREED not in pages, "a live page was recycled"
        return pages

    def rebuild(self, req, num_tokens: int) -> list[int]:
        """Fresh tables for a request readmitted with `num_computed_tokens` kept (its KV restored
        from elsewhere), covering `num_tokens`; returns its live pages in `live_pages` order."""
        for alloc, table in zip(self.allocators, self.of(req), strict=True):
            first = alloc.first_live_page(req.num_computed_tokens)
            table += [FREED] * first
            table += self.pool.allocate(self.pool.pages_needed(num_tokens) - first)
        return self.live_pages(req)
