"""Scheduler tests' helpers: requests built directly, a scheduler over a small pool, and one simulated
engine step (schedule, advance, one appended token per request whose chunk reached its end)."""

from __future__ import annotations

import itertools

from rollout.kv.page_pool import PagePool
from rollout.requests import Request, RequestStatus, SamplingParams
from rollout.scheduling.scheduler import Scheduler
from rollout.scheduling.stages import SchedulerOutput

PS = 4  # tokens per page
GREEDY = SamplingParams(temperature=0.0)
_arrival = itertools.count()


def make_request(rid: str, prompt: list[int] | int, max_new_tokens: int = 4) -> Request:
    """`prompt` is a token list, or a length (tokens derived from the id, so prompts differ)."""
    if isinstance(prompt, int):
        base = sum(map(ord, rid)) * 7
        prompt = [(base + i) % 1000 + 1 for i in range(prompt)]
    return Request(rid, list(prompt), max_new_tokens, GREEDY, arrival=next(_arrival))


def make_scheduler(num_pages: int = 64, budget: int = 12, caching: bool = True, **kwargs) -> Scheduler:
    kwargs.setdefault("safety_margin", 0.0)
    return Scheduler(PagePool(num_pages, PS, enable_prefix_caching=caching), budget, **kwargs)


def chunks(out: SchedulerOutput) -> list[tuple[str, int]]:
    return [(s.request.request_id, s.num_new_tokens) for s in out.scheduled]


def step(s: Scheduler, token: int = 7) -> tuple[SchedulerOutput, list[Request]]:
    """One simulated engine step: schedule, advance, sample `token` where a chunk ends a request."""
    out = s.schedule()
    assert out.num_tokens <= s.max_batch_tokens
    for sched in out.scheduled:
        req = sched.request
        # the request holds pages for everything it will have computed after this step
        assert len(req.page_ids) * PS >= req.num_computed_tokens + sched.num_new_tokens
        assert sched.num_new_tokens >= 1
    sampled = [sched.request for sched in out.scheduled if sched.samples]
    s.after_step(out)
    finished = []
    for req in sampled:
        if req.append_token(token, None) is not None:  # its stop reason
            s.remove(req)
            req.status = RequestStatus.FINISHED
            finished.append(req)
    s.pool.check_invariants()
    return out, finished


def run_to_end(s: Scheduler, max_steps: int = 500) -> list[list[tuple[str, int]]]:
    trace = []
    while s.has_work():
        out, _ = step(s)
        trace.append(chunks(out))
        assert len(trace) < max_steps, "scheduler made no progress"
    assert s.pool.num_free_pages == s.pool.num_pages
    return trace
