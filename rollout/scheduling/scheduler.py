"""One-path token-budget scheduler. Pure Python: no torch.

There is no prefill phase and no decode phase: each request has `num_computed_tokens` catching up
with `num_tokens`. Every step hands out at most `max_batch_tokens` query tokens: a decode needs one,
a prompt takes what is left of the budget (chunked prefill), and a prefix-cache hit simply starts a
request with some tokens already computed.

Memory pressure: layers are grouped by attention window (full attention, or one sliding window), and
each group keeps its own page table per request over the one shared pool
(`page_tables.FullAttentionAllocator` / `SlidingWindowAllocator`); sliding tables recycle the pages
their window no longer sees after every step. When the pool runs dry the newest running request is
preempted: its live pages are parked in the CPU offload buffer if there is one and it has room (the
request later resumes where it was), else dropped and recomputed from its tokens.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence

from rollout.kv.page_pool import PagePool
from rollout.kv.page_tables import FREED, PageTables
from rollout.kv.prefix_index import PrefixIndex
from rollout.requests import Request, RequestStatus
from rollout.scheduling.stages import Offloader, ScheduledRequest, SchedulerOutput


class Scheduler:
    """Decides, each step, which requests run and how many of their tokens.

    Args:
        page_pool: the page pool.
        max_batch_tokens: query-token budget per step.
        max_requests_per_batch: cap on scheduled requests per step (None: no cap).
        policy: "fifo" (running requests first, then new ones) or "prefill_first" (requests still
            computing their prompt first, then decodes).
        safety_margin: share of the pool kept free for running requests; new requests wait while
            admitting them would leave less free (ignored when nothing runs, so nothing starves).
        fork_prompts: a request whose prompt equals a running request's forks that request's KV
            (single full-attention group only).
        windows: attention window of each layer group (None = full attention); group 0's table is
            `request.page_ids`, the others are kept here.
        offloader: where preempted requests park their pages (None: preemption recomputes).
        decode_fast_path: one pass when every running request decodes (off only to check it, in tests).
    """

    def __init__(
        self,
        page_pool: PagePool,
        max_batch_tokens: int,
        max_requests_per_batch: int | None = None,
        policy: str = "fifo",
        safety_margin: float = 0.0,
        fork_prompts: bool = True,
        windows: Sequence[int | None] = (None,),
        offloader: Offloader | None = None,
        decode_fast_path: bool = True,
    ) -> None:
        if policy not in _POLICIES:
            raise ValueError(f"scheduler_type must be one of {tuple(_POLICIES)}, got {policy!r}")
        self.pool = page_pool
        self.page_size = page_pool.page_size
        self.max_batch_tokens, self.max_requests = max_batch_tokens, max_requests_per_batch or 1 << 30
        self.policy = policy
        self.safety_pages = safety_margin * page_pool.num_pages
        self.tables = PageTables(page_pool, windows)
        self.offloader, self.decode_fast_path = offloader, decode_fast_path
        # NOTE: a fork shares the leader's full prompt pages in every layer group (a sliding group only
        # those still inside the fork's window); refcounts keep a shared page until nobody holds it.
        self.prefixes = PrefixIndex(page_pool, fork_prompts)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0
        self.num_cached_prompt_tokens = 0
        self.num_offloaded_pages = 0  # pages copied out to the offload buffer
        self.num_restored_pages = 0  # pages copied back
        self.num_offload_fallbacks = 0  # preemptions that recomputed because the buffer was full
        self.num_recycled_pages = 0  # pages released by sliding windows
        self.peak_used_pages = 0  # most pages held by requests at once

    def max_pages(self, num_tokens: int) -> int:
        """Most pages one request of `num_tokens` tokens ever needs at once (1-token steps)."""
        return self.tables.max_pages(num_tokens)

    # ----------------------------------------------------------------- queue
    def add(self, request: Request) -> None:
        request.status = RequestStatus.PENDING
        self.waiting.append(request)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def remove(self, request: Request) -> None:
        """Take a request out of the queues and release its pages (finish, cancel or failure)."""
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self._release(request)

    def _release(self, request: Request) -> None:
        self.prefixes.drop(request)
        self.tables.free(request)
        request.num_registered_pages = 0
        if request.offloaded:
            self.offloader.discard(request.offloaded)
            request.offloaded = []

    # -------------------------------------------------------------- schedule
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_batch_tokens
        scheduled: set[int] = set()
        for phase in _POLICIES[self.policy]:
            budget = phase(self, out, budget, scheduled)
        self.peak_used_pages = max(self.peak_used_pages, self.pool.num_pages - self.pool.num_free_pages)
        return out

    def _schedule_running(self, out: SchedulerOutput, budget: int, done: set[int], prefill: bool | None) -> int:
        if (
            self.decode_fast_path
            and not done
            and prefill is not True
            and (left := self._schedule_decodes(out, budget, done)) is not None
        ):
            return left
        multi, ps = self.tables.num_groups > 1, self.page_size
        i = 0
        while i < len(self.running) and budget > 0 and len(out.scheduled) < self.max_requests:
            req = self.running[i]
            if id(req) in done or (prefill is not None and (req.status == RequestStatus.PREFILLING) != prefill):
                i += 1
                continue
            want = min(req.schedulable(req.num_computed_tokens), budget)
            n = 1 if want == 1 else self.tables.fit(req.num_computed_tokens, want)  # NOTE: a decode row always fits
            # NOTE: every group's table has the length of `page_ids`: no page needed when the last has room
            if req.num_computed_tokens + n > len(req.page_ids) * ps and not self._grow(
                req, req.num_computed_tokens + n, out, done
            ):
                # `req` itself was preempted: the running list shrank at or before i
                continue
            out.scheduled.append(ScheduledRequest(req, n, self._out_tables(req) if multi else None))
            done.add(id(req))
            budget -= n
            i += 1
        return budget

    def _schedule_decodes(self, out: SchedulerOutput, budget: int, done: set[int]) -> int | None:
        """The steady state in one pass: every running request is DECODING its last token and all of them
        fit (budget, request cap, the pages of those whose last page is full). Schedules exactly what the
        general loop would (same order, same page allocations, no preemption); None when it does not apply."""
        running = self.running
        num = len(running)
        if not num or num > budget or len(out.scheduled) + num > self.max_requests:
            return None
        ps, decoding = self.page_size, RequestStatus.DECODING
        crossing: list[Request] = []  # NOTE: ~1 in page_size requests per step needs a new page
        for req in running:
            c = req.num_computed_tokens
            if req.status is not decoding or len(req.token_ids) - c != 1:
                return None
            if c >= len(req.page_ids) * ps:
                crossing.append(req)
        if crossing:
            if sum(self.tables.growth(r, r.num_computed_tokens + 1) for r in crossing) > self.pool.num_free_pages:
                return None  # NOTE: someone gets preempted: the general loop decides whom
            for req in crossing:
                self.tables.grow(req, req.num_computed_tokens + 1)
        if self.tables.num_groups > 1:
            of = self.tables.of
            out.scheduled += [ScheduledRequest(req, 1, of(req)) for req in running]
        else:
            out.scheduled += [ScheduledRequest(req, 1) for req in running]
        out.decode_only = len(out.scheduled) == num  # NOTE: until another phase adds a row
        done.update(map(id, running))
        return budget - num

    def _schedule_waiting(
        self, out: SchedulerOutput, budget: int, done: set[int], readmit_preempted: bool = True
    ) -> int:
        deferred: list[Request] = []
        before = len(out.scheduled)
        while self.waiting and budget > 0 and len(out.scheduled) < self.max_requests:
            req = self.waiting[0]
            if not readmit_preempted and req in out.preempted:
                break  # NOTE: let the decodes it made room for run first, or it can starve them forever
            fork = self._fork_source(req)
            if fork == "wait":
                deferred.append(self.waiting.popleft())  # its leader is still computing the prompt
                continue
            if fork is not None:
                if not self._admit_fork(req, fork, out, budget):
                    break
                done.add(id(req))
                budget -= out.scheduled[-1].num_new_tokens
                continue
            restoring = bool(req.offloaded)  # preempted with its KV parked in the offload buffer
            hashes = [] if restoring else self.prefixes.prefix_hashes(req)
            hit, keys = self.prefixes.peek(hashes, self.tables)  # NOTE: keys of the hit pages, per group
            if hit < len(hashes) and hashes[hit] in self.prefixes.inflight:
                deferred.append(self.waiting.popleft())  # its next page is being computed: wait
                continue
            computed = req.num_computed_tokens if restoring else hit * self.page_size
            n = self.tables.fit(computed, min(req.schedulable(computed), budget))
            # NOTE: every group's live pages (restored ones included), less the prefix hits already
            # held by others; a hit on an unreferenced cached page takes it off the free queue too.
            hit_pages = [key for group in keys for key in group]
            unreferenced = self.pool.num_unreferenced(hit_pages)
            take = self.tables.footprint(computed, computed + n) - len(hit_pages)
            held = len(hit_pages) - unreferenced  # hit pages other requests hold
            free_after = self.pool.num_free_pages - take - unreferenced
            if free_after < 0 or (self.running and free_after < self.safety_pages):
                break  # head-of-line: keep fifo order, wait for pages
            if req.num_preemptions and self.running and self._cannot_catch_up(req, held):
                break
            self.waiting.popleft()
            if restoring:
                self._restore(req, computed + n)
            else:
                self.prefixes.take(req, hit, keys, self.tables)
                req.num_computed_tokens = hit * self.page_size
                req.num_cached_tokens = req.num_computed_tokens
                self.num_cached_prompt_tokens += min(req.num_computed_tokens, req.num_prompt_tokens)
                self.tables.grow(req, computed + n)
            req.status = RequestStatus.PREFILLING
            self.running.append(req)
            self.prefixes.admitted(req, hashes)
            out.scheduled.append(ScheduledRequest(req, n, self._out_tables(req)))
            done.add(id(req))
            budget -= n
        self.waiting.extendleft(reversed(deferred))
        if len(out.scheduled) > before:
            out.decode_only = False
        return budget

    def _cannot_catch_up(self, req: Request, held: int) -> bool:
        """A preempted request waits until it can get back to where it was and take one more step:
        readmitted earlier, it would only recompute a part and be preempted again (thrashing)."""
        return self.pool.num_free_pages + held < self.tables.max_pages(req.num_tokens + 1)

    def _fork_source(self, req: Request) -> Request | str | None:
        """The running leader whose prompt KV `req` can fork, "wait" if it is still computing it."""
        if req.num_computed_tokens or req.page_ids or not 2 <= req.num_prompt_tokens <= req.max_reused_tokens + 1:
            return None  # NOTE: a fork never computes prompt positions, so one that scores them cannot fork
        leader = self.prefixes.leader_of(req)
        if leader is None or leader not in self.running:
            return None
        if leader.num_computed_tokens < req.num_prompt_tokens - 1:
            return "wait"
        return leader if self._fork_pages(req, leader) is not None else None

    def _fork_pages(self, req: Request, leader: Request) -> list[list[int]] | None:
        """Per group, the leader's pages the fork reads (FREED below its window's first live page, the
        partial page last when there is one); None when a sliding group has recycled one of them."""
        shared = req.num_prompt_tokens - 1
        full, rest = divmod(shared, self.page_size)
        out = []
        for alloc, table in zip(self.tables.allocators, self.tables.of(leader), strict=True):
            first = min(alloc.first_live_page(shared), full)
            pages = table[first : full + (1 if rest else 0)]
            if len(pages) < full + (1 if rest else 0) - first or FREED in pages:
                return None
            out.append([FREED] * first + pages)
        return out

    def _admit_fork(self, req: Request, leader: Request, out: SchedulerOutput, budget: int) -> bool:
        """Share the leader's full prompt pages (every group), copy its partial ones, compute only the last token."""
        shared = req.num_prompt_tokens - 1
        full, rest = divmod(shared, self.page_size)
        n = min(req.num_tokens - shared, budget)
        pages = self._fork_pages(req, leader)
        fresh = self.pool.pages_needed(shared + n) - full  # per group
        new_pages = self.tables.num_groups * fresh
        free_after = self.pool.num_free_pages - new_pages
        if free_after < 0 or free_after < self.safety_pages:
            return False
        self.waiting.popleft()
        for table, src in zip(self.tables.of(req), pages, strict=True):
            held = [b for b in src[:full] if b != FREED]
            self.pool.fork(held)
            table += src[:full]
            table += self.pool.allocate(fresh)
            if rest:
                out.copies.append((src[full], table[full], rest))
        if rest:  # NOTE: the copied-from pages are held (PageTables.free lets go) for the decode kernel to read
            req.fork_alias = (full, [src[full] for src in pages], rest)
            self.pool.fork(req.fork_alias[1])
        req.num_computed_tokens = req.num_cached_tokens = shared
        self.num_cached_prompt_tokens += shared
        req.status = RequestStatus.PREFILLING
        self.running.append(req)
        out.scheduled.append(ScheduledRequest(req, n, self._out_tables(req)))
        return True

    def _grow(self, req: Request, num_tokens: int, out: SchedulerOutput, done: set[int]) -> bool:
        """Make `req` hold pages for `num_tokens`, preempting the newest running requests if needed.

        Returns False if `req` itself had to be preempted."""
        need = self.tables.growth(req, num_tokens)
        if not need:  # NOTE: most decode steps: the last page has room
            return True
        while need > self.pool.num_free_pages:
            # NOTE: the newest running request not yet scheduled this step, else `req` itself.
            victim = next((r for r in reversed(self.running) if id(r) not in done), req)
            self.preempt(victim)
            out.preempted.append(victim)
            if victim is req:
                return False
        self.tables.grow(req, num_tokens)
        return True

    def _out_tables(self, req: Request) -> list[list[int]] | None:
        return self.tables.of(req) if self.tables.num_groups > 1 else None

    def preempt(self, req: Request) -> None:
        """Release `req`'s pages and put it at the front of the queue (recompute unless offloaded)."""
        self.running.remove(req)
        self.num_preemptions += 1
        req.num_preemptions += 1
        req.high_water = max(req.high_water, req.num_computed_tokens)
        slots = self._save(req)
        self._release(req)
        if slots is None:
            req.num_computed_tokens = 0
        else:
            req.offloaded = slots
        req.status = RequestStatus.PENDING
        self.waiting.appendleft(req)

    def _save(self, req: Request) -> list[int] | None:
        """Park `req`'s live pages in the offload buffer; None when there is none, or it is full."""
        if self.offloader is None or req.num_computed_tokens == 0:
            return None
        pages = self.tables.live_pages(req)
        slots = self.offloader.save(pages)
        if slots is None:
            self.num_offload_fallbacks += 1
        else:
            self.num_offloaded_pages += len(pages)
        return slots

    def _restore(self, req: Request, num_tokens: int) -> None:
        """Readmit an offloaded request: fresh pages for every group, its saved KV copied back."""
        pages = self.tables.rebuild(req, num_tokens)
        self.offloader.restore(req.offloaded, pages)
        self.num_restored_pages += len(pages)
        req.offloaded = []

    # --------------------------------------------------------------- update
    def after_step(self, out: SchedulerOutput) -> None:
        """Advance `num_computed_tokens` of everything that ran and cache newly full pages."""
        ps, caching, sliding = self.page_size, self.pool.enable_prefix_caching, self.tables.sliding
        if out.decode_only and not sliding:  # NOTE: one token each, already DECODING
            for s in out.scheduled:
                req = s.request
                computed = req.num_computed_tokens = req.num_computed_tokens + 1
                if caching and computed // ps != req.num_registered_pages:
                    self.prefixes.cache_full_pages(req, self.tables.of(req))
            return
        for s in out.scheduled:
            req = s.request
            req.num_computed_tokens += s.num_new_tokens
            if req.num_computed_tokens == len(req.token_ids):
                req.status = RequestStatus.DECODING
            if caching and req.num_computed_tokens // ps != req.num_registered_pages:
                self.prefixes.cache_full_pages(req, self.tables.of(req))
            if sliding:
                self.num_recycled_pages += self.tables.recycle(req)

    def drop_kv(self) -> int:
        """New weights, KV refilled: every live request's KV is dropped (pages freed, offloaded copies
        discarded) and it recomputes its tokens before its next sample; the running ones go back to the
        front of the queue in their order. Returns how many requests lost KV."""
        hit = [r for r in self.waiting if r.num_computed_tokens or r.offloaded] + self.running
        for req in hit:
            req.high_water = max(req.high_water, req.num_computed_tokens)
            self._release(req)
            req.num_computed_tokens, req.stale_kv, req.status = 0, False, RequestStatus.PENDING
        self.waiting.extendleft(reversed(self.running))
        self.running = []
        return len(hit)

    def forget_prefixes(self) -> None:
        """KV computed so far is stale (new weights): no new request may read it through the in-flight
        map or a fork, and the live requests' pages are never offered to the prefix cache."""
        self.prefixes.forget()
        for req in self.running:
            req.stale_kv = True
        for req in self.waiting:
            req.stale_kv = req.stale_kv or bool(req.offloaded)  # NOTE: parked KV; the others recompute


def _fifo(s: Scheduler, out: SchedulerOutput, budget: int, done: set[int]) -> int:
    budget = s._schedule_running(out, budget, done, prefill=None)
    return s._schedule_waiting(out, budget, done)


def _prefill_first(s: Scheduler, out: SchedulerOutput, budget: int, done: set[int]) -> int:
    budget = s._schedule_running(out, budget, done, prefill=True)
    budget = s._schedule_waiting(out, budget, done, readmit_preempted=False)
    return s._schedule_running(out, budget, done, prefill=False)


_POLICIES: dict[str, list[Callable[[Scheduler, SchedulerOutput, int, set[int]], int]]] = {
    "fifo": [_fifo],
    "prefill_first": [_prefill_first],
}
