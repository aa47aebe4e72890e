"""The manager's pause modes and output listeners, which `rollout serve` is built on (no HTTP here)."""

from __future__ import annotations

import time

import pytest
from support.threads import guarded
from support.tiny_models import hf_greedy, make_model
from transformers import GenerationConfig

from rollout import ContinuousBatchingConfig, ContinuousBatchingManager, RequestStatus

GC = GenerationConfig(do_sample=False, eos_token_id=None, pad_token_id=0, max_new_tokens=8)
LONG = [5] * 12


@pytest.fixture(scope="module")
def model():
    return make_model("qwen3", seed=0)


@pytest.fixture
def manager(model):
    m = ContinuousBatchingManager(model, GC, ContinuousBatchingConfig(page_size=16, num_blocks=64))
    m.start()
    yield m
    m.destroy()


def wait_for(pred, timeout=30.0):
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.005)


def test_keep_freezes_running_holds_new_cancel_of_held_and_resume(manager, model):
    core = manager.core
    long = manager.add_request(LONG, max_new_tokens=500)
    wait_for(lambda: long in core.requests and core.requests[long].generated)
    guarded(lambda: manager.pause("keep"), 30)
    assert manager.is_paused()
    frozen = len(core.requests[long].generated)
    held = manager.add_request([9, 8, 7], max_new_tokens=4)
    short = manager.add_request([1, 2, 3, 4], max_new_tokens=6)
    wait_for(lambda: manager.debug_state()["held"] == 2)  # NOTE: the loop took both in, and held them
    with manager.step_lock:  # no step under way while we look
        assert len(core.requests[long].generated) == frozen and held not in core.requests
    assert manager.cancel_request(held)
    out = guarded(lambda: manager.get_result(held, timeout=10), 20)
    assert out.status == RequestStatus.CANCELLED and out.generated_tokens == []
    manager.resume()
    results = {r: guarded(lambda r=r: manager.get_result(r, timeout=60), 90) for r in (long, short)}
    assert len(results[long].generated_tokens) == 500
    assert results[short].generated_tokens == hf_greedy(model, [1, 2, 3, 4], 6)
    assert core.page_pool.num_free_pages == core.page_pool.num_pages


def test_abort_cancels_live_and_wait_drains(manager):
    long = manager.add_request(LONG, max_new_tokens=500)
    wait_for(lambda: manager.core.requests.get(long) is not None and manager.core.requests[long].generated)
    guarded(lambda: manager.pause("abort"), 30)
    out = guarded(lambda: manager.get_result(long, timeout=10), 20)
    assert out.status == RequestStatus.CANCELLED and 0 < len(out.generated_tokens) < 500
    manager.resume()
    rid = manager.add_request(LONG, max_new_tokens=40)
    guarded(lambda: manager.pause("wait"), 60)
    assert not manager.core.has_work()  # pause("wait") returned after the request finished
    assert guarded(lambda: manager.get_result(rid, timeout=10), 20).finish_reason == "length"
    with pytest.raises(ValueError, match="mode"):
        manager.pause("later")
    manager.resume()


def test_pause_without_a_mode_aborts(manager):
    """The one pause default (`rollout.in_flight.PAUSE_DEFAULT`), as the server's `/pause` and vLLM's."""
    long = manager.add_request(LONG, max_new_tokens=500)
    wait_for(lambda: manager.core.requests.get(long) is not None and manager.core.requests[long].generated)
    guarded(manager.pause, 30)
    assert manager.pause_mode == "abort"
    out = guarded(lambda: manager.get_result(long, timeout=10), 20)
    assert out.status == RequestStatus.CANCELLED and 0 < len(out.generated_tokens) < 500
    with pytest.raises(ValueError, match="'finish' is now 'wait'"):
        manager.pause("finish")
    manager.resume()


def test_stop_while_paused_runs_held_requests(manager):
    manager.pause("keep")
    rid = manager.add_request([3, 4, 5], max_new_tokens=5)
    manager.stop(block=False)
    out = guarded(lambda: manager.get_result(rid, timeout=30), 60)
    assert out.finish_reason == "length" and len(out.generated_tokens) == 5


def test_listener_takes_outputs_so_the_manager_keeps_none(manager):
    seen = []

    def take(out):
        seen.append(out)
        return out.request_id.startswith("mine")

    manager.add_listener(take)
    manager.add_request([1, 2, 3], request_id="mine", max_new_tokens=3, streaming=True)
    other = manager.add_request([1, 2, 3], request_id="other", max_new_tokens=3)
    assert guarded(lambda: manager.get_result(other, timeout=30), 60).finish_reason == "length"
    wait_for(lambda: any(o.request_id == "mine" and o.status.is_final for o in seen))
    assert [len(o.generated_tokens) for o in seen if o.request_id == "mine"] == [1, 2, 3]
    assert manager.get_result("mine", timeout=0) is None and "mine" not in manager.live_request_ids()
    state = manager.debug_state()
    assert not state["results"] and "mine" not in state["streams"]
