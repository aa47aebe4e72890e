"""Lossless speculative decoding over the core's decode steps, where a cost model says it pays.

Each decoding row's drafter (`rollout.sampling.drafts`: suffix drafts from its own text, its live group siblings
and its prompt's finished rollouts) proposes up to k tokens, each with a probability estimate, scaled per row by
how its recent drafts fared (`Calibration`: a row whose drafts keep failing drafts shorter, or not at all). The
cost model (`StepCost`) then picks the drafts worth verifying: a step that runs T tokens for B rows costs
t(B) (c0 + c1 x), x the extra tokens' share of the step by a prior from the model's size (weight bytes streamed
once a step against the FLOPs of a token, `prior`), c0 and c1 fitted online to the steps' measured times; the
drafted tokens (highest estimate first) kept are those maximising the expected tokens emitted per unit of time,
and the step speculates only when that beats the plain step's B tokens. On a CPU a verifying step runs at most as many
tokens (rows + drafted) as the small-M kernel takes (`rollout.kernels.linear.small_rows`): past it the step leaves
the C++ decoder layers, a cliff the cost model's line does not have. Each step is timed from its own start
(its planning included) to its own end, whatever runs between steps. Where the drafter's indexes are C++, a step's
planning (the lookups, each row's calibration and idle spell, the cost model's choice) is one call (`plan_drafts`),
the Python below its reference. So it speculates where bound by weight reads
(few rows, a large model, a GPU) and drafts are likely, and not in a wide batch of text that never repeats.

One forward runs each row's last token and its draft (`ModelRunner.execute(out, drafts)`, the chunked-prefill
path: 1 + len(draft) query positions per row) and keeps every position's logits. Positions are then sampled in
order with the engine's own sampler and logits processors, each row's history grown by the tokens it kept
(`rollout.sampling.speculative`: greedy rows keep exactly the argmax tokens, sampled rows the target's
distribution); a row stops at its first rejected draft, whose sampled token replaces it. KV counts for the kept
tokens only: `num_computed_tokens` goes back to them (the rejected slots are written again later) and the pages
past them are freed (`PageTables.truncate`). Logprobs, top-k and versions are the sampler's, as in a plain step.
Rows that asked for routed experts, tensor parallelism and batch-invariant mode never speculate.

A request's own `prompt_lookup_num_tokens` / `max_matching_ngram_size` (transformers' prompt lookup) set its k
and longest suffix; otherwise the engine's `num_speculative_tokens`.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable

import torch

from rollout.kernels import cpu_kernels
from rollout.kernels.linear import small_rows
from rollout.requests import Request, RequestStatus
from rollout.sampling.drafts import DEFAULT_NGRAM, Drafter
from rollout.sampling.sampler import kernel_rows, row_argmax
from rollout.sampling.speculative import ACCEPTANCE, Rule
from rollout.scheduling.stages import ScheduledRequest, SchedulerOutput

logger = logging.getLogger("rollout")

MAX_DRAFT = 32
DECAY = 0.9  # NOTE: weight of the older measurements at each new one (the cost fit, the plain step's time)
RELAX = 0.02  # NOTE: the share of the prior mixed back into the fit at each plain step
PRIOR_SUMS = (2.0, 1.0, 3.0, 1.0, 2.0)  # NOTE: the fit's (weight, x, y, xx, xy) of the prior's points (0, 1), (1, 2)
RELAXED = tuple(RELAX * p for p in PRIOR_SUMS)  # NOTE: the prior's share mixed in at a plain step, computed once
# NOTE: a row whose suffix matched nowhere skips drafting for 1, 2, 4 .. this many steps, times its step's rows / 8
# past 8 rows: the idle rows' lookups cost ~1 row's a step whatever the width (32 rows of text that never repeats:
# 32 lookups every 8th step were ~1% of a 5M step)
IDLE_MAX = 8
IDLE_ROWS = 8
# NOTE: a step of at most this many rows (a tail) looks every row up, spell or not: a lookup is ~13 us against a
# ~1-2 ms 5M step, and a repeat a spell misses costs steps of the rows that end the batch (the 5M tail 4 x 400,
# seeds 490-497: 1.26x -> 1.30x median, every seed faster; 6 x 300: 1.00x -> 1.03x; up to 8 rows: the same)
LOOKUP_ROWS = 4
NO_DRAFT: tuple[list[int], list[float]] = ([], [])  # NOTE: shared, never mutated
CALIBRATION_DECAY = 0.7  # NOTE: a row's acceptance record fades by this much at each of its drafted steps
# NOTE: the prior's machine: a CPU streams ~20 GB/s of weights and runs ~100 GFLOP/s a thread in fp32; a CUDA
# device ~2 TB/s and ~300 TFLOP/s; the host spends ~1.5 ms / ~4 ms a step and ~30 us a row around the forward
MACHINES = {"cpu": (20e9, 1e11, 1.5e-3, 3e-5), "cuda": (2e12, 3e14, 4e-3, 3e-5)}


def prior(params: int, bytes_per_param: int, device: str, threads: int = 1) -> tuple[float, float]:
    """(seconds a decode step spends whatever its width, seconds per token it runs) for a model of `params`
    parameters: the weights streamed once, a token's 2 FLOPs per parameter, the host's glue."""
    bandwidth, flops, host, host_row = MACHINES.get(device, MACHINES["cpu"])
    if device == "cpu":
        flops *= max(1, threads)
    return params * bytes_per_param / bandwidth + host, 2 * params / flops + host_row


class StepCost:
    """A decode step's time against the tokens it runs, relative to the plain step of the same rows.

    A plain step of B rows takes t(B) (measured: `DECAY`-weighted per B; between measured widths the prior's
    line a + b B scales the nearest one). A step that also runs e drafted tokens takes t(B) (c0 + c1 x) with
    x = e b / (a + b B), the prior's share of the extra tokens; c0, c1 start at 1, 1 (the prior) and are fitted by
    weighted least squares to the verifying steps' measured times (the prior stays in the fit as two points).

    Args:
        a, b: the prior (`prior`): seconds a step, seconds a token.
    """

    def __init__(self, a: float, b: float) -> None:
        self.a, self.b = a, b
        self.plain: dict[int, float] = {}  # rows -> measured seconds of a plain step
        # NOTE: decayed sums of the fit (weight, x, y, xx, xy), the prior as points (0, 1) and (1, 2)
        self.sums = list(PRIOR_SUMS)
        self.c0, self.c1 = 1.0, 1.0

    def share(self, rows: int) -> float:
        """The prior's time of one more token, relative to a plain step of `rows` rows."""
        return self.b / (self.a + self.b * rows)

    def plain_time(self, rows: int) -> float | None:
        """Seconds of a plain step of `rows` rows (measured, or scaled from the nearest measured width)."""
        if rows in self.plain:
            return self.plain[rows]
        if not self.plain:
            return None
        near = min(self.plain, key=lambda r: abs(r - rows))
        return self.plain[near] * (self.a + self.b * rows) / (self.a + self.b * near)

    def observe_plain(self, rows: int, seconds: float) -> None:
        """A plain step's time; the fit also relaxes toward the prior (`RELAX`), so that a fit spoilt by a few
        slow steps (a loaded box) lets the speculative steps be tried and measured again."""
        old = self.plain.get(rows)
        # NOTE: noise only adds time (a step descheduled on a shared box, a cold first step): a faster step moves
        # the estimate half way down, a slower one by a bounded step
        if old is None:
            self.plain[rows] = seconds
        elif seconds < old:
            self.plain[rows] = (old + seconds) / 2
        else:
            self.plain[rows] = DECAY * old + (1 - DECAY) * min(2 * old, seconds)
        w, x, y, xx, xy = self.sums  # NOTE: unrolled: this runs at every plain step, right after a forward
        keep, (rw, rx, ry, rxx, rxy) = 1 - RELAX, RELAXED
        self.sums = [keep * w + rw, keep * x + rx, keep * y + ry, keep * xx + rxx, keep * xy + rxy]
        self._fit()

    def observe_spec(self, rows: int, extra: int, seconds: float) -> None:
        base = self.plain_time(rows)
        if base is None:
            return
        x = extra * self.share(rows)
        guess = self.c0 + self.c1 * x  # NOTE: one descheduled step moves the fit by a bounded step
        y = min(1.25 * guess, max(guess / 2, seconds / base))
        s = self.sums
        for i, v in enumerate((1.0, x, y, x * x, x * y)):
            s[i] = DECAY * s[i] + v
        self._fit()

    def _fit(self) -> None:
        w, sx, sy, sxx, sxy = self.sums
        det = w * sxx - sx * sx
        if det > 1e-12:
            self.c1 = min(5.0, max(0.2, (w * sxy - sx * sy) / det))
            self.c0 = min(3.0, max(0.5, (sy - self.c1 * sx) / w))

    def min_prob(self, rows: int) -> float:
        """No drafted token with a lower estimate can pay: the gain a token must bring (lower bound)."""
        return self.c1 * self.share(rows) * rows

    def plan(self, probs: list[list[float]], room: int | None = None) -> list[int] | None:
        """How many of each row's drafted tokens to verify (estimates `probs`, falling along each draft), or None
        when no choice beats the plain step; at most `room` of them (the likeliest) when given."""
        rows = len(probs)
        dx = self.c1 * self.share(rows)
        inc = sorted(((p, i) for i, ps in enumerate(probs) for p in ps), reverse=True)
        if room is not None:
            del inc[max(0, room):]
        gain, cost = float(rows), self.c0
        # NOTE: no margin over the plain step: the drafting's own time is in both kinds of step's measured time (a
        # margin of 0.15 cost the 5M tail 4 x 400 1.5% and an RL-shaped log-normal G=8 batch 1.4-2.7% on fresh seeds,
        # paired over 60 and 30 of them: RESULTS, "A step timed alone, and no margin")
        best, keep = float(rows), 0
        for n, (p, _) in enumerate(inc, 1):
            gain += p
            cost += dx
            if gain / cost > best:
                best, keep = gain / cost, n
        if not keep:
            return None
        lens = [0] * rows
        for _, i in inc[:keep]:
            lens[i] += 1  # NOTE: a row's estimates fall along its draft, so its kept ones are a prefix
        return lens


