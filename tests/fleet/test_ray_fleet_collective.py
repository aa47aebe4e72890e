"""The fleet's collective weight path (issue 47 item 2): `RolloutFleet(weight_transfer="collective")` forms one
gloo group (learner rank 0, engine actors 1..N) and each update broadcasts the weights in buckets.

- the group is formed once; each update (several buckets) leaves every engine equal to HF `generate` on the new
  weights, reporting the new version, as the object-store path does;
- an engine killed mid-call after a broadcast update comes back on the broadcast weights (copied from the other
  engine, there is no object-store copy), and the next update forms the group again, with the replacement;
- an engine dead when an update starts, or dying in the middle of the broadcast: that update goes through the
  object store with one warning line, every engine ends on it, the group is formed again at the next one;
- an engine hung (SIGSTOP) when an update starts: killed at the group's ready deadline, the update goes through
  the object store, the replacement starts on it;
- `close()` leaves the group closed, no engine process, no Ray process of the cluster it started.
The fleet starts its own cluster (2 CPUs, 127.0.0.1); the module fixture closes it and checks nothing is left.
"""

from __future__ import annotations

import logging
import os
import threading
import time

import pytest
from support.tiny_models import hf_greedy, make_model

from rollout import ContinuousBatchingConfig, SamplingParams
from rollout.fleet.weight_group import bucket_plan, learner_state, resolve_transfer

pytestmark = pytest.mark.timeout(900)

PROMPTS = [[7, 30, 41, 9, 77, 12], [5, 66, 90, 3], [21, 54, 18, 33, 71], [3, 99, 14], [60, 61, 62, 63, 64]]
ENGINE = dict(page_size=16, num_blocks=256, batch_invariant=True)
MAX_NEW = 12
BUCKET = 64 * 1024  # NOTE: the tiny model in several buckets, one dtype each


