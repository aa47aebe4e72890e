"""Acceptance tests of `ContinuousBatchingManager` (issue "ContinuousBatchingManager").

Every blocking call on the manager runs under `guarded`, so a hang fails the test instead of CI.
Outputs are checked against `hf_greedy` (plain `model.generate`, no EOS) on a tiny Qwen3.
"""

from __future__ import annotations

import functools
import logging
import math
import time

import pytest
from support.threads import guarded as run_guarded
from support.tiny_models import VOCAB, hf_greedy, make_model, random_prompts
from transformers import GenerationConfig

from rollout import (
    ContinuousBatchingConfig,
    ContinuousBatchingManager,
    GenerationOutput,
    RequestStatus,
    continuous_batching_context_manager,
    init_continuous_batching,
)

ORACLE_TOKENS = 12  # the oracle is computed once per prompt at this length; shorter budgets use a prefix
NUM_BLOCKS = 32
GC = GenerationConfig(max_new_tokens=8, do_sample=False, eos_token_id=None)
TIMEOUT = 60.0


def cbc(num_blocks: int = NUM_BLOCKS, **kw) -> ContinuousBatchingConfig:
    return ContinuousBatchingConfig(page_size=16, num_blocks=num_blocks, **kw)


@pytest.fixture(scope="module")
def model():
    return make_model("qwen3")


@pytest.fixture(scope="module")
def oracle(model):
    @functools.cache
    def full(prompt: tuple[int, ...]) -> tuple[int, ...]:
        return tuple(hf_greedy(model, list(prompt), ORACLE_TOKENS))

    def get(prompt, n: int) -> list[int]:
        assert n <= ORACLE_TOKENS
        return list(full(tuple(prompt))[:n])

    return get


PROMPTS = random_prompts(6, 5, 40, seed=7)


def guarded(fn, timeout: float = TIMEOUT):
    """Run `fn()` on a helper thread; fail the test if it does not return within `timeout` seconds."""
    return run_guarded(fn, timeout)


def drain(manager: ContinuousBatchingManager, timeout: float = TIMEOUT) -> dict[str, GenerationOutput]:
    """`for result in manager`, guarded; asserts no request id is delivered twice."""

    def loop():
        got: dict[str, GenerationOutput] = {}
        for result in manager:
            assert result.request_id not in got, f"{result.request_id} delivered twice"
            assert result.status.is_final, result
            got[result.request_id] = result
        return got

    return guarded(loop, timeout)


def assert_all_free(manager: ContinuousBatchingManager) -> None:
    with manager.step_lock:
        stats = manager.cache_stats()
        manager.core.page_pool.check_invariants()
    assert stats["free_blocks"] == stats["num_blocks"], stats


