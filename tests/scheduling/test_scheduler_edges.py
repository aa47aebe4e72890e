"""Scheduler edges that mutmut found untested (tests/README.md): removing a request that is still waiting,
the bookkeeping `remove` resets, and `peak_used_pages` (logged as `peak_used_pages`)."""

from __future__ import annotations

from support.scheduling import PS, make_request, make_scheduler, step


def test_removing_a_waiting_request_takes_it_out_of_the_queue():
    s = make_scheduler(num_pages=64, budget=8)
    first, second = make_request("a", 8), make_request("b", 8)
    s.add(first)
    s.add(second)
    step(s)  # NOTE: the budget of 8 admits "a" only
    assert first in s.running and second in s.waiting
    s.remove(second)
    assert second not in s.waiting and second not in s.running
    out = s.schedule()
    assert [x.request.request_id for x in out.scheduled] == ["a"]
    s.after_step(out)


def test_remove_releases_the_pages_and_resets_the_registered_count():
    s = make_scheduler(num_pages=16, budget=32)
    req = make_request("a", 3 * PS)
    s.add(req)
    step(s)
    assert req.num_registered_pages > 0 and s.pool.num_free_pages < s.pool.num_pages
    s.remove(req)
    assert req.num_registered_pages == 0 and req.page_ids == []
    assert s.pool.num_free_pages == s.pool.num_pages


def test_peak_used_pages_is_the_most_pages_held_at_once():
    s = make_scheduler(num_pages=32, budget=64)
    a, b = make_request("a", 2 * PS), make_request("b", 3 * PS)
    s.add(a)
    s.add(b)
    step(s)
    held = s.pool.num_pages - s.pool.num_free_pages
    assert held >= 5 and s.peak_used_pages == held
    s.remove(b)
    step(s)
    assert s.peak_used_pages == held  # a peak, not the current use


def test_preemption_counts_accumulate_and_high_water_keeps_the_most_computed():
    s = make_scheduler(num_pages=16, budget=64)
    req = make_request("a", 2 * PS, max_new_tokens=8)
    s.add(req)
    step(s)
    computed = req.num_computed_tokens
    assert computed == 2 * PS
    s.preempt(req)
    assert req.num_computed_tokens == 0 and req.high_water == computed and req in s.waiting  # recompute
    step(s)  # readmitted: the prompt and the sampled token computed again
    s.preempt(req)
    assert s.num_preemptions == 2 and req.num_preemptions == 2
    assert req.high_water == 2 * PS + 1


def test_a_fresh_scheduler_counts_nothing_and_keeps_its_offloader():
    """The counters `cache_stats()` reports start at 0 (a 1 or None there would be logged as is)."""
    offloader = object()
    s = make_scheduler(offloader=offloader)
    assert s.offloader is offloader
    counters = ("num_preemptions", "num_cached_prompt_tokens", "num_offloaded_pages", "num_restored_pages",
                "num_offload_fallbacks", "num_recycled_pages", "peak_used_pages")
    assert {name: getattr(s, name) for name in counters} == dict.fromkeys(counters, 0)
