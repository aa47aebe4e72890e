"""Token-budget scheduler: chunk sizes, request caps, policies, safety margin, preemption, prefix reuse.

Pure Python (no model): requests are built directly, `schedule()` is called, and the engine is
simulated by `after_step(out)` plus one appended token per request whose chunk reached its end.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support.scheduling import PS, chunks, make_request, make_scheduler, run_to_end, step

from rollout.requests import RequestStatus
from rollout.scheduling.stages import SchedulerOutput

# ------------------------------------------------------------------------------ budget and chunking


def test_long_prompt_is_prefilled_in_budget_sized_chunks_then_decodes():
    s = make_scheduler(budget=12)
    a = make_request("a", 30, max_new_tokens=3)
    s.add(a)
    assert a.status == RequestStatus.PENDING
    out, _ = step(s)
    assert chunks(out) == [("a", 12)]
    assert a.page_ids == [0, 1, 2]
    assert a.status == RequestStatus.PREFILLING and not a.generated
    out, _ = step(s)
    assert chunks(out) == [("a", 12)]
    assert a.page_ids == [0, 1, 2, 3, 4, 5]
    out, _ = step(s)
    assert chunks(out) == [("a", 6)]
    assert a.page_ids == list(range(8))  # 30 tokens -> 8 pages
    assert a.status == RequestStatus.DECODING and a.generated == [7]
    assert a.num_computed_tokens == 30 and a.remaining == 1
    assert run_to_end(s) == [[("a", 1)], [("a", 1)]]
    assert len(a.generated) == 3 and a.page_ids == []


def test_running_requests_and_new_ones_share_the_budget():
    s = make_scheduler(budget=12)
    s.add(make_request("a", 10, max_new_tokens=3))
    s.add(make_request("b", 10, max_new_tokens=3))
    trace = run_to_end(s)
    assert trace == [
        [("a", 10), ("b", 2)],
        [("a", 1), ("b", 8)],
        [("a", 1), ("b", 1)],
        [("b", 1)],
    ]


def test_max_requests_per_batch_caps_each_step():
    s = make_scheduler(budget=64, max_requests_per_batch=2)
    for rid in "abc":
        s.add(make_request(rid, 3, max_new_tokens=2))
    trace = run_to_end(s)
    assert trace == [
        [("a", 3), ("b", 3)],
        [("a", 1), ("b", 1)],
        [("c", 3)],
        [("c", 1)],
    ]


@pytest.mark.parametrize(
    "policy, expected",
    [
        ("fifo", [("a", 1), ("b", 4), ("c", 3)]),  # running in admission order, then new ones
        ("prefill_first", [("b", 4), ("c", 3), ("a", 1)]),  # prompts first, decodes last
    ],
)
def test_policy_order(policy, expected):
    s = make_scheduler(budget=12, policy=policy)
    s.add(make_request("a", 2, max_new_tokens=5))
    s.add(make_request("b", 14, max_new_tokens=5))
    out, _ = step(s)
    assert chunks(out) == [("a", 2), ("b", 10)]
    s.add(make_request("c", 3, max_new_tokens=5))
    out, _ = step(s)
    assert chunks(out) == expected


def test_prefill_first_lets_a_long_prompt_starve_decodes_fifo_does_not():
    traces = {}
    for policy in ("fifo", "prefill_first"):
        s = make_scheduler(budget=12, policy=policy)
        s.add(make_request("a", 4, max_new_tokens=4))
        s.add(make_request("b", 40, max_new_tokens=1))
        traces[policy] = run_to_end(s)
    assert traces["fifo"] == [
        [("a", 4), ("b", 8)],
        [("a", 1), ("b", 11)],
        [("a", 1), ("b", 11)],
        [("a", 1), ("b", 10)],
    ]
    assert traces["prefill_first"] == [
        [("a", 4), ("b", 8)],
        [("b", 12)],
        [("b", 12)],
        [("b", 8), ("a", 1)],
        [("a", 1)],
        [("a", 1)],
    ]


def test_unknown_policy_is_refused():
    with pytest.raises(ValueError, match="scheduler_type"):
        make_scheduler(policy="lifo")


# ------------------------------------------------------------------------------------ safety margin


def test_safety_margin_holds_back_new_requests_while_others_run():
    # 10 pages, margin 0.5: a new request may not leave fewer than 5 pages free while anything runs
    s = make_scheduler(num_pages=10, budget=64, safety_margin=0.5)
    a = make_request("a", 16, max_new_tokens=3)  # 4 pages, 5 once it decodes
    b = make_request("b", 8, max_new_tokens=1)  # 2 pages
    s.add(a)
    s.add(b)
    trace = run_to_end(s)
    assert trace == [[("a", 16)], [("a", 1)], [("a", 1)], [("b", 8)]]


def test_without_margin_the_same_requests_run_together():
    s = make_scheduler(num_pages=10, budget=64, safety_margin=0.0)
    s.add(make_request("a", 16, max_new_tokens=3))
    s.add(make_request("b", 8, max_new_tokens=1))
    assert run_to_end(s) == [[("a", 16), ("b", 8)], [("a", 1)], [("a", 1)]]


def test_safety_margin_is_ignored_when_nothing_runs():
    s = make_scheduler(num_pages=10, budget=64, safety_margin=0.5)
    s.add(make_request("a", 32, max_new_tokens=1))  # 8 of 10 pages
    assert run_to_end(s) == [[("a", 32)]]


# --------------------------------------------------------------------------------------- preemption
# NOTE: prefix caching off here, so re-admission is a plain recompute (see the xfail test below).


def test_newest_running_request_is_preempted_when_the_pool_is_exhausted():
    s = make_scheduler(num_pages=6, budget=64, caching=False)
    a, b, c = (make_request(rid, 7, max_new_tokens=4) for rid in "abc")
    for r in (a, b, c):
        s.add(r)
    out, _ = step(s)
    assert chunks(out) == [("a", 7), ("b", 7), ("c", 7)]
    assert (a.page_ids, b.page_ids, c.page_ids) == ([0, 1], [2, 3], [4, 5])
    out, _ = step(s)  # position 7: still inside each second page
    assert chunks(out) == [("a", 1), ("b", 1), ("c", 1)] and not out.preempted
    out, _ = step(s)  # position 8: every request needs a third page, none is free
    assert out.preempted == [c]
    assert chunks(out) == [("a", 1), ("b", 1)]
    # c's pages were freed tail first and went to a, then b
    assert a.page_ids == [0, 1, 5] and b.page_ids == [2, 3, 4]
    assert c.status == RequestStatus.PENDING and c.page_ids == [] and c.num_computed_tokens == 0
    assert c.num_preemptions == 1 and s.num_preemptions == 1
    assert list(s.waiting) == [c] and s.running == [a, b]
    assert c.generated == [7, 7]  # generated tokens are kept: it recomputes prompt + them
    # c waits for a and b, then recomputes its prompt and its 2 tokens in one chunk
    assert run_to_end(s) == [[("a", 1), ("b", 1)], [("c", 9)], [("c", 1)]]
    assert [len(r.generated) for r in (a, b, c)] == [4, 4, 4]


def test_a_request_preempts_itself_when_everything_newer_already_ran_this_step():
    s = make_scheduler(num_pages=4, budget=64, caching=False)
    a = make_request("a", 6, max_new_tokens=2)  # 2 pages, decodes at position 6: no new page
    b = make_request("b", 8, max_new_tokens=2)  # 2 pages, decodes at position 8: needs a third
    s.add(a)
    s.add(b)
    step(s)
    out, finished = step(s)
    assert chunks(out) == [("a", 1)] and out.preempted == [b]
    assert finished == [a]
    assert run_to_end(s) == [[("b", 9)]]
    assert len(b.generated) == 2 and b.num_preemptions == 1


def test_preempted_request_is_readmitted_before_newer_waiting_ones():
    s = make_scheduler(num_pages=4, budget=64, caching=False)
    a = make_request("a", 6, max_new_tokens=2)
    b = make_request("b", 8, max_new_tokens=2)
    s.add(a)
    s.add(b)
    step(s)
    s.add(make_request("late", 3, max_new_tokens=1))
    out, _ = step(s)
    assert out.preempted == [b]
    assert [r.request_id for r in s.waiting][:1] == ["b"]
    assert run_to_end(s)[0][0] == ("b", 9)


# NOTE: a prefix hit on a cached page nobody holds takes that page off the free queue: admission must
# count it as used, or `allocate` runs dry (MemoryError out of `schedule`, found by these two tests).


def test_readmission_counts_its_unreferenced_cached_pages_as_taken():
    s = make_scheduler(num_pages=4, budget=64, caching=True)
    a = make_request("a", 6, max_new_tokens=2)
    b = make_request("b", 8, max_new_tokens=2)
    s.add(a)
    s.add(b)
    step(s)
    out, _ = step(s)  # b preempts itself at position 8; its two cached pages sit in the free queue
    assert out.preempted == [b] and chunks(out) == [("a", 1)]
    # only once a is gone are there pages for b's two cached pages plus a third
    assert run_to_end(s) == [[("b", 1)]]
    assert b.num_cached_tokens == 8


def test_new_request_hitting_freed_cached_pages_in_a_nearly_full_pool():
    s = make_scheduler(num_pages=6, budget=64, caching=True)
    x = make_request("x", 5, max_new_tokens=100)  # holds 2 pages throughout
    a = make_request("a", list(range(10, 18)), max_new_tokens=1)  # 2 full pages, cached, then freed
    s.add(x)
    s.add(a)
    step(s)
    assert a.status == RequestStatus.FINISHED and s.pool.num_free_pages == 4
    # 17 tokens: 5 pages, 2 of them hits on a's freed pages -> really needs all 4 free pages + 1
    s.add(make_request("b", list(range(10, 18)) + list(range(30, 39)), max_new_tokens=1))
    out, _ = step(s)
    assert chunks(out) == [("x", 1)]  # b waits: nothing crashes, no page is handed out twice


# ------------------------------------------------------------------------------- prefix reuse


def test_shared_prefix_request_waits_for_the_pages_in_flight_then_hits_them():
    s = make_scheduler(budget=15)
    prefix = list(range(100, 116))  # 4 full pages
    c = make_request("c", 3, max_new_tokens=1)
    a = make_request("a", prefix + [1, 2, 3, 4], max_new_tokens=3)
    b = make_request("b", prefix + [5, 6, 7, 8], max_new_tokens=2)
    d = make_request("d", 2, max_new_tokens=1)  # unrelated: not held up behind b
    for r in (c, a, b):
        s.add(r)
    out, _ = step(s)
    assert chunks(out) == [("c", 3), ("a", 12)]  # b deferred: its first page is being computed
    assert list(s.waiting) == [b]
    s.add(d)
    out, _ = step(s)
    # a computed pages 0-2; page 3 is still in flight, so b waits once more while d goes ahead
    assert chunks(out) == [("a", 8), ("d", 2)]
    assert list(s.waiting) == [b]
    out, _ = step(s)
    assert chunks(out) == [("a", 1), ("b", 4)]  # b hits the 4 prefix pages = 16 tokens
    assert b.num_cached_tokens == 16 and s.num_cached_prompt_tokens == 16
    assert b.page_ids[:4] == a.page_ids[:4]
    assert [s.pool.ref_counts[blk] for blk in a.page_ids[:4]] == [2, 2, 2, 2]
    assert b.page_ids[4] not in a.page_ids  # the page with its own suffix is b's alone
    run_to_end(s)


@pytest.mark.parametrize("fork_prompts", [True, False])
def test_identical_prompt_is_computed_once(fork_prompts):
    """A group's second sample waits for the first one's prompt, then reuses all of it but the last token
    (forking the leader's pages, or through the prefix cache, which only serves full pages)."""
    s = make_scheduler(budget=15, fork_prompts=fork_prompts)
    prompt = list(range(100, 119))  # 19 tokens: 4 full pages + 3 tokens
    a = make_request("a", prompt, max_new_tokens=3)
    b = make_request("b", prompt, max_new_tokens=2)
    s.add(a)
    s.add(b)
    out, _ = step(s)
    assert chunks(out) == [("a", 15)]
    out, _ = step(s)
    assert chunks(out) == [("a", 4)]
    out, _ = step(s)
    shared = 18 if fork_prompts else 16
    assert chunks(out) == [("a", 1), ("b", 19 - shared)]
    assert b.num_cached_tokens == shared and s.num_cached_prompt_tokens == shared
    assert b.page_ids[:4] == a.page_ids[:4]
    assert b.page_ids[4] != a.page_ids[4]  # the partial page is never shared
    if fork_prompts:
        assert out.copies == [(a.page_ids[4], b.page_ids[4], 2)]  # copy-on-write of its 2 tokens
    run_to_end(s)


def test_prefix_hit_on_freed_pages_after_the_first_request_finished():
    s = make_scheduler(budget=64)
    prompt = list(range(200, 213))  # 13 tokens: 3 full pages
    a = make_request("a", prompt, max_new_tokens=1)
    s.add(a)
    run_to_end(s)
    first_blocks = [0, 1, 2]
    b = make_request("b", prompt, max_new_tokens=2)
    s.add(b)
    out, _ = step(s)
    assert chunks(out) == [("b", 1)]
    assert b.page_ids[:3] == first_blocks and b.num_cached_tokens == 12


def test_no_deferral_and_no_hits_without_prefix_caching_or_forking():
    s = make_scheduler(budget=48, caching=False, fork_prompts=False)
    prompt = list(range(100, 120))
    s.add(make_request("a", prompt, max_new_tokens=1))
    s.add(make_request("b", prompt, max_new_tokens=1))
    out, _ = step(s)
    assert chunks(out) == [("a", 20), ("b", 20)]
    assert s.num_cached_prompt_tokens == 0


def test_reset_prefix_cache_makes_the_next_identical_prompt_miss():
    s = make_scheduler(budget=64)
    prompt = list(range(300, 313))
    s.add(make_request("a", prompt, max_new_tokens=1))
    run_to_end(s)
    s.pool.reset_prefix_cache()
    s.add(make_request("b", prompt, max_new_tokens=1))
    out, _ = step(s)
    assert chunks(out) == [("b", 13)]
    assert s.num_cached_prompt_tokens == 0


# NOTE: regression (livelock): under prefill_first a prompt that cannot fit beside an older decoding
# request used to preempt itself, be re-admitted in the same step and take the whole budget again, so
# the decode never ran, never freed its pages, and the prompt recomputed from scratch forever.
def test_prefill_first_finishes_when_a_prompt_cannot_fit_beside_a_running_decode():
    s = make_scheduler(num_pages=6, budget=2, caching=False, policy="prefill_first")
    s.add(make_request("old", 1, max_new_tokens=6))  # 2 pages at most
    s.add(make_request("long", 13, max_new_tokens=5))  # 5 pages at most: 7 > 6, someone must wait
    run_to_end(s, max_steps=200)


# ------------------------------------------------------------------------------- random workloads


def _shadow_check(out: SchedulerOutput, slots: dict[int, tuple[int, ...]]) -> None:
    """Every KV slot a request reads holds its own token prefix; then write this step's tokens."""
    for sched in out.scheduled:
        req = sched.request
        start, end = req.num_computed_tokens, req.num_computed_tokens + sched.num_new_tokens
        for p in range(start):
            slot = req.page_ids[p // PS] * PS + p % PS
            assert slots.get(slot) == tuple(req.token_ids[: p + 1]), f"{req.request_id} reads stale KV at {p}"
        for p in range(start, end):
            slots[req.page_ids[p // PS] * PS + p % PS] = tuple(req.token_ids[: p + 1])


WORKLOAD = st.lists(
    st.tuples(st.integers(0, 2), st.integers(1, 14), st.integers(1, 6), st.integers(0, 3)),
    min_size=1,
    max_size=10,
)


def _random_workload(workload, num_pages, budget, max_requests, policy, margin, caching):
    s = make_scheduler(
        num_pages,
        budget,
        caching=caching,
        max_requests_per_batch=max_requests,
        policy=policy,
        safety_margin=margin,
    )
    families = {f: [1000 * (f + 1) + i for i in range(12)] for f in range(3)}
    reqs = []
    for i, (family, extra, max_new, arrive_at) in enumerate(workload):
        prompt = families[family][: 4 * family] + [i * 50 + j for j in range(extra)]
        # NOTE: prompt + max_new must fit in the pool (the engine refuses bigger requests at submission)
        max_new = min(max_new, num_pages * PS - len(prompt))
        if max_new < 1:
            continue
        reqs.append((arrive_at, make_request(f"r{i}", prompt, max_new)))
    slots: dict[int, tuple[int, ...]] = {}
    for t in range(300):
        for arrive_at, req in reqs:
            if arrive_at == t:
                s.add(req)
        if not s.has_work() and t > 3:
            break
        out = s.schedule()
        assert out.num_tokens <= budget
        assert len(out.scheduled) <= (max_requests or len(reqs))
        assert len({id(x.request) for x in out.scheduled}) == len(out.scheduled)
        rescheduled = {id(x.request) for x in out.scheduled}
        for victim in out.preempted:  # released, back in the queue (or re-admitted in the same step)
            assert id(victim) in rescheduled or (victim.page_ids == [] and victim in s.waiting)
        _shadow_check(out, slots)
        sampled = [x.request for x in out.scheduled if x.samples]
        s.after_step(out)
        for req in sampled:
            if req.append_token(len(req.token_ids) % 5 + 1, None) is not None:  # its stop reason
                s.remove(req)
                req.status = RequestStatus.FINISHED
        s.pool.check_invariants()
        held = [b for r in s.running for b in r.page_ids]
        assert s.pool.num_free_pages == s.pool.num_pages - len(set(held))
    assert not s.has_work(), "workload did not finish"
    assert all(len(r.generated) == r.max_new_tokens for _, r in reqs)
    assert s.pool.num_free_pages == num_pages


POLICY_ARGS = dict(
    workload=WORKLOAD,
    budget=st.integers(1, 24),
    max_requests=st.sampled_from([None, 1, 3]),
    margin=st.sampled_from([0.0, 0.2]),
    caching=st.booleans(),
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(num_pages=st.integers(6, 16), **POLICY_ARGS)
def test_random_workloads_fifo(workload, num_pages, budget, max_requests, margin, caching):
    """Tight pools: preemption, re-admission, prefix hits on freed pages, deferral, forking."""
    _random_workload(workload, num_pages, budget, max_requests, "fifo", margin, caching)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(num_pages=st.integers(6, 16), **POLICY_ARGS)
def test_random_workloads_prefill_first(workload, num_pages, budget, max_requests, margin, caching):
    _random_workload(workload, num_pages, budget, max_requests, "prefill_first", margin, caching)


def test_drop_kv_frees_every_page_and_recomputes_prompt_plus_generated():
    """`update_weights(..., recompute_kv=True)`: running requests lose their KV, go back to the front of
    the queue in their order (ahead of a request that was waiting), and recompute every token they hold."""
    s = make_scheduler(num_pages=16, budget=64, caching=True)
    a, b = make_request("a", 6, max_new_tokens=8), make_request("b", 5, max_new_tokens=8)
    s.add(a)
    s.add(b)
    step(s)
    step(s)  # each has 2 generated tokens now: 8 and 7 tokens, 7 and 6 computed
    late = make_request("late", 3, max_new_tokens=1)
    s.add(late)
    s.forget_prefixes()  # NOTE: what `EngineCore.reset_prefix_cache` does first on new weights
    s.pool.reset_prefix_cache()
    assert a.stale_kv and b.stale_kv
    assert s.drop_kv() == 2
    assert s.running == [] and [r.request_id for r in s.waiting] == ["a", "b", "late"]
    assert s.pool.num_free_pages == s.pool.num_pages and not s.pool.cached  # every page back, none cached
    assert (a.num_computed_tokens, b.num_computed_tokens, a.stale_kv, b.stale_kv) == (0, 0, False, False)
    out, _ = step(s)
    assert chunks(out) == [("a", 8), ("b", 7), ("late", 3)]  # prompt + generated, then sample again
    assert len(a.generated) == 3 and len(b.generated) == 3
    run_to_end(s)