class Calibration:
    """Per row, how its drafts fared: the estimates of the tokens it verified against the tokens kept (decayed
    by `CALIBRATION_DECAY` at each drafted step); its next estimates are scaled by (kept + 1) / (estimated + 1)."""

    def __init__(self) -> None:
        self.rows: dict[str, list[float]] = {}

    def scale(self, rid: str) -> float:
        est, kept = self.rows.get(rid, (0.0, 0.0))
        return min(2.0, (kept + 1) / (est + 1))

    def record(self, rid: str, estimated: float, kept: int) -> None:
        r = self.rows.setdefault(rid, [0.0, 0.0])
        r[0] = CALIBRATION_DECAY * r[0] + estimated
        r[1] = CALIBRATION_DECAY * r[1] + kept


class Speculator:
    """Drafts and verifies the decode steps of one `EngineCore`.

    Args:
        core: the engine core (its config, scheduler, runner, sampler, stats and policy version).
        finish: finalises a request (`EngineCore._finalize`'s signature: request, status, reason).
        rule: the acceptance rule (`rollout.sampling.speculative.ACCEPTANCE`; "exact" but in its tests).
        max_rows: None (the cost model decides), or the old fixed gate (tests): every drafted row of a step of
            at most `max_rows` rows is verified.
    """

    def __init__(self, core, finish: Callable[[Request, RequestStatus, str], None], rule: str = "exact",
                 max_rows: int | None = None) -> None:
        self.core = core
        self.finish = finish
        self.k = core.config.num_speculative_tokens
        self.rule: Rule = ACCEPTANCE[rule]
        self.max_rows = max_rows
        self.drafter = Drafter()
        self.drafter.setup = self._setup
        # NOTE: plan in one C++ call where the drafter's indexes are C++ (`plan_drafts`: the same drafts as `_drafts`
        # and `StepCost.plan`); tests that plant drafts through `_drafts` turn it off
        self.native_plan = True
        model = core.model
        params = sum(p.numel() for p in model.parameters())
        dtype = next(model.parameters()).dtype
        self.cost = StepCost(*prior(params, dtype.itemsize, core.device.type, torch.get_num_threads()))
        # NOTE: the tokens (rows + drafted) a verifying step runs with its linears on the small-M kernel and the fused
        # decoder layers in C++ (None: no such kernel). Past them the step takes the Python path: at 5M, 32 rows and
        # 32 drafted tokens ran 2.7x a plain step, where the cost model, fitted under it, said 1.7x
        self.room = small_rows(core.view)
        self.calibration = Calibration()
        self.steps = 0  # NOTE: steps seen (the clock of the rows' idle spells)
        self.width = 0  # NOTE: rows of the step being planned (idle spells grow with it past `IDLE_ROWS`)
        self.idle: dict[str, tuple[int, int]] = {}  # NOTE: request id -> (step it drafts again, its spell's length)
        self.estimates: list[list[float]] = []  # NOTE: per row of the step planned, its drafted tokens' estimates
        # NOTE: the plain step in flight, handed back to the core to run: (perf_counter at its start, its rows) --
        # timed when the core has run it (`ran_plain`)
        self.pending: tuple[float, int] | None = None

    def finished(self, request: Request) -> None:
        """`request` is final (its tokens join its prompt's history when it finished normally)."""
        self.drafter.finish(request, keep=request.status is RequestStatus.FINISHED)
        self.calibration.rows.pop(request.request_id, None)
        self.idle.pop(request.request_id, None)

    def _setup(self, req: Request, native) -> None:
        """A row's planning constants, kept on its C++ index (`plan_drafts`): its k (`_drafts`: its prompt lookup's or
        the engine's, at most `MAX_DRAFT`; 0 when it records routed experts), the position past which a draft would run
        over its budget, its longest suffix matched."""
        p = req.sampling
        k = 0 if req.routes is not None else min(p.prompt_lookup_num_tokens or self.k, MAX_DRAFT)
        native.configure(k, len(req.token_ids) - len(req.generated) + req.max_new_tokens - 1,
                         p.max_matching_ngram_size or DEFAULT_NGRAM)

    def _drafts(self, reqs: list[Request], min_prob: float, spells: bool = True) -> list[tuple[list[int], list[float]]]:
        """Each of `reqs`' draft and its estimates, in one drafter call (`Drafter.draft_many`; `plan` skips the rows
        in an idle spell without calling this); `spells` False (a tail: every row is looked up whatever its spell)
        leaves the rows that found nothing as they were."""
        out = [NO_DRAFT] * len(reqs)
        todo, ks, ns, mins, scales = [], [], [], [], []
        k0, scale_of = self.k, self.calibration.scale
        for i, req in enumerate(reqs):
            p = req.sampling
            k = min(p.prompt_lookup_num_tokens or k0, MAX_DRAFT, req.max_new_tokens - len(req.generated) - 1)
            if k <= 0 or req.routes is not None:
                self.drafter.track(req, p.max_matching_ngram_size or DEFAULT_NGRAM)  # NOTE: a sibling all the same
                continue
            scale = scale_of(req.request_id)
            todo.append(i)
            ks.append(k)
            ns.append(p.max_matching_ngram_size or DEFAULT_NGRAM)
            mins.append(min_prob / scale)
            scales.append(scale)
        if not todo:
            return out
        found = self.drafter.draft_many([reqs[i] for i in todo] if len(todo) < len(reqs) else reqs, ks, ns, mins)
        idle, steps = self.idle, self.steps
        for i, (toks, probs), scale in zip(todo, found, scales, strict=True):
            rid = reqs[i].request_id
            if toks:
                idle.pop(rid, None)
                out[i] = toks, [min(1.0, q * scale) for q in probs]
            elif spells:  # NOTE: text that does not repeat costs a lookup every few steps (its index catches up then)
                was = idle.get(rid)
                spell = 1 if was is None else min(IDLE_MAX * max(1, self.width // IDLE_ROWS), 2 * was[1])
                idle[rid] = (steps + spell, spell)
        return out

    def ran_plain(self) -> None:
        """The core ran the plain step `step` handed back (None): its time, from the start of `step` (the planning
        included) to now, is a plain step's (`StepCost.observe_plain`).

        A step is timed from its own start to its own end, not to the next step's start: what runs between two steps
        (another engine's step in the same process -- the benchmarks' lockstep --, the caller's own work) is no part
        of a step's cost (timed to the next call, in the 2-engine lockstep of benchmarks/speculation.py, a 100M
        4-row plain step was estimated at 30 ms against its 17 ms, and a drafted token's relative price at about
        half of it)."""
        pending, self.pending = self.pending, None
        if pending is not None:
            self.cost.observe_plain(pending[1], time.perf_counter() - pending[0])

    def plan(self, rows: list[Request]) -> list[list[int]] | None:
        """Each row's draft, cut to what the cost model keeps (or every draft under `max_rows`); None: plain."""
        self.width = len(rows)
        if len(rows) <= LOOKUP_ROWS and self.max_rows is None and self.drafter.nothing_to_draft(rows):
            return None  # NOTE: a tail whose rows' last 2 tokens occur nowhere: the lookups would all find nothing
        if self.max_rows is not None:
            if len(rows) > self.max_rows:
                return None
            floor = 0.0
        else:
            floor = self.cost.min_prob(len(rows))
            if floor >= 1.0 or (self.room is not None and len(rows) >= self.room):
                return None
        if self.native_plan and self.drafter.ready() is not None:
            return self._plan_native(rows, floor)
        # NOTE: a row in an idle spell (text that did not repeat) costs a dict lookup here, not a call: at 32 rows
        # of non-repeating text the step's planning took 55 us with the call, most of it these rows
        idle, step = self.idle, self.steps
        if len(rows) > LOOKUP_ROWS and idle:
            looked = [i for i, r in enumerate(rows) if (w := idle.get(r.request_id)) is None or w[0] <= step]
            proposed = [NO_DRAFT] * len(rows)
            for i, d in zip(looked, self._drafts([rows[i] for i in looked], floor), strict=True):
                proposed[i] = d
        else:
            proposed = self._drafts(rows, floor, len(rows) > LOOKUP_ROWS)
        if self.max_rows is not None:
            self.estimates = [p for _, p in proposed]
            return [t for t, _ in proposed]
        room = None if self.room is None else self.room - len(rows)
        lens = self.cost.plan([p for _, p in proposed], room) if any(t for t, _ in proposed) else None
        if lens is None:
            return None
        self.estimates = [p for _, p in proposed]
        return [t[:n] for (t, _), n in zip(proposed, lens, strict=True)]

    @property
    def planned_native(self) -> bool:
        """Whether `plan` plans in C++ (`_plan_native`): asked, and the drafter's indexes are C++."""
        return self.native_plan and self.drafter.native is not None

    def _plan_native(self, rows: list[Request], floor: float) -> list[list[int]] | None:
        """`plan` past its gates in one C++ call (`plan_drafts`, each row's state on its index: its k, calibration and
        idle spell): the same drafts as the Python below (`_drafts`, `StepCost.plan`), without its ~2 us a row."""
        drafter, cost, width = self.drafter, self.cost, len(rows)
        room = -1 if self.room is None else max(0, self.room - width)
        return drafter.native.plan_drafts(drafter.natives(rows), floor, cost.c0, cost.c1 * cost.share(width), room,
                                          self.steps, width > LOOKUP_ROWS, IDLE_MAX * max(1, width // IDLE_ROWS),
                                          self.max_rows is not None)

    def step(self, out: SchedulerOutput) -> list[Request] | None:
        """Run a decode-only step speculatively; None (nothing done) when it would not pay or nothing drafts."""
        core = self.core
        self.pending = None
        if not self.k and not any(s.request.sampling.prompt_lookup_num_tokens for s in out.scheduled):
            return None  # NOTE: nothing here can draft (no engine k, no request's prompt lookup): a plain step
        now = time.perf_counter()
        self.steps += 1
        rows = [s.request for s in out.scheduled]
        if core.runner.routes is not None:
            return None
        drafts = self.plan(rows)
        if drafts is not None:
            drafts = self._fit(rows, drafts)
        if drafts is None or not any(drafts):
            self.pending = now, len(rows)
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
        self.cost.observe_spec(len(rows), sum(map(len, drafts)), time.perf_counter() - now)
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
        core = self.core
        lens = [1 + len(d) for d in drafts]  # NOTE: each row's positions: its last token, then its draft
        first = list(itertools.accumulate([0, *lens[:-1]]))
        emitted = [0] * len(rows)
        reasons: list[str | None] = [None] * len(rows)
        taken = [0] * len(rows)  # NOTE: each row's drafted tokens kept
        if all(r.sampling.greedy and not r.sampling.uses_processors for r in rows):
            accepted = self._verify_greedy(rows, drafts, logits, first, lens, emitted, reasons, taken)
        else:
            accepted = self._verify_positions(rows, drafts, logits, first, emitted, reasons, taken)
        self.calibrate(rows, drafts, taken)
        core.stats["spec_draft_tokens"] += sum(len(d) for d in drafts)
        core.stats["spec_accepted_tokens"] += accepted
        return emitted, reasons

    def calibrate(self, rows: list[Request], drafts: list[list[int]], taken: list[int]) -> None:
        """Record, for each row that drafted, what `plan` estimated its draft would keep (`self.estimates`, summed
        over the tokens drafted) against the drafted tokens it kept: its calibration for the next plans."""
        if self.planned_native:  # NOTE: each row's estimates are on its C++ index
            own = self.drafter.own
            for req, d, n in zip(rows, drafts, taken, strict=True):
                if d:
                    own[req.request_id].native.record(len(d), n)
            return
        for req, d, est, n in zip(rows, drafts, self.estimates, taken, strict=True):
            if d:
                self.calibration.record(req.request_id, sum(est[: len(d)]), n)

    def _verify_greedy(self, rows, drafts, logits, first, lens, emitted, reasons, taken) -> int:
        """`_verify` for greedy rows without logits processors: a position's token, logprob, top-k and mask depend on
        its own logits only, and its token is the row's argmax, so each row emits its positions up to the first
        whose argmax is not its drafted token (that argmax included) and nothing after it is sampled. With
        rollout's kernel (fp32 CPU logits) and no row asking for top-k logprobs or masks, one C++ call
        (`cpu_kernels.greedy_verify`) gives those positions' argmax and log-softmax (the sampler's, to float
        rounding), instead of the argmax of every position, the gather and the sampler's half dozen ops (each 3-5x
        slower right after a forward than back to back: a 4-row 5M step's verification 279 -> 79 us); otherwise
        the argmax of every position (the sampler's own `row_argmax`) says which are emitted, and one sampler call
        over those gives what a call per position would. Returns the drafted tokens kept."""
        core, cfg = self.core, self.core.config
        kernel = cpu_kernels.greedy_verify() if kernel_rows(logits) else None
        if kernel is not None and not any(r.top_logprobs or r.sampling.return_sampling_mask for r in rows):
            out = kernel(logits, lens, [t for d in drafts for t in d], cfg.return_logprobs)
            at, counts = [], []
            for f, n in zip(first, lens, strict=True):
                c = 1
                while c < n and out[2 * (f + c)] >= 0:  # NOTE: -1 past its row's stop
                    c += 1
                at.extend(range(2 * f, 2 * (f + c), 2))  # NOTE: where in `out` the emitted positions are
                counts.append(c)
            tokens = [int(out[q]) for q in at]
            logprobs = [out[q + 1] for q in at] if cfg.return_logprobs else None
            tops = masks = None
        else:
            argmax = row_argmax(logits).tolist()
            at, counts = [], []
            for f, d in zip(first, drafts, strict=True):
                n = 0
                while n < len(d) and argmax[f + n] == d[n]:
                    n += 1
                at.extend(range(f, f + n + 1))
                counts.append(n + 1)
            per = [r for r, c in zip(rows, counts, strict=True) for _ in range(c)]
            mode = cfg.logprobs_mode if cfg.return_logprobs else None
            whole = core.sampler(logits[at], [r.sampling for r in per], [r.request_id for r in per], mode,
                                 requests=per, top_mode=cfg.logprobs_mode)
            tokens, logprobs, tops, masks = whole.tokens, whole.logprobs, whole.top, whole.masks
        version, accepted, p = core.policy_version, 0, 0
        for i, (req, c) in enumerate(zip(rows, counts, strict=True)):
            for q in range(p, p + c):  # NOTE: the row's kept drafts (c - 1 of them), then the token after them
                if tops is not None:
                    req.top.append(tops[q])
                if masks is not None:
                    req.masks.append(masks[q])
                reason = req.append_token(tokens[q], None if logprobs is None else logprobs[q], version)
                emitted[i] += 1
                if q < p + c - 1:
                    accepted += 1
                    taken[i] += 1
                if reason is not None:
                    reasons[i] = reason
                    break
            p += c
        return accepted

    def _verify_positions(self, rows, drafts, logits, first, emitted, reasons, taken) -> int:
        """`_verify` position after position (sampled rows, logits processors: a position's draw depends on the
        tokens kept before it), the acceptance rule at each. Returns the drafted tokens kept."""
        core, cfg = self.core, self.core.config
        mode = cfg.logprobs_mode if cfg.return_logprobs else None
        active = list(range(len(rows)))
        accepted = 0
        j = 0
        while active:
            reqs = [rows[i] for i in active]
            proposed = [drafts[i][j] if j < len(drafts[i]) else None for i in active]
            at = logits[[first[i] + j for i in active]]  # [A, V]

            def sample(sub: list[int], reqs=reqs, at=at):
                rs = [reqs[s] for s in sub]
                return core.sampler(at[sub], [r.sampling for r in rs], [r.request_id for r in rs], mode,
                                    requests=rs, top_mode=cfg.logprobs_mode)

            result, kept = self.rule(sample, proposed, [r.sampling.greedy for r in reqs])
            tokens = result.tokens
            logprobs = [None] * len(reqs) if result.logprobs is None else result.logprobs
            tops = [None] * len(reqs) if result.top is None else result.top
            masks = [None] * len(reqs) if result.masks is None else result.masks
            still = []
            for a, i in enumerate(active):
                req = rows[i]
                if tops[a] is not None:
                    req.top.append(tops[a])
                if masks[a] is not None:
                    req.masks.append(masks[a])
                reason = req.append_token(tokens[a], logprobs[a], core.policy_version)
                emitted[i] += 1
                accepted += kept[a]
                taken[i] += kept[a]
                if reason is not None:
                    reasons[i] = reason
                elif kept[a]:
                    still.append(i)
            active = still
            j += 1
        return accepted
