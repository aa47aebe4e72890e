"""Paged KV page pool with ref counts, an LRU free queue and prefix caching. Pure Python: no torch.

A page holds `page_size` consecutive tokens of one sequence. A *full* page is identified by a chained
hash of (hash of the previous page, its tokens), so two requests with the same prefix produce the
same hashes and can share the pages. The hash is a 128-bit BLAKE2b of the token bytes (as vLLM
keys its prefix cache with SHA-256): a hit is taken without comparing tokens, so a collision must
be out of reach (Python's 64-bit `hash()` of a tuple is not). Freed pages keep their hash and stay reusable until the
pool needs them again; they are then evicted in LRU order (least recently freed first).
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


class PagePool:
    """Owns the pool of `num_pages` pages.

    Invariants (checked by `check_invariants`, used in tests):
      - a page is in the free queue iff its ref count is 0;
      - `cached[h] == b` iff `page_hash[b] == h`.
    """

    def __init__(self, num_pages: int, page_size: int, enable_prefix_caching: bool = True) -> None:
        if num_pages < 1 or page_size < 1:
            raise ValueError("num_pages and page_size must be positive")
        self.num_pages = num_pages
        self.page_size = page_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_counts = [0] * num_pages
        self.page_hash: list[bytes | None] = [None] * num_pages
        self.cached: dict[bytes, int] = {}  # page hash -> page id
        # NOTE: front = next to reuse; freed pages go to the back (LRU eviction of cached pages).
        self.free_queue: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_pages))

    # ---------------------------------------------------------------- queries
    @property
    def num_free_pages(self) -> int:
        """Pages not held by any request (cached-but-unreferenced pages count as free)."""
        return len(self.free_queue)

    def pages_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    # ------------------------------------------------------------ allocation
    def allocate(self, n: int) -> list[int]:
        """Take `n` pages from the front of the free queue (evicting their cached hashes)."""
        if n > len(self.free_queue):
            raise MemoryError(f"need {n} pages, only {len(self.free_queue)} free")
        out = []
        for _ in range(n):
            page, _ = self.free_queue.popitem(last=False)
            self._evict_hash(page)
            self.ref_counts[page] = 1
            out.append(page)
        return out

    def free(self, page_ids: Sequence[int]) -> None:
        """Drop one reference to each page. Tail pages are queued first so they are evicted first."""
        for page in reversed(page_ids):
            self.ref_counts[page] -= 1
            if self.ref_counts[page] < 0:
                raise RuntimeError(f"page {page} freed more often than allocated")
            if self.ref_counts[page] == 0:
                self.free_queue[page] = None

    def fork(self, page_ids: Sequence[int]) -> None:
        """Add a reference to pages already held (sharing without a hash lookup)."""
        for page in page_ids:
            if self.ref_counts[page] == 0:
                del self.free_queue[page]
            self.ref_counts[page] += 1

    # --------------------------------------------------------- prefix cache
    def match_prefix(self, hashes: Sequence[bytes]) -> list[int]:
        """Longest run of cached pages for `hashes`; takes a reference to each hit page."""
        if not self.enable_prefix_caching:
            return []
        hits: list[int] = []
        for h in hashes:
            page = self.cached.get(h)
            if page is None:
                break
            hits.append(page)
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

    def cache_page(self, page: int, page_hash: bytes) -> None:
        """Register a full, computed page under its hash (first writer wins)."""
        if not self.enable_prefix_caching or self.page_hash[page] is not None:
            return
        if page_hash in self.cached:
            return
        self.page_hash[page] = page_hash
        self.cached[page_hash] = page

    def reset_prefix_cache(self) -> int:
        """Forget every cached page (e.g. after a weight update). Returns how many were dropped."""
        dropped = len(self.cached)
        self.cached.clear()
        self.page_hash = [None] * self.num_pages
        return dropped

    def _evict_hash(self, page: int) -> None:
        h = self.page_hash[page]
        if h is not None:
            self.page_hash[page] = None
            if self.cached.get(h) == page:
                del self.cached[h]

    def check_invariants(self) -> None:
        for b in range(self.num_pages):
            assert (self.ref_counts[b] == 0) == (b in self.free_queue), f"page {b} free-queue mismatch"
            assert self.ref_counts[b] >= 0
            h = self.page_hash[b]
            if h is not None:
                assert self.cached.get(h) == b, f"page {b} hash not in cache map"
        for h, b in self.cached.items():
            assert self.page_hash[b] == h
