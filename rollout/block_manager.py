"""Paged KV block pool with ref counts, an LRU free queue and prefix caching. Pure Python: no torch.

A page holds `page_size` consecutive tokens of one sequence. A *full* page is identified by a chained
hash of (hash of the previous page, its tokens), so two requests with the same prefix produce the
same hashes and can share the pages. The hash is a 128-bit BLAKE2b of the token bytes (as vLLM
keys its prefix cache with SHA-256): a hit is taken without comparing tokens, so a collision must
be out of reach (Python's 64-bit `hash()` of a tuple is not). Freed pages keep their hash and stay reusable until the pool
needs them again; they are then evicted in LRU order (least recently freed first).
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Sequence

ROOT_HASH = b"rollout-prefix-root"
HASH_BYTES = 16


def page_hashes(token_ids: Sequence[int], page_size: int, num_pages: int, start: int = 0,
                parent: bytes = ROOT_HASH) -> list[bytes]:
    """Chained hashes of pages `start .. start+num_pages-1` (all full), continuing from `parent`:
    BLAKE2b-128 of (parent hash, the page's tokens as int64 bytes)."""
    hashes: list[bytes] = []
    for p in range(start, start + num_pages):
        h = hashlib.blake2b(parent, digest_size=HASH_BYTES)
        h.update(array("q", token_ids[p * page_size : (p + 1) * page_size]).tobytes())
        parent = h.digest()
        hashes.append(parent)
    return hashes


class BlockManager:
    """Owns the pool of `num_blocks` pages.

    Invariants (checked by `check_invariants`, used in tests):
      - a block is in the free queue iff its ref count is 0;
      - `cached[h] == b` iff `block_hash[b] == h`.
    """

    def __init__(self, num_blocks: int, page_size: int, enable_prefix_caching: bool = True) -> None:
        if num_blocks < 1 or page_size < 1:
            raise ValueError("num_blocks and page_size must be positive")
        self.num_blocks = num_blocks
        self.page_size = page_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_counts = [0] * num_blocks
        self.block_hash: list[bytes | None] = [None] * num_blocks
        self.cached: dict[bytes, int] = {}  # page hash -> block id
        # NOTE: front = next to reuse; freed blocks go to the back (LRU eviction of cached pages).
        self.free_queue: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))

    # ---------------------------------------------------------------- queries
    @property
    def num_free_blocks(self) -> int:
        """Blocks not held by any request (cached-but-unreferenced pages count as free)."""
        return len(self.free_queue)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    # ------------------------------------------------------------ allocation
    def allocate(self, n: int) -> list[int]:
        """Take `n` blocks from the front of the free queue (evicting their cached hashes)."""
        if n > len(self.free_queue):
            raise MemoryError(f"need {n} blocks, only {len(self.free_queue)} free")
        out = []
        for _ in range(n):
            block, _ = self.free_queue.popitem(last=False)
            self._evict_hash(block)
            self.ref_counts[block] = 1
            out.append(block)
        return out

    def free(self, block_ids: Sequence[int]) -> None:
        """Drop one reference to each block. Tail pages are queued first so they are evicted first."""
        for block in reversed(block_ids):
            self.ref_counts[block] -= 1
            if self.ref_counts[block] < 0:
                raise RuntimeError(f"block {block} freed more often than allocated")
            if self.ref_counts[block] == 0:
                self.free_queue[block] = None

    def fork(self, block_ids: Sequence[int]) -> None:
        """Add a reference to blocks already held (sharing without a hash lookup)."""
        for block in block_ids:
            if self.ref_counts[block] == 0:
                del self.free_queue[block]
            self.ref_counts[block] += 1

    # --------------------------------------------------------- prefix cache
    def match_prefix(self, hashes: Sequence[bytes]) -> list[int]:
        """Longest run of cached pages for `hashes`; takes a reference to each hit block."""
        if not self.enable_prefix_caching:
            return []
        hits: list[int] = []
        for h in hashes:
            block = self.cached.get(h)
            if block is None:
                break
            hits.append(block)
        self.fork(hits)
        return hits

    def peek_prefix(self, hashes: Sequence[bytes]) -> int:
        """How many leading pages of `hashes` are cached (no references taken)."""
        if not self.enable_prefix_caching:
            return 0
        n = 0
        for h in hashes:
            if h not in self.cached:
                break
            n += 1
        return n

    def num_unreferenced(self, hashes: Sequence[bytes]) -> int:
        """How many cached pages of `hashes` nobody holds: a hit on them takes them off the free queue."""
        return sum(1 for h in hashes if self.ref_counts[self.cached[h]] == 0)

    def cache_page(self, block: int, page_hash: bytes) -> None:
        """Register a full, computed page under its hash (first writer wins)."""
        if not self.enable_prefix_caching or self.block_hash[block] is not None:
            return
        if page_hash in self.cached:
            return
        self.block_hash[block] = page_hash
        self.cached[page_hash] = block

    def reset_prefix_cache(self) -> int:
        """Forget every cached page (e.g. after a weight update). Returns how many were dropped."""
        dropped = len(self.cached)
        self.cached.clear()
        self.block_hash = [None] * self.num_blocks
        return dropped

    def _evict_hash(self, block: int) -> None:
        h = self.block_hash[block]
        if h is not None:
            self.block_hash[block] = None
            if self.cached.get(h) == block:
                del self.cached[h]

    def check_invariants(self) -> None:
        for b in range(self.num_blocks):
            assert (self.ref_counts[b] == 0) == (b in self.free_queue), f"block {b} free-queue mismatch"
            assert self.ref_counts[b] >= 0
            h = self.block_hash[b]
            if h is not None:
                assert self.cached.get(h) == b, f"block {b} hash not in cache map"
        for h, b in self.cached.items():
            assert self.block_hash[b] == h