def _descendants(pid: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if fields[0] != "Z":
                children.setdefault(int(fields[1]), []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


@pytest.fixture(scope="module")
def fleet_setup(tmp_path_factory):
    ray = pytest.importorskip("ray", reason="Ray fleet tests need ray (pip install -e '.[ray]')")
    if ray.is_initialized():
        pytest.skip("a Ray cluster is already connected in this process; the test starts and stops its own")
    from rollout.fleet import RolloutFleet

    model_dir = tmp_path_factory.mktemp("tiny") / "model"
    make_model("qwen3", seed=0).save_pretrained(model_dir)
    before = set(_descendants(os.getpid()))
    fleet = RolloutFleet(str(model_dir), num_engines=2, engine_config=ContinuousBatchingConfig(**ENGINE),
                         resources_per_engine={"CPU": 1}, num_cpus=2, start_timeout_s=300, request_timeout_s=300,
                         weight_transfer="collective", bucket_bytes=BUCKET, weight_group_timeout_s=60)
    assert fleet.weight_transfer == "collective" and fleet.weight_group.backend == "gloo"
    state = {"model": make_model("qwen3", seed=0), "seed": 10}
    yield fleet, state
    pids = list(fleet.pids)
    fleet.close()
    assert not fleet.weight_group.ready
    assert not ray.is_initialized()
    assert all(_gone(p) for p in pids), "an engine actor outlived close()"
    deadline = time.monotonic() + 30
    while set(_descendants(os.getpid())) - before and time.monotonic() < deadline:
        time.sleep(0.2)
    left = set(_descendants(os.getpid())) - before
    assert not left, f"processes left behind by close(): {sorted(left)}"


def oracle(model, prompts=PROMPTS, max_new: int = MAX_NEW) -> list[list[int]]:
    return [hf_greedy(model, p, max_new) for p in prompts]


def rows(batch) -> list[list[int]]:
    return [batch.completion_ids[r, : int(batch.completion_mask[r].sum())].tolist() for r in range(len(batch))]


def new_weights(state):
    state["seed"] += 1
    return make_model("qwen3", seed=state["seed"])


def assert_every_engine_on(fleet, model, version: int) -> None:
    assert fleet.engine_versions() == [version] * fleet.num_engines
    expected = oracle(model)
    for k, actor in enumerate(fleet.actors):
        greedy = SamplingParams(temperature=0.0, max_tokens=MAX_NEW)
        outs = fleet.ray.get(actor.generate.remote(PROMPTS, [greedy] * 5, 1, 0))
        assert [o.generated_tokens for o in outs] == expected, f"engine {k} is not on the new weights"
        assert all(set(o.versions) == {version} for o in outs)


def test_the_group_is_formed_once_and_each_broadcast_reaches_every_engine(fleet_setup):
    fleet, state = fleet_setup
    assert fleet.weight_group.formed == 1 and fleet.weight_group.ready
    for _ in range(2):
        new = new_weights(state)
        assert oracle(new) != oracle(state["model"])
        plan, _ = bucket_plan(learner_state(new), BUCKET)
        assert len(plan) > 3  # several buckets
        version = fleet.update_weights(new)
        state["model"] = new
        assert version == fleet.policy_version and fleet.last_update_path == "collective"
        assert fleet.last_update_s > 0
        assert_every_engine_on(fleet, new, version)
    assert fleet.weight_group.formed == 1 and version == 2
    batch = fleet.generate(PROMPTS, temps=0.0, max_new_tokens=MAX_NEW)
    assert rows(batch) == oracle(state["model"]) and batch.policy_version == 2


def test_an_engine_killed_after_a_broadcast_comes_back_on_the_broadcast_weights(fleet_setup, caplog):
    fleet, state = fleet_setup
    ray = fleet.ray
    assert fleet.last_update_path == "collective"  # no object-store copy of the current weights
    long_new = 300
    expected = oracle(state["model"], max_new=long_new)
    old_pid = fleet.pids[0]

    def kill_when_busy():
        deadline = time.monotonic() + 60
        while fleet.load[0] == 0 and time.monotonic() < deadline:
            time.sleep(0.005)
        time.sleep(0.05)
        ray.kill(fleet.actors[0], no_restart=False)

    killer = threading.Thread(target=kill_when_busy)
    killer.start()
    batch = fleet.generate(PROMPTS, temps=0.0, max_new_tokens=long_new)
    killer.join(70)
    assert rows(batch) == expected
    assert_every_engine_on(fleet, state["model"], fleet.policy_version)
    assert fleet.pids[0] != old_pid and _gone(old_pid)
    assert fleet.health.infos[0]["restored"] == fleet.policy_version  # copied from engine 1 at its start
    formed = fleet.weight_group.formed
    new = new_weights(state)
    version = fleet.update_weights(new)  # the group again, with the replacement
    state["model"] = new
    assert fleet.last_update_path == "collective" and fleet.weight_group.formed == formed + 1
    assert_every_engine_on(fleet, new, version)


def _fallback_lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "rollout.fleet" and "object store" in r.getMessage()]


def test_an_engine_dead_when_an_update_starts_gets_it_through_the_object_store(fleet_setup, caplog):
    fleet, state = fleet_setup
    old_pid = fleet.pids[1]
    fleet.ray.kill(fleet.actors[1], no_restart=False)  # NOTE: the fleet is not told; Ray restarts it
    deadline = time.monotonic() + 30
    while not _gone(old_pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    new = new_weights(state)
    with caplog.at_level(logging.WARNING, logger="rollout.fleet"):
        version = fleet.update_weights(new)
    state["model"] = new
    assert fleet.last_update_path == "object_store"
    assert len(_fallback_lines(caplog)) == 1, _fallback_lines(caplog)
    assert_every_engine_on(fleet, new, version)
    formed = fleet.weight_group.formed
    new = new_weights(state)
    version = fleet.update_weights(new)
    state["model"] = new
    assert fleet.last_update_path == "collective" and fleet.weight_group.formed == formed + 1
    assert_every_engine_on(fleet, new, version)


def test_an_engine_dying_mid_broadcast_leaves_every_engine_on_the_update(fleet_setup, caplog, monkeypatch):
    fleet, state = fleet_setup
    group, ray = fleet.weight_group, fleet.ray
    flat, sent = group.flat, []
    victim = fleet.pids[0]

    def flat_then_kill(tensors):
        if len(sent) == 1:  # NOTE: after the first bucket went out: engine 0 dies
            ray.kill(fleet.actors[0], no_restart=False)
            deadline = time.monotonic() + 30
            while not _gone(victim) and time.monotonic() < deadline:
                time.sleep(0.05)
        sent.append(len(tensors))
        return flat(tensors)

    monkeypatch.setattr(group, "flat", flat_then_kill)
    new = new_weights(state)
    with caplog.at_level(logging.WARNING, logger="rollout.fleet"):
        start = time.monotonic()
        version = fleet.update_weights(new)
        took = time.monotonic() - start
    monkeypatch.undo()
    state["model"] = new
    assert len(sent) >= 2 and fleet.last_update_path == "object_store", (sent, fleet.last_update_path)
    assert len(_fallback_lines(caplog)) == 1, _fallback_lines(caplog)
    assert took < 120, took  # NOTE: not the group's timeout on each side
    assert_every_engine_on(fleet, new, version)  # engine 1 had half the broadcast: the fallback overwrote it
    version = fleet.update_weights(new_weights(state))
    assert fleet.last_update_path == "collective"


def test_a_hung_engine_at_an_update_is_replaced_and_gets_it(fleet_setup, caplog):
    import signal

    fleet, state = fleet_setup
    hung_pid = fleet.pids[1]
    os.kill(hung_pid, signal.SIGSTOP)  # NOTE: alive but silent: it never enters the update
    fleet.weight_group.ready_timeout_s, ready = 15.0, fleet.weight_group.ready_timeout_s
    new = new_weights(state)
    try:
        with caplog.at_level(logging.WARNING, logger="rollout.fleet"):
            start = time.monotonic()
            version = fleet.update_weights(new)
            took = time.monotonic() - start
    finally:
        fleet.weight_group.ready_timeout_s = ready
        if not _gone(hung_pid):
            os.kill(hung_pid, signal.SIGCONT)
    state["model"] = new
    assert fleet.last_update_path == "object_store" and 15.0 <= took < 15.0 + 60.0, (fleet.last_update_path, took)
    lines = [r.getMessage() for r in caplog.records if r.name == "rollout.fleet"]
    assert any("engine 1 failed (not ready for weight update" in m for m in lines), lines
    assert_every_engine_on(fleet, new, version)  # the replacement started on the object-store copy
    assert fleet.pids[1] != hung_pid and _gone(hung_pid)


def test_auto_takes_the_collective_path():
    assert resolve_transfer("auto", {"CPU": 1}) == ("collective", "gloo")
    assert resolve_transfer("collective", {"CPU": 1}) == ("collective", "gloo")
    assert resolve_transfer("object_store", {"GPU": 1}) == ("object_store", None)
    with pytest.raises(ValueError, match="weight_transfer"):
        resolve_transfer("nccl", {"CPU": 1})
