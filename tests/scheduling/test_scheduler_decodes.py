"""The scheduler's all-decode fast path (`Scheduler(decode_fast_path=True)`, the default) against its general loop.

The same random workload (arrivals over time, tight pools with preemption, prefix hits, forks, sliding
windows, both policies) runs through a scheduler with the fast path and one without it; every step must
schedule the same rows with the same pages, preempt the same requests, and the fast path must have run.
Pure Python, like test_scheduler.py: the engine is simulated by `after_step` plus one appended token.
"""

from __future__ import annotations

import itertools

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rollout.kv.page_pool import PagePool
from rollout.requests import Request, RequestStatus, SamplingParams
from rollout.scheduling.scheduler import Scheduler

PS = 4
GREEDY = SamplingParams(temperature=0.0)


def _requests(workload) -> list[tuple[int, Request]]:
    families = {f: [1000 * (f + 1) + i for i in range(12)] for f in range(3)}
    arrival = itertools.count()
    out = []
    for i, (family, extra, max_new, arrive_at) in enumerate(workload):
        prompt = families[family][: 4 * family] + [i * 50 + j for j in range(extra)]
        out.append((arrive_at, Request(f"r{i}", prompt, max_new, GREEDY, arrival=next(arrival))))
    return out


def _trace(fast_path, workload, num_pages, budget, max_requests, policy, windows, caching):
    s = Scheduler(PagePool(num_pages, PS, enable_prefix_caching=caching), budget,
                  max_requests_per_batch=max_requests, policy=policy, windows=windows, decode_fast_path=fast_path)
    reqs = _requests(workload)
    trace, fast_steps = [], 0
    for t in range(400):
        for arrive_at, req in reqs:
            if arrive_at == t:
                s.add(req)
        if not s.has_work() and t > 8:
            break
        out = s.schedule()
        if out.decode_only:
            fast_steps += 1
            for x in out.scheduled:  # NOTE: what the runner and the core rely on
                assert x.num_new_tokens == 1 and x.samples and x.request.status == RequestStatus.DECODING
        trace.append((
            [(x.request.request_id, x.num_new_tokens, [list(t) for t in x.tables]) for x in out.scheduled],
            [r.request_id for r in out.preempted], list(out.copies), s.pool.num_free_pages,
        ))
        sampled = [x.request for x in out.scheduled if x.samples]
        s.after_step(out)
        for req in sampled:
            if req.append_token(len(req.token_ids) % 5 + 1, None) is not None:
                s.remove(req)
                req.status = RequestStatus.FINISHED
        s.pool.check_invariants()
    assert not s.has_work(), "workload did not finish"
    return trace, fast_steps


WORKLOAD = st.lists(
    st.tuples(st.integers(0, 2), st.integers(1, 10), st.integers(1, 14), st.integers(0, 8)),
    min_size=1,
    max_size=8,
)


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    workload=WORKLOAD,
    num_pages=st.integers(12, 40),
    budget=st.integers(2, 24),
    max_requests=st.sampled_from([None, 2, 5]),
    policy=st.sampled_from(["fifo", "prefill_first"]),
    windows=st.sampled_from([(None,), (None, 6)]),
    caching=st.booleans(),
)
def test_fast_path_schedules_exactly_what_the_general_loop_does(
    workload, num_pages, budget, max_requests, policy, windows, caching
):
    caching = caching and windows == (None,)  # NOTE: as the engine: no prefix caching with sliding layers
    fast, _ = _trace(True, workload, num_pages, budget, max_requests, policy, windows, caching)
    general, none = _trace(False, workload, num_pages, budget, max_requests, policy, windows, caching)
    assert none == 0
    assert fast == general


def test_fast_path_runs_in_the_steady_state_and_stops_for_new_rows_and_preemption():
    # NOTE: 3 requests decode side by side (fast), a 4th arrives (general: a prompt row), and the pool
    # then runs dry (general: someone is preempted); the traces still match.
    workload = [(0, 3, 14, 0), (1, 3, 14, 0), (2, 3, 14, 0), (0, 9, 14, 6)]
    for windows in [(None,), (None, 6)]:
        fast, steps = _trace(True, workload, 16, 16, None, "fifo", windows, windows == (None,))
        general, _ = _trace(False, workload, 16, 16, None, "fifo", windows, windows == (None,))
        assert fast == general
        assert steps >= 5
        assert any(preempted for _, preempted, _, _ in fast)


def test_runner_decode_only_prepare_equals_the_general_one():
    """A decode-only step prepared through the runner's fast lists and through its general loop: the
    same forward inputs and the same attention metadata (two layer groups: Gemma 2's sliding window)."""
    import dataclasses

    import torch
    from support.tiny_models import make_model, random_prompts
    from transformers import GenerationConfig

    from rollout import ContinuousBatchingConfig
    from rollout.engine.core import EngineCore

    core = EngineCore(make_model("gemma2"), GenerationConfig(do_sample=False, eos_token_id=None),
                      ContinuousBatchingConfig(page_size=4, num_blocks=256, max_batch_tokens=64))
    assert len(core.runner.windows) == 2
    for i, prompt in enumerate(random_prompts(5, 3, 30, seed=1)):
        core.add(core.make_request(prompt, request_id=f"r{i}", max_new_tokens=24))
    prepare, seen = core.runner.prepare, []

    def checked(out, drafts=None):
        """The engine's own prepare, compared with the general loop's whenever the step is decode-only."""
        assert drafts is None  # NOTE: no speculation configured
        fast, fast_sampled, fast_scored = prepare(out)
        if out.decode_only:
            seen.append(len(out.scheduled))
            general, general_sampled, general_scored = prepare(dataclasses.replace(out, decode_only=False))
            assert fast_scored == general_scored == []
            assert fast_sampled == general_sampled == list(range(len(out.scheduled)))
            for key in ("input_ids", "position_ids", "logits_to_keep"):
                assert torch.equal(fast[key], general[key]), key
            for a, b in zip(fast["rollout_meta"].groups, general["rollout_meta"].groups, strict=True):
                assert a.window == b.window and torch.equal(a.slot_mapping, b.slot_mapping)
                assert (a.paged is None) == (b.paged is None) and len(a.buckets) == len(b.buckets)
                if a.paged is not None:
                    for f in ("rows", "row", "start", "end"):
                        assert torch.equal(getattr(a.paged, f), getattr(b.paged, f)), f
                for x, y in zip(a.buckets, b.buckets, strict=True):
                    assert torch.equal(x.rows, y.rows) and torch.equal(x.slots, y.slots)
        return fast, fast_sampled, fast_scored

    core.runner.prepare = checked
    while core.has_work():
        core.step()
    assert len(seen) > 10 and max(seen) == 5
