"""One vocabulary for what requests in flight do (`rollout.in_flight`, issue 39): abort | wait | keep, one default
per operation (pause: abort; weight update: wait) on every layer, and every layer refuses an unknown mode with a
ValueError naming the accepted ones before it does anything. Behaviour of each mode: tests/engine/
test_serve_pause.py, tests/serve/test_serve_control.py, tests/api/test_engine.py, tests/weights/."""

from __future__ import annotations

import inspect

import pytest

from rollout import ContinuousBatchingManager, RolloutEngine
from rollout.client import RolloutClient
from rollout.fleet.pool import RolloutPool
from rollout.in_flight import IN_FLIGHT_MODES, PAUSE_DEFAULT, UPDATE_DEFAULT, check_mode
from rollout.weights.broadcast import WeightBroadcaster

NOWHERE = "http://127.0.0.1:9"  # NOTE: nothing listens there: a call that reached the network would fail otherwise


def test_the_vocabulary_and_its_defaults():
    assert IN_FLIGHT_MODES == ("abort", "wait", "keep")  # vLLM's /pause?mode= spelling, public
    assert (PAUSE_DEFAULT, UPDATE_DEFAULT) == ("abort", "wait")
    for mode in IN_FLIGHT_MODES:
        assert check_mode(mode, "mode") == mode
    with pytest.raises(
        ValueError, match=r"in_flight must be one of 'abort', 'wait', 'keep' \('finish' is now 'wait'\)"
    ):
        check_mode("finish", "in_flight")
    for bad in ("later", None, "", "KEEP", ["keep"]):
        with pytest.raises(ValueError, match=r"mode must be one of 'abort', 'wait', 'keep', got"):
            check_mode(bad, "mode")


@pytest.mark.parametrize(("fn", "param", "default"), [
    (ContinuousBatchingManager.pause, "mode", PAUSE_DEFAULT),
    (RolloutClient.pause, "mode", PAUSE_DEFAULT),
    (RolloutEngine.update_weights, "in_flight", UPDATE_DEFAULT),
    (RolloutPool.update_weights, "in_flight", UPDATE_DEFAULT),
    (RolloutClient.update_weights, "in_flight", UPDATE_DEFAULT),
    (RolloutClient.update_weights_from_disk, "in_flight", UPDATE_DEFAULT),
    (WeightBroadcaster.broadcast, "in_flight", UPDATE_DEFAULT),
    (RolloutEngine.update_lora, "in_flight", UPDATE_DEFAULT),
    (RolloutEngine.remove_lora, "in_flight", UPDATE_DEFAULT),
    (RolloutClient.push_lora, "in_flight", UPDATE_DEFAULT),
    (WeightBroadcaster.broadcast_lora, "in_flight", UPDATE_DEFAULT),
])
def test_one_default_per_operation_on_every_layer(fn, param, default):
    assert inspect.signature(fn).parameters[param].default == default


def test_the_serve_routes_share_the_defaults():
    pytest.importorskip("fastapi")
    from rollout.serve import bridge, control

    assert inspect.signature(control.pause).parameters["mode"].default == PAUSE_DEFAULT
    assert inspect.signature(control.finish_weight_update).parameters["in_flight"].default == UPDATE_DEFAULT
    # NOTE: None there means UPDATE_DEFAULT, unless SGLang's `abort_all_requests` asks for "abort"
    assert inspect.signature(control.update_weights_from_disk).parameters["in_flight"].default is None
    source = inspect.getsource(control.update_weights_from_disk)
    assert 'in_flight or ("abort" if req.abort_all_requests else UPDATE_DEFAULT)' in source
    assert inspect.signature(bridge.EngineBridge.update_weights).parameters["in_flight"].default == UPDATE_DEFAULT


def test_client_and_broadcaster_refuse_an_unknown_mode_before_any_request():
    pytest.importorskip("httpx")
    client = RolloutClient(NOWHERE, timeout=2)
    for call in (lambda: client.pause("finish"), lambda: client.update_weights({}, in_flight="finish"),
                 lambda: client.update_weights_from_disk("/tmp/x", in_flight="later")):
        with pytest.raises(ValueError, match="'abort', 'wait', 'keep'"):
            call()
    assert client.weights is None  # no weight group was formed either
    sync = WeightBroadcaster([NOWHERE], timeout_s=2)
    with pytest.raises(ValueError, match="in_flight must be one of"):
        sync.broadcast({}, in_flight="finish")
    assert sync.group is None
