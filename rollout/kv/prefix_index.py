"""`PrefixIndex`: where a new request can find its prompt's KV without computing it.

Three places, checked by the scheduler at admission: full pages in the page pool's prefix cache (by
chained page hash, `rollout.kv.page_pool`); pages another running request is computing right now (*in
flight*: the newcomer waits a step and then reads them from the cache); and a running request with the
identical prompt (its *leader*, whose KV a fork shares). So a GRPO group's prompt is prefilled once,
whatever the page size. Each request's page hashes are memoised on the request. Pure Python: no torch.

With several layer groups (sliding windows beside full attention, as Gemma 2; or every layer sliding,
as Mistral) each group caches its own pages under its own key (`group_key`), and a hit of `k` pages needs,
in every group, the pages its first query can still see: all `k` for full attention, only the last
window's for a sliding group (the earlier ones it recycled are never read). So a multi-turn episode on a
sliding-window model recomputes only its new turn, as on any other.
"""

from __future__ import annotations

from rollout.kv.page_pool import ROOT_HASH, PagePool, page_hashes
from rollout.kv.page_tables import FREED, PageTables
from rollout.requests import Request


def group_key(page_hash: bytes, group: int) -> bytes:
    """The prefix-cache key of a page of layer group `group` (each group's pages hold other layers' KV)."""
    return page_hash if group == 0 else page_hash + group.to_bytes(2, "little")


def prompt_key(req: Request) -> tuple:
    """What identical prompts share to fork one another's KV: the tokens and the cache salt (a LoRA adapter)."""
    return req.cache_salt, tuple(req.prompt_ids)


class PrefixIndex:
    """Args: pool: the page pool (its prefix cache); fork_prompts: let identical prompts fork a leader."""

    def __init__(self, pool: PagePool, fork_prompts: bool = True) -> None:
        self.pool = pool
        self.page_size = pool.page_size
        self.fork_enabled = fork_prompts
        self.inflight: dict[bytes, Request] = {}  # hash of a prompt page being computed -> who computes it
        self.leaders: dict[tuple, Request] = {}  # prompt -> the running request others fork

    def hashes(self, req: Request, num_pages: int) -> list[bytes]:
        """The request's first `num_pages` page hashes, extending its memo as tokens become known."""
        known = len(req.page_hashes)
        if num_pages > known:
            parent = req.page_hashes[-1] if known else ROOT_HASH + req.cache_salt
            req.page_hashes += page_hashes(req.token_ids, self.page_size, num_pages - known, known, parent)
        return req.page_hashes[:num_pages]

    def prefix_hashes(self, req: Request) -> list[bytes]:
        """Hashes of the full pages a new request could read from the cache (never its last token, nor a
        position whose logits it scores)."""
        if not self.pool.enable_prefix_caching:
            return []
        return self.hashes(req, req.max_reused_tokens // self.page_size)

    def peek(self, hashes: list[bytes], tables: PageTables) -> tuple[int, list[list[bytes]]]:
        """The longest prefix of `hashes` (full pages) every layer group can serve from the cache, and per
        group the keys of the pages to take (none are referenced yet)."""
        groups = tables.allocators
        if len(groups) == 1 and groups[0].window is None:  # NOTE: the common case: one full-attention run
            hit = self.pool.peek_prefix(hashes)
            return hit, [hashes[:hit]]
        cached = self.pool.cached
        hit = len(hashes)
        for g, alloc in enumerate(groups):  # NOTE: full-attention groups need every page: their run bounds k
            if alloc.window is None:
                hit = next((p for p in range(hit) if group_key(hashes[p], g) not in cached), hit)
        for k in range(hit, 0, -1):
            keys = [[group_key(hashes[p], g) for p in range(a.first_live_page(k * self.page_size), k)]
                    for g, a in enumerate(groups)]
            if all(key in cached for group in keys for key in group):
                return k, keys
        return 0, [[] for _ in groups]

    def take(self, req: Request, hit: int, keys: list[list[bytes]], tables: PageTables) -> None:
        """Give `req` (holding no pages) the cached pages `peek` found: each group's table becomes FREED up
        to its first live page, then the hits (a reference taken on each)."""
        own = tables.of(req)
        for g, (alloc, group_keys) in enumerate(zip(tables.allocators, keys, strict=True)):
            pages = self.pool.match_prefix(group_keys)
            assert len(pages) == len(group_keys), "a cached page vanished between peek and take"
            table = [FREED] * alloc.first_live_page(hit * self.page_size) + pages
            if g == 0:
                req.page_ids = table
            else:
                own[g][:] = table

    def admitted(self, req: Request, hashes: list[bytes]) -> None:
        """`req` now runs: the pages of `hashes` it will compute are in flight, and it leads its prompt."""
        for h in hashes[req.num_computed_tokens // self.page_size :]:
            self.inflight.setdefault(h, req)
        if self.fork_enabled and req.num_preemptions == 0 and req.num_prompt_tokens > 1:
            self.leaders.setdefault(prompt_key(req), req)

    def leader_of(self, req: Request) -> Request | None:
        """The running request with `req`'s prompt that `req` could fork (None without one, or forking off)."""
        if not self.fork_enabled:
            return None
        leader = self.leaders.get(prompt_key(req))
        return None if leader is req else leader

    def cache_full_pages(self, req: Request, tables: list[list[int]]) -> None:
        """Offer the pages `req` filled since the last call to the prefix cache, in every layer group
        (`tables`: the request's table of each group); none once its KV is stale."""
        if not self.pool.enable_prefix_caching or req.stale_kv:
            return
        full = req.num_computed_tokens // self.page_size
        if full == req.num_registered_pages:  # NOTE: no page filled up this step
            return
        hashes = self.hashes(req, full)
        for p in range(req.num_registered_pages, full):
            for g, table in enumerate(tables):
                if table[p] != FREED:  # NOTE: cached before the window recycles it (after_step's order)
                    self.pool.cache_page(table[p], group_key(hashes[p], g))
            if self.inflight.get(hashes[p]) is req:
                del self.inflight[hashes[p]]
        req.num_registered_pages = full

    def drop(self, req: Request) -> None:
        """`req` no longer runs: it computes nothing in flight and leads nothing."""
        for h in [h for h, r in self.inflight.items() if r is req]:
            del self.inflight[h]
        if self.leaders.get(key := prompt_key(req)) is req:
            del self.leaders[key]

    def forget(self) -> None:
        """KV computed so far is stale (new weights): nobody may read it through a fork or the in-flight map."""
        self.inflight.clear()
        self.leaders.clear()