def wait_until(cond, timeout: float = TIMEOUT, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(0.002)


def generated_so_far(manager: ContinuousBatchingManager, request_id: str) -> int:
    req = manager.core.requests.get(request_id)
    return 0 if req is None else len(req.generated)


def assert_prefix(tokens: list[int], ref: list[int]) -> None:
    assert tokens == ref[: len(tokens)], (tokens, ref)


@pytest.fixture
def manager(model):
    m = init_continuous_batching(model, generation_config=GC, continuous_batching_config=cbc())
    m.start()
    yield m
    m.destroy()  # idempotent


# --------------------------------------------------------------------------- 1. the guide's example
def test_guide_example_terminates_with_greedy_results(model, oracle):
    long_p, short0, short1 = PROMPTS[0], PROMPTS[1], PROMPTS[2]
    budgets = {"long": 12, "short_0": 4, "short_1": 5}
    with continuous_batching_context_manager(model, generation_config=GC,
                                             continuous_batching_config=cbc()) as manager:
        manager.add_request(input_ids=long_p, request_id="long", max_new_tokens=12)
        manager.add_request(input_ids=short0, request_id="short_0", max_new_tokens=4)
        manager.add_request(input_ids=short1, request_id="short_1", max_new_tokens=5)

        results = drain(manager)  # `for result in manager`, must END
        assert_all_free(manager)
    assert set(results) == set(budgets)
    for rid, prompt in (("long", long_p), ("short_0", short0), ("short_1", short1)):
        r = results[rid]
        assert r.status == RequestStatus.FINISHED and r.finish_reason == "length" and r.error is None
        assert r.prompt_ids == prompt
        assert r.generated_tokens == oracle(prompt, budgets[rid])
    assert manager.is_destroyed  # not persistent: destroyed on exit
    with pytest.raises(RuntimeError):
        manager.start()


def test_guide_example_with_default_config(model, oracle):
    """The guide's exact call: no continuous-batching config (cache sized by the engine)."""
    with continuous_batching_context_manager(model, generation_config=GC) as manager:
        ids = manager.add_requests(inputs=PROMPTS[:3], max_new_tokens=4)
        results = drain(manager)
        assert_all_free(manager)
    assert sorted(results) == sorted(ids) and len(ids) == 3
    for rid, prompt in zip(ids, PROMPTS[:3], strict=True):
        assert results[rid].generated_tokens == oracle(prompt, 4)


def test_iteration_without_requests_ends(manager):
    assert drain(manager, timeout=10) == {}
    assert guarded(lambda: manager.get_result(timeout=None), 10) is None


def test_get_result_timeout_returns_none_while_busy(manager):
    rid = manager.add_request(PROMPTS[0], max_new_tokens=8)
    with manager.step_lock:  # the loop cannot step: nothing can finish
        t0 = time.monotonic()
        assert manager.get_result(timeout=0.2) is None
        assert time.monotonic() - t0 < 5
    assert drain(manager)[rid].status == RequestStatus.FINISHED


# --------------------------------------------------------------------------------- 2. streaming
def test_streaming_chunks_grow_and_end_finished(manager, oracle):
    manager.add_request(PROMPTS[3], request_id="other", max_new_tokens=6)
    manager.add_request(PROMPTS[0], request_id="streamed", max_new_tokens=8, streaming=True)
    chunks = guarded(lambda: list(manager.request_id_iter(request_id="streamed")))
    ref = oracle(PROMPTS[0], 8)
    assert [len(c.generated_tokens) for c in chunks] == list(range(1, 9))
    for c in chunks[:-1]:
        assert not c.status.is_final and c.finish_reason is None
        assert_prefix(c.generated_tokens, ref)
    assert chunks[-1].status == RequestStatus.FINISHED and chunks[-1].finish_reason == "length"
    assert chunks[-1].generated_tokens == ref
    # the streamed request's final result was consumed by its iterator; "other" is still there
    other = guarded(lambda: manager.get_result(request_id="other"))
    assert other.generated_tokens == oracle(PROMPTS[3], 6)
    assert drain(manager) == {}
    assert_all_free(manager)


def test_get_result_filter_leaves_other_results(manager, oracle):
    with manager.step_lock:  # one batch: r0 finishes first, r2 last
        for i in range(3):
            manager.add_request(PROMPTS[i], request_id=f"r{i}", max_new_tokens=4 + i)
    r2 = guarded(lambda: manager.get_result(request_id="r2"))  # r0 and r1 are done by now
    assert r2.request_id == "r2" and r2.generated_tokens == oracle(PROMPTS[2], 6)
    r1 = guarded(lambda: manager.get_result(request_id="r1", timeout=0))
    assert r1 is not None and r1.generated_tokens == oracle(PROMPTS[1], 5)
    assert guarded(lambda: manager.get_result(request_id="r1", timeout=0.1)) is None  # delivered once
    rest = drain(manager)
    assert list(rest) == ["r0"] and rest["r0"].generated_tokens == oracle(PROMPTS[0], 4)
    assert manager.get_result(timeout=0) is None
    assert_all_free(manager)


def test_request_id_reuse_after_streaming_sees_only_new_request(manager, oracle):
    """A streaming request consumed through `for result in manager` must not leave stale chunks behind
    for a later request with the same id."""
    manager.add_request(PROMPTS[0], request_id="x", max_new_tokens=4, streaming=True)
    first = drain(manager)
    assert first["x"].generated_tokens == oracle(PROMPTS[0], 4)
    manager.add_request(PROMPTS[1], request_id="x", max_new_tokens=3)
    chunks = guarded(lambda: list(manager.request_id_iter("x")))
    assert len(chunks) == 1, [c.generated_tokens for c in chunks]
    assert chunks[0].prompt_ids == PROMPTS[1] and chunks[0].generated_tokens == oracle(PROMPTS[1], 3)
    assert drain(manager) == {}


# ----------------------------------------------------------------------------------- 3. cancel
def test_cancel_active_request_delivers_one_cancelled_result(manager, oracle):
    rid = manager.add_request(PROMPTS[0], request_id="long", max_new_tokens=300)
    keep = manager.add_request(PROMPTS[1], request_id="keep", max_new_tokens=6)
    wait_until(lambda: generated_so_far(manager, rid) >= 2, what="long to decode")
    assert manager.cancel_request(request_id=rid) is True
    results = drain(manager)
    assert sorted(results) == ["keep", "long"]
    r = results["long"]
    assert r.status == RequestStatus.CANCELLED and r.finish_reason == "cancelled"
    assert 2 <= len(r.generated_tokens) < 300
    assert_prefix(r.generated_tokens[:ORACLE_TOKENS], oracle(PROMPTS[0], ORACLE_TOKENS))
    assert results[keep].generated_tokens == oracle(PROMPTS[1], 6)
    assert manager.cancel_request(rid) is False  # no longer live
    assert manager.get_result(timeout=0) is None
    assert_all_free(manager)


def test_cancel_queued_and_streaming_requests(manager, oracle):
    with manager.step_lock:  # nothing runs: the request is still queued when cancelled
        q = manager.add_request(PROMPTS[2], request_id="queued", max_new_tokens=300)
        s = manager.add_request(PROMPTS[3], request_id="s", max_new_tokens=300, streaming=True)
        assert manager.cancel_request(q)
    assert manager.cancel_request("no-such-request") is False
    it = manager.request_id_iter(s)
    first = guarded(lambda: next(it))
    assert not first.status.is_final
    assert manager.cancel_request(s)
    rest = guarded(lambda: list(it))
    assert rest[-1].status == RequestStatus.CANCELLED
    assert all(not c.status.is_final for c in rest[:-1])
    results = drain(manager)
    assert list(results) == ["queued"]
    assert results["queued"].status == RequestStatus.CANCELLED
    assert len(results["queued"].generated_tokens) <= 1  # at most the one step that may have run
    assert_all_free(manager)
    # the manager keeps serving
    rid = manager.add_request(PROMPTS[2], max_new_tokens=5)
    assert drain(manager)[rid].generated_tokens == oracle(PROMPTS[2], 5)


# ------------------------------------------------------------------------------- 3. lifecycle
def test_hard_stop_fails_queued_and_active_keeping_partial_tokens(manager, oracle, caplog):
    manager.add_request(PROMPTS[0], request_id="active", max_new_tokens=300, streaming=True)
    it = manager.request_id_iter("active")
    guarded(lambda: [next(it), next(it)])  # two tokens generated: it is active
    with manager.step_lock:
        queued = [manager.add_request(p, max_new_tokens=8) for p in PROMPTS[1:4]]
        manager.stop(hard_stop=True, block=False)
    guarded(lambda: manager.stop(hard_stop=True))  # join
    assert not manager.is_running()
    final = guarded(lambda: list(it))[-1]
    assert final.status == RequestStatus.FAILED and final.finish_reason == "error"
    assert "hard_stop" in final.error
    assert 2 <= len(final.generated_tokens) < 300
    assert_prefix(final.generated_tokens[:ORACLE_TOKENS], oracle(PROMPTS[0], ORACLE_TOKENS))
    results = drain(manager)
    assert sorted(results) == sorted(queued)
    for rid, prompt in zip(queued, PROMPTS[1:4], strict=True):
        r = results[rid]
        assert r.status == RequestStatus.FAILED and "hard_stop" in r.error
        assert_prefix(r.generated_tokens, oracle(prompt, 8))
    assert_all_free(manager)

    # stopped: refuses new work with a warning
    with caplog.at_level(logging.WARNING, logger="rollout"):
        caplog.clear()
        assert manager.add_request(PROMPTS[0], max_new_tokens=4) is None
        assert manager.add_requests(PROMPTS[:2], max_new_tokens=4) == []
    assert any(rec.levelno == logging.WARNING and "stop" in rec.getMessage() for rec in caplog.records)
    assert manager.cancel_request("active") is False

    # start() runs another session
    manager.start()
    rid = manager.add_request(PROMPTS[4], max_new_tokens=7)
    assert drain(manager)[rid].generated_tokens == oracle(PROMPTS[4], 7)
    assert_all_free(manager)

    manager.stop()
    manager.destroy()
    with pytest.raises(RuntimeError):
        manager.start()
    assert manager.add_request(PROMPTS[0]) is None


def test_drain_stop_finishes_queued_and_active(manager, oracle):
    ids = [manager.add_request(p, max_new_tokens=6) for p in PROMPTS[:4]]
    guarded(lambda: manager.stop())  # drains
    assert not manager.is_running()
    results = drain(manager)
    assert sorted(results) == sorted(ids)
    for rid, prompt in zip(ids, PROMPTS[:4], strict=True):
        assert results[rid].status == RequestStatus.FINISHED
        assert results[rid].generated_tokens == oracle(prompt, 6)
    assert_all_free(manager)


def test_start_right_after_non_blocking_stop_accepts_work(manager, oracle):
    """`stop(block=False)` then `start()`: the new session must accept requests."""
    ids = [manager.add_request(p, max_new_tokens=6) for p in PROMPTS[:3]]
    manager.stop(block=False)
    manager.start()
    rid = manager.add_request(PROMPTS[3], max_new_tokens=5)
    assert rid is not None
    results = drain(manager)
    assert sorted(results) == sorted([*ids, rid])
    assert results[rid].generated_tokens == oracle(PROMPTS[3], 5)
    for i, prompt in zip(ids, PROMPTS[:3], strict=True):
        assert results[i].generated_tokens == oracle(prompt, 6)
    assert_all_free(manager)


def test_persistent_manager_is_reused_and_honours_new_generation_config(model, oracle):
    cfg = cbc()
    ref = oracle(PROMPTS[5], ORACLE_TOKENS)
    with continuous_batching_context_manager(model, generation_config=GC, continuous_batching_config=cfg,
                                             persistent_manager=True) as m1:
        m1.add_request(PROMPTS[5], request_id="a")  # default max_new_tokens=8
        assert drain(m1)["a"].generated_tokens == ref[:8]
    try:
        assert not m1.is_destroyed and not m1.is_running()
        assert_all_free(m1)
        gc3 = GenerationConfig(max_new_tokens=3, do_sample=False, eos_token_id=None)
        with continuous_batching_context_manager(model, generation_config=gc3, continuous_batching_config=cfg,
                                                 persistent_manager=True) as m2:
            assert m2 is m1
            m2.add_request(PROMPTS[5], request_id="a")
            assert drain(m2)["a"].generated_tokens == ref[:3]
        eos = ref[4]
        stop_at = ref.index(eos) + 1
        gc_eos = GenerationConfig(max_new_tokens=10, do_sample=False, eos_token_id=eos)
        with continuous_batching_context_manager(model, generation_config=gc_eos, continuous_batching_config=cfg,
                                                 persistent_manager=True) as m3:
            assert m3 is m1
            m3.add_request(PROMPTS[5], request_id="a")
            r = drain(m3)["a"]
        assert r.generated_tokens == ref[:stop_at]
        assert r.finish_reason == ("stop" if stop_at < 10 else "length")
        assert_all_free(m1)
    finally:
        m1.destroy()


# ------------------------------------------------------------------------------ 4. bad input
BAD_INPUTS = [
    pytest.param(dict(input_ids=[]), "input_ids", id="empty-prompt"),
    pytest.param(dict(input_ids=[3, VOCAB]), "input_ids", id="token-id-too-large"),
    pytest.param(dict(input_ids=[3, -1]), "input_ids", id="negative-token-id"),
    pytest.param(dict(max_new_tokens=0), "max_new_tokens", id="max-new-tokens-0"),
    pytest.param(dict(max_new_tokens=-2), "max_new_tokens", id="max-new-tokens-negative"),
    pytest.param(dict(input_ids=[5] * 1000, max_new_tokens=30), "context", id="beyond-context"),
    pytest.param(dict(input_ids=[5] * 1025, max_new_tokens=1), "context", id="prompt-beyond-context"),
    pytest.param(dict(temperature=math.nan), "temperature", id="nan-temperature"),
    pytest.param(dict(temperature=-0.5), "temperature", id="negative-temperature"),
    pytest.param(dict(top_p=0.0), "top_p", id="top-p-0"),
    pytest.param(dict(top_p=1.5), "top_p", id="top-p-1.5"),
    pytest.param(dict(top_k=-1), "top_k", id="top-k-negative"),
]


@pytest.mark.parametrize(("kwargs", "field"), BAD_INPUTS)
def test_bad_input_is_refused_naming_the_field(model, oracle, kwargs, field):
    # a big enough cache that only the context check can refuse the long prompts
    m = init_continuous_batching(model, generation_config=GC, continuous_batching_config=cbc(num_blocks=80))
    m.start()
    try:
        args = dict(input_ids=PROMPTS[0], max_new_tokens=4) | kwargs
        with pytest.raises(ValueError, match=field):
            m.add_request(request_id="bad", **args)
        rid = m.add_request(PROMPTS[1], request_id="bad", max_new_tokens=5)  # the id was not taken
        results = drain(m)
        assert list(results) == [rid]
        assert results[rid].generated_tokens == oracle(PROMPTS[1], 5)
        assert_all_free(m)
    finally:
        m.destroy()


def test_add_requests_with_one_bad_input_queues_nothing(manager, oracle):
    """A batch holding one bad prompt is refused as a whole: no request of it runs or delivers."""
    with pytest.raises(ValueError, match="input_ids"):
        manager.add_requests([PROMPTS[0], PROMPTS[1], [VOCAB - 1, VOCAB + 5]], max_new_tokens=4)  # sorts last
    with pytest.raises(ValueError, match="top_p"):
        manager.add_requests(PROMPTS[:2], max_new_tokens=4, top_p=2.0)
    assert drain(manager) == {}
    ids = manager.add_requests(PROMPTS[:2], max_new_tokens=4)
    results = drain(manager)
    assert sorted(results) == sorted(ids)
    for rid, prompt in zip(ids, PROMPTS[:2], strict=True):
        assert results[rid].generated_tokens == oracle(prompt, 4)
    assert_all_free(manager)


def test_duplicate_live_request_id_is_refused(manager, oracle):
    with manager.step_lock:
        manager.add_request(PROMPTS[0], request_id="dup", max_new_tokens=4)
        with pytest.raises(ValueError, match="request_id"):
            manager.add_request(PROMPTS[1], request_id="dup", max_new_tokens=4)
    wait_until(lambda: "dup" not in manager.core.requests, what="dup to finish")
    # finished but not yet delivered: still live
    with pytest.raises(ValueError, match="request_id"):
        manager.add_request(PROMPTS[1], request_id="dup", max_new_tokens=4)
    results = drain(manager)
    assert results["dup"].generated_tokens == oracle(PROMPTS[0], 4)
    # delivered: the id may be used again
    manager.add_request(PROMPTS[1], request_id="dup", max_new_tokens=4)
    assert drain(manager)["dup"].generated_tokens == oracle(PROMPTS[1], 4)


def test_oversized_request_fails_alone(model, oracle):
    m = init_continuous_batching(model, generation_config=GC, continuous_batching_config=cbc(num_blocks=4))
    m.start()
    try:
        a = m.add_request(PROMPTS[1][:20], max_new_tokens=8)
        with pytest.raises(ValueError, match="num_blocks|pages"):
            m.add_request([7] * 60, request_id="huge", max_new_tokens=10)  # 70 tokens > 4 pages of 16
        b = m.add_request(PROMPTS[2][:20], max_new_tokens=8)
        results = drain(m)
        assert sorted(results) == sorted([a, b])
        assert results[a].generated_tokens == oracle(PROMPTS[1][:20], 8)
        assert results[b].generated_tokens == oracle(PROMPTS[2][:20], 8)
        assert_all_free(m)
    finally:
        m.destroy()


def test_requests_larger_than_free_cache_complete_in_turn(model, oracle):
    """Each request fits the cache alone, not all together: they wait or are preempted, and finish right."""
    m = init_continuous_batching(model, generation_config=GC, continuous_batching_config=cbc(num_blocks=4))
    m.start()
    try:
        prompts = [random_prompts(1, 38, 40, seed=s)[0] for s in range(3)]  # 3 pages each with 10 new
        ids = [m.add_request(p, max_new_tokens=10) for p in prompts]
        results = drain(m)
        for rid, p in zip(ids, prompts, strict=True):
            assert results[rid].status == RequestStatus.FINISHED
            assert results[rid].generated_tokens == oracle(p, 10)
        assert_all_free(m)
    finally:
        m.destroy()


# ---------------------------------------------------------------------------------- 4. faults
def test_forward_raising_once_fails_only_that_steps_requests(manager, oracle, monkeypatch):
    runner = manager.core.runner
    real = runner.execute
    calls = {"n": 0}
    failed_step: list[str] = []

    def flaky(out):
        calls["n"] += 1
        if calls["n"] == 3:
            failed_step.extend(s.request.request_id for s in out.scheduled)
            raise RuntimeError("injected forward failure")
        return real(out)

    monkeypatch.setattr(runner, "execute", flaky)
    with manager.step_lock:  # submit the first batch together
        ids = [manager.add_request(p, max_new_tokens=8) for p in PROMPTS[:3]]
    late = manager.add_request(PROMPTS[3], max_new_tokens=8)
    results = drain(manager)
    assert failed_step, "the injected failure did not happen"
    for rid, prompt in zip([*ids, late], PROMPTS[:4], strict=True):
        r = results[rid]
        if rid in failed_step:
            assert r.status == RequestStatus.FAILED and r.finish_reason == "error"
            assert "injected forward failure" in r.error
            assert_prefix(r.generated_tokens, oracle(prompt, 8))
        else:
            assert r.status == RequestStatus.FINISHED, r
            assert r.generated_tokens == oracle(prompt, 8)
    assert_all_free(manager)
    after = [manager.add_request(p, max_new_tokens=8) for p in PROMPTS[:3]]
    results = drain(manager)
    for rid, prompt in zip(after, PROMPTS[:3], strict=True):
        assert results[rid].generated_tokens == oracle(prompt, 8)
    assert_all_free(manager)


def test_exception_inside_a_layer_fails_step_and_later_requests_are_correct(manager, oracle, monkeypatch):
    """Raise from inside the model after the first layer wrote its KV: nothing stale may be reused."""
    calls = {"n": 0}
    seen: list[list[str]] = []
    layer = manager.core.view.model.layers[1]
    real_execute = manager.core.runner.execute

    def recording(out):
        seen.append([s.request.request_id for s in out.scheduled])
        return real_execute(out)

    def hook(module, args, kwargs):
        calls["n"] += 1
        if calls["n"] == 1:  # the first prefill
            raise RuntimeError("injected layer failure")

    monkeypatch.setattr(manager.core.runner, "execute", recording)
    handle = layer.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        # same prompts twice: the second round would hit the prefix cache of the failed round's pages
        with manager.step_lock:
            first = [manager.add_request(p, max_new_tokens=6) for p in PROMPTS[:2]]
        results = drain(manager)
        failed = set(seen[0])
        for rid, prompt in zip(first, PROMPTS[:2], strict=True):
            r = results[rid]
            if rid in failed:
                assert r.status == RequestStatus.FAILED and "injected layer failure" in r.error
            else:
                assert r.generated_tokens == oracle(prompt, 6)
        assert failed
        second = [manager.add_request(p, max_new_tokens=6) for p in PROMPTS[:2]]
        results = drain(manager)
        for rid, prompt in zip(second, PROMPTS[:2], strict=True):
            assert results[rid].generated_tokens == oracle(prompt, 6)
        assert_all_free(manager)
    finally:
        handle.remove()


def test_scheduler_exception_fails_live_requests_and_keeps_serving(manager, oracle, monkeypatch):
    sched = manager.core.scheduler
    real = sched.schedule
    calls = {"n": 0}

    def flaky():
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("injected scheduler failure")
        return real()

    monkeypatch.setattr(sched, "schedule", flaky)
    ids = [manager.add_request(p, max_new_tokens=8) for p in PROMPTS[:2]]
    results = drain(manager)
    assert sorted(results) == sorted(ids)
    assert any(r.status == RequestStatus.FAILED and "injected scheduler failure" in r.error
               for r in results.values())
    for rid, prompt in zip(ids, PROMPTS[:2], strict=True):
        if results[rid].status == RequestStatus.FINISHED:
            assert results[rid].generated_tokens == oracle(prompt, 8)
        else:
            assert_prefix(results[rid].generated_tokens, oracle(prompt, 8))
    assert_all_free(manager)
    rid = manager.add_request(PROMPTS[2], max_new_tokens=8)
    assert drain(manager)[rid].generated_tokens == oracle(PROMPTS[2], 8)
    assert_all_free(manager)