# ------------------------------------------------------------------ layer groups
# NOTE: a model's layers fall into groups by attention window (full attention, or one sliding
# window). Each group keeps its own block table per request over the one shared pool; all tables of
# a request have the same logical length (one entry per `page_size` tokens), and an entry of a
# sliding table whose page the window can no longer see is recycled and set to FREED.
FREED = -1


class FullAttentionAllocator:
    """Block tables of full-attention layers: every page of the sequence is kept.

    Args:
        pool: the shared page pool.
    """

    window: int | None = None

    def __init__(self, pool: BlockManager) -> None:
        self.pool = pool
        self.page_size = pool.page_size

    def first_live_page(self, num_computed: int) -> int:
        """First logical page that a query at position >= `num_computed` can still read."""
        return 0

    def max_pages(self, num_tokens: int) -> int:
        """Most pages a table of a `num_tokens`-token request holds at once (with 1-token steps)."""
        return self.pool.blocks_needed(num_tokens)

    def grow(self, table: list[int], num_tokens: int) -> None:
        """Extend `table` in place with fresh pages until it covers `num_tokens` tokens."""
        need = self.pool.blocks_needed(num_tokens) - len(table)
        if need > 0:
            table += self.pool.allocate(need)

    def recycle(self, table: list[int], num_computed: int) -> list[int]:
        """Release the pages no future query can see; returns their ids (none for full attention)."""
        return []


class SlidingWindowAllocator(FullAttentionAllocator):
    """Block tables of sliding-window layers: only the pages the window can still see are held.

    A query at position i reads keys j with i - window < j <= i (Hugging Face's convention), so once
    `num_computed` tokens exist, page p is dead when its last token (p+1)*page_size - 1 is
    <= num_computed - window.

    Args:
        pool: the shared page pool.
        window: the layers' `sliding_window`.
    """

    def __init__(self, pool: BlockManager, window: int) -> None:
        super().__init__(pool)
        if window < 1:
            raise ValueError(f"sliding window must be >= 1, got {window}")
        self.window = window

    def first_live_page(self, num_computed: int) -> int:
        return max(0, num_computed - self.window + 1) // self.page_size

    def max_pages(self, num_tokens: int) -> int:
        # NOTE: one query plus its window - 1 past keys span at most ceil((window-1)/ps) + 1 pages.
        return min(self.pool.blocks_needed(num_tokens), -(-(self.window - 1) // self.page_size) + 1)

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


def make_allocators(pool: BlockManager, windows: Sequence[int | None]) -> list[FullAttentionAllocator]:
    """One allocator per layer group, in the order of `windows` (None = full attention)."""
    return [FullAttentionAllocator(pool) if w is None else SlidingWindowAllocator(pool, w) for w in windows]


class BlockTables:
    """Every layer group's block table of every live request, over one shared pool.

    Group 0's table is the request's own `block_ids` (so a model with one full-attention group is
    exactly the single-table case); the other groups' tables are kept here, keyed by request. All
    tables of a request have the same logical length, so growing to `n` tokens costs
    `num_groups * (pages(n) - length)` pages.

    Args:
        pool: the shared page pool.
        windows: the attention window of each group (None = full attention).
    """

    def __init__(self, pool: BlockManager, windows: Sequence[int | None] = (None,)) -> None:
        self.pool = pool
        self.allocators = make_allocators(pool, windows)
        self.num_groups = len(self.allocators)
        self.sliding = any(a.window is not None for a in self.allocators)
        self._more: dict[object, list[list[int]]] = {}  # request -> tables of groups 1..

    def of(self, req) -> list[list[int]]:
        """The request's table of every group (the lists themselves: mutate only through this class)."""
        if self.num_groups == 1:
            return [req.block_ids]
        more = self._more.get(req)
        if more is None:
            more = self._more[req] = [[] for _ in self.allocators[1:]]
        return [req.block_ids, *more]

    def max_pages(self, num_tokens: int) -> int:
        """Most pages one request of `num_tokens` tokens ever holds at once (1-token steps)."""
        return sum(a.max_pages(num_tokens) for a in self.allocators)

    def growth(self, req, num_tokens: int) -> int:
        """Pages `grow(req, num_tokens)` takes from the pool."""
        return self.num_groups * max(0, self.pool.blocks_needed(num_tokens) - len(req.block_ids))

    def footprint(self, computed: int, num_tokens: int) -> int:
        """Pages held by a request with `computed` tokens (recycled) once it covers `num_tokens`."""
        pages = self.pool.blocks_needed(num_tokens)
        return sum(pages - a.first_live_page(computed) for a in self.allocators)

    def fit(self, start: int, n: int) -> int:
        """Largest chunk <= n (and >= 1) whose footprint still fits in the whole pool.

        Only binds for sliding windows (a full-attention request that fits was checked at
        submission): a long prompt chunk needs pages for all its tokens until the step has run."""
        recycled = sum(a.first_live_page(start) for a in self.allocators)
        max_pages = (self.pool.num_blocks + recycled) // self.num_groups
        return max(1, min(n, max_pages * self.pool.page_size - start))

    def grow(self, req, num_tokens: int) -> None:
        for alloc, table in zip(self.allocators, self.of(req), strict=True):
            alloc.grow(table, num_tokens)

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
        req.block_ids = []
        self._more.pop(req, None)

    def live_pages(self, req) -> list[int]:
        """The pages holding computed KV some future query of `req` reads, group after group."""
        computed = req.num_computed_tokens
        end = self.pool.blocks_needed(computed)
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
            table += self.pool.allocate(self.pool.blocks_needed(num_tokens) - first)
        return self.live_pages(req)
