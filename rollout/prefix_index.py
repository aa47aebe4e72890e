"""`PrefixIndex`: where a new request can find its prompt's KV without computing it.

Three places, checked by the scheduler at admission: full pages in the page pool's prefix cache (by
chained page hash, `rollout.page_pool`); pages another running request is computing right now (*in
flight*: the newcomer waits a step and then reads them from the cache); and a running request with the
identical prompt (its *leader*, whose KV a fork shares). So a GRPO group's prompt is prefilled once,
whatever the page size. Each request's page hashes are memoised on the request. Pure Python: no torch.
"""

from __future__ import annotations

from .page_pool import ROOT_HASH, PagePool, page_hashes
from .requests import Request


class PrefixIndex:
    """Args: pool: the page pool (its prefix cache); fork_prompts: let identical prompts fork a leader."""

    def __init__(self, pool: PagePool, fork_prompts: bool = True) -> None:
        self.pool = pool
        self.page_size = pool.page_size
        self.fork_enabled = fork_prompts
        self.inflight: dict[bytes, Request] = {}  # hash of a prompt page being computed -> who computes it
        self.leaders: dict[tuple[int, ...], Request] = {}  # prompt -> the running request others fork

    def hashes(self, req: Request, num_pages: int) -> list[bytes]:
        """The request's first `num_pages` page hashes, extending its memo as tokens become known."""
        known = len(req.page_hashes)
        if num_pages > known:
            parent = req.page_hashes[-1] if known else ROOT_HASH
            req.page_hashes += page_hashes(req.token_ids, self.page_size, num_pages - known, known, parent)
        return req.page_hashes[:num_pages]

    def prefix_hashes(self, req: Request) -> list[bytes]:
        """Hashes of the full pages a new request could read from the cache (never its last token, nor a
        position whose logits it scores)."""
        if not self.pool.enable_prefix_caching:
            return []
        return self.hashes(req, req.max_reused_tokens // self.page_size)

    def admitted(self, req: Request, hashes: list[bytes]) -> None:
        """`req` now runs: the pages of `hashes` it will compute are in flight, and it leads its prompt."""
        for h in hashes[req.num_computed_tokens // self.page_size :]:
            self.inflight.setdefault(h, req)
        if self.fork_enabled and req.num_preemptions == 0 and req.num_prompt_tokens > 1:
            self.leaders.setdefault(tuple(req.prompt_ids), req)

    def leader_of(self, req: Request) -> Request | None:
        """The running request with `req`'s prompt that `req` could fork (None without one, or forking off)."""
        if not self.fork_enabled:
            return None
        leader = self.leaders.get(tuple(req.prompt_ids))
        return None if leader is req else leader

    def cache_full_pages(self, req: Request) -> None:
        """Offer the pages `req` filled since the last call to the prefix cache (none once its KV is stale)."""
        if not self.pool.enable_prefix_caching or req.stale_kv:
            return
        full = req.num_computed_tokens // self.page_size
        if full == req.num_registered_pages:  # NOTE: no page filled up this step
            return
        hashes = self.hashes(req, full)
        for p in range(req.num_registered_pages, full):
            self.pool.cache_page(req.page_ids[p], hashes[p])
            if self.inflight.get(hashes[p]) is req:
                del self.inflight[hashes[p]]
        req.num_registered_pages = full

    def drop(self, req: Request) -> None:
        """`req` no longer runs: it computes nothing in flight and leads nothing."""
        for h in [h for h, r in self.inflight.items() if r is req]:
            del self.inflight[h]
        if self.leaders.get(key := tuple(req.prompt_ids)) is req:
            del self.leaders[key]

    def forget(self) -> None:
        """KV computed so far is stale (new weights): nobody may read it through a fork or the in-flight map."""
        self.inflight.clear()
        self.leaders.clear()
