"""Lossless n-gram speculative decoding over the core's decode steps.

When every scheduled row is decoding and the batch is small (`MAX_ROWS`: where a step is memory-bound and
verifying k more positions per row costs little more than one), each row's drafter (`rollout.sampling.drafts`)
proposes up to k tokens; one forward runs each row's last token and its draft (`ModelRunner.execute(out,
drafts)`, the chunked-prefill path: k + 1 query positions per row) and keeps every position's logits. Positions
are then sampled in order with the engine's own sampler and logits processors, each row's history grown by the
tokens it kept (`rollout.sampling.speculative`: greedy rows keep exactly the argmax tokens, sampled rows the
target's distribution); a row stops at its first rejected draft, whose sampled token replaces it. KV counts for
the kept tokens only: `num_computed_tokens` goes back to them (the rejected slots are written again later) and
the pages past them are freed (`PageTables.truncate`). Logprobs, top-k and versions are the sampler's, as in a
plain step. Rows that asked for routed experts, tensor parallelism and batch-invariant mode never speculate.

A request's own `prompt_lookup_num_tokens` / `max_matching_ngram_size` (transformers' prompt lookup) set its k
and n-gram size; otherwise the engine's `num_speculative_tokens`.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable

from rollout.requests import Request, RequestStatus
from rollout.sampling.drafts import DEFAULT_NGRAM, Drafter
from rollout.sampling.speculative import ACCEPTANCE, Rule
from rollout.scheduling.stages import ScheduledRequest, SchedulerOutput

logger = logging.getLogger("rollout")

MAX_ROWS = 8  # NOTE: the cost model: more decode rows than this and a step is no longer bound by weight reads
MAX_DRAFT = 32
MAX_MISSES = 3  # NOTE: a row whose drafts keep failing still drafts k >> 3 (at least 1) tokens


class Speculator:
    """Drafts and verifies the decode steps of one `EngineCore`.

    Args:
        core: the engine core (its config, scheduler, runner, sampler, stats and policy version).
        finish: finalises a request (`EngineCore._finalize`'s signature: request, status, reason).
        rule: the acceptance rule (`rollout.sampling.speculative.ACCEPTANCE`; "exact" but in its tests).
        max_rows: the most decode rows a step may have and speculate.
    """

    def __init__(self, core, finish: Callable[[Request, RequestStatus, str], None], rule: str = "exact",
                 max_rows: int = MAX_ROWS) -> None:
        self.core = core
        self.finish = finish
        self.k = core.config.num_speculative_tokens
        self.rule: Rule = ACCEPTANCE[rule]
        self.max_rows = max_rows
        self.drafter = Drafter()
        # NOTE: per request, its steps in a row whose draft was rejected at once: its next draft is k >> misses long
        self.misses: dict[str, int] = {}

    def finished(self, request: Request) -> None:
        """`request` is final (its tokens join its prompt's history when it finished normally)."""
        self.drafter.finish(request, keep=request.status is RequestStatus.FINISHED)
        self.misses.pop(request.request_id, None)

    def _draft(self, req: Request) -> list[int]:
        p = req.sampling
        k = min(p.prompt_lookup_num_tokens or self.k, MAX_DRAFT, req.max_new_tokens - len(req.generated) - 1)
        k = max(1, k >> self.misses.get(req.request_id, 0)) if k > 0 else k
        if k <= 0 or req.routes is not None:
            return []
        return self.drafter.draft(req, k, p.max_matching_ngram_size or DEFAULT_NGRAM)

    def step(self, out: SchedulerOutput) -> list[Request] | None:
        """Run a decode-only step speculatively; None (nothing done) when it would not pay or nothing drafts."""
        core = self.core
        rows = [s.request for s in out.scheduled]
        if len(rows) > self.max_rows or core.runner.routes is not None:
            return None
        for req in core.scheduler.running:  # NOTE: siblings' drafts come from their live indexes
            self.drafter.track(req)
        drafts = [self._draft(r) for r in rows]
        if not any(drafts):
            return None
        drafts = self._fit(rows, drafts)
        if not any(drafts):
            return None
        tables = core.scheduler.tables
        multi = tables.num_groups > 1
        spec = SchedulerOutput([ScheduledRequest(r, 1 + len(d), tables.of(r) if multi else None)
                                for r, d in zip(rows, drafts, strict=True)])
        try:
            logits = core.runner.execute(spec, drafts)[0]  # [sum(1 + len(d)), V]
            emitted, reasons = self._verify(rows, drafts, logits)
        except Exception as e:  # NOTE: as a plain step: a failing step fails its own requests
            logger.exception("speculative step failed; failing its %d requests", len(rows))
            for req in rows:
                if not req.status.is_final:
                    core.fail(req, f"engine step failed: {type(e).__name__}: {e}")
            return rows
        # NOTE: the positions run with kept tokens are computed: the last one run and each kept draft token
        core.scheduler.after_step(SchedulerOutput([ScheduledRequest(r, n, s.page_tables)
                                                   for r, n, s in zip(rows, emitted, spec.scheduled, strict=True)]))
        news = []
        for req, reason in zip(rows, reasons, strict=True):
            if reason is not None:
                self.finish(req, RequestStatus.FINISHED, reason)
                news.append(req)
            else:
                tables.truncate(req, req.num_computed_tokens)
                if req.streaming:
                    news.append(req)
        core.stats["generated_tokens"] += sum(emitted)
        return news

    def _fit(self, rows: list[Request], drafts: list[list[int]]) -> list[list[int]]:
        """Drafts cut to the step's token budget and the free pages (a draft never preempts anyone)."""
        core = self.core
        tables, pool = core.scheduler.tables, core.page_pool
        budget = core.max_batch_tokens - len(rows)
        out = []
        for req, d in zip(rows, drafts, strict=True):
            d = d[: max(0, budget)]
            while d and tables.growth(req, req.num_computed_tokens + 1 + len(d)) > pool.num_free_pages:
                d = d[:-1]
            if d:
                tables.grow(req, req.num_computed_tokens + 1 + len(d))
            budget -= len(d)
            out.append(d)
        return out

    def _verify(self, rows: list[Request], drafts: list[list[int]], logits) -> tuple[list[int], list[str | None]]:
        """Sample position after position, appending what each row emits; returns (tokens each row emitted, why
        each stopped: None while it goes on)."""
        core, cfg = self.core, self.core.config
        mode = cfg.logprobs_mode if cfg.return_logprobs else None
        first = list(itertools.accumulate([0, *[1 + len(d) for d in drafts[:-1]]]))
        emitted = [0] * len(rows)
        reasons: list[str | None] = [None] * len(rows)
        active = list(range(len(rows)))
        accepted = 0
        j = 0
        while active:
            reqs = [rows[i] for i in active]
            at = logits[[first[i] + j for i in active]]  # [A, V]
            proposed = [drafts[i][j] if j < len(drafts[i]) else None for i in active]

            def sample(sub: list[int], reqs=reqs, at=at):
                rs = [reqs[s] for s in sub]
                return core.sampler(at[sub], [r.sampling for r in rs], [r.request_id for r in rs], mode,
                                    requests=rs, top_mode=cfg.logprobs_mode)

            result, kept = self.rule(sample, proposed, [r.sampling.greedy for r in reqs])
            logprobs = [None] * len(reqs) if result.logprobs is None else result.logprobs
            tops = [None] * len(reqs) if result.top is None else result.top
            still = []
            for a, i in enumerate(active):
                req = rows[i]
                if tops[a] is not None:
                    req.top.append(tops[a])
                if result.masks is not None and result.masks[a] is not None:
                    req.masks.append(result.masks[a])
                reason = req.append_token(result.tokens[a], logprobs[a], core.policy_version)
                emitted[i] += 1
                accepted += kept[a]
                if j == 0 and proposed[a] is not None:
                    self.misses[req.request_id] = 0 if kept[a] else min(MAX_MISSES, self.misses.get(req.request_id, 0) + 1)
                if reason is not None:
                    reasons[i] = reason
                elif kept[a]:
                    still.append(i)
            active = still
            j += 1
        core.stats["spec_draft_tokens"] += sum(len(d) for d in drafts)
        core.stats["spec_accepted_tokens"] += accepted
        return emitted, reasons
