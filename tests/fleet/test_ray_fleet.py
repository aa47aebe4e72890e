"""Rollout fleets on Ray (issue 47): `RolloutFleet` places engine actors on a local Ray cluster (CPU) and offers the
RolloutEngine API.

- two engine actors give greedy rows equal to HF `generate`, whichever engine ran each group;
- seeded samples equal the in-process engine's, bit for bit (both batch-invariant), though the call is split;
- after `update_weights` every engine equals HF on the new weights and reports the new version;
- an actor killed mid-call: the call completes, exact, the replacement serves the current weights, one log line;
- a hung engine (SIGSTOP) is dropped at its shard's deadline: the call completes on the other, the actor replaced;
- `close()` leaves no engine process, no Ray process of the cluster it started;
- without Ray, building a fleet raises an ImportError naming the `[ray]` extra.
Weights go through the object store here (`weight_transfer="object_store"`); the collective path, the default,
is tested in test_ray_fleet_collective.py. The fleet starts its own cluster (2 CPUs, 127.0.0.1); the module fixture
closes it and checks nothing is left.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time

import pytest
import torch
from support.tiny_models import hf_greedy, make_model

from rollout import ContinuousBatchingConfig, RolloutEngine, SamplingParams
from rollout.fleet.shards import plan_shards

pytestmark = pytest.mark.timeout(600)

PROMPTS = [[7, 30, 41, 9, 77, 12], [5, 66, 90, 3], [21, 54, 18, 33, 71], [3, 99, 14], [60, 61, 62, 63, 64]]
ENGINE = dict(page_size=16, num_blocks=256, batch_invariant=True)
MAX_NEW = 12
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW)  # NOTE: what EngineWorker.generate takes per prompt


def _descendants(pid: int) -> list[int]:
    """Live processes under `pid` (from /proc)."""
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


@pytest.fixture(scope="module")
def fleet_setup(tmp_path_factory):
    ray = pytest.importorskip("ray", reason="Ray fleet tests need ray (pip install -e '.[ray]')")
    if ray.is_initialized():
        pytest.skip("a Ray cluster is already connected in this process; the test starts and stops its own")
    from rollout.fleet import RolloutFleet

    model_dir = tmp_path_factory.mktemp("tiny") / "model"
    make_model("qwen3", seed=0).save_pretrained(model_dir)  # NOTE: no tokenizer: no EOS, HF greedy is the oracle
    before = set(_descendants(os.getpid()))
    fleet = RolloutFleet(str(model_dir), num_engines=2, engine_config=ContinuousBatchingConfig(**ENGINE),
                         resources_per_engine={"CPU": 1}, num_cpus=2, start_timeout_s=300, request_timeout_s=300,
                         weight_transfer="object_store")  # NOTE: the collective path: test_ray_fleet_collective.py
    assert fleet.started_ray and len(fleet.actors) == 2 and len(set(fleet.pids)) == 2
    state = {"model": make_model("qwen3", seed=0)}  # the oracle: the weights the fleet holds now
    yield fleet, model_dir, state
    pids = list(fleet.pids)
    fleet.close()
    assert not ray.is_initialized()
    assert all(_gone(p) for p in pids), "an engine actor outlived close()"
    deadline = time.monotonic() + 30
    while set(_descendants(os.getpid())) - before and time.monotonic() < deadline:
        time.sleep(0.2)
    left = set(_descendants(os.getpid())) - before
    assert not left, f"processes left behind by close(): {sorted(left)}"


def rows(batch) -> list[list[int]]:
    return [batch.completion_ids[r, : int(batch.completion_mask[r].sum())].tolist() for r in range(len(batch))]


def greedy_oracle(model, prompts, max_new: int, group: int = 1) -> list[list[int]]:
    return [hf_greedy(model, p, max_new) for p in prompts for _ in range(group)]


def test_two_engines_give_greedy_rows_equal_to_hf_generate(fleet_setup):
    fleet, _, state = fleet_setup
    batch = fleet.generate(PROMPTS, temps=0.0, group_size=2, max_new_tokens=MAX_NEW)
    assert batch.group_ids.tolist() == [i for i in range(len(PROMPTS)) for _ in range(2)]
    assert rows(batch) == greedy_oracle(state["model"], PROMPTS, MAX_NEW, group=2)
    assert batch.policy_version == 0 and int(batch.versions.max()) == 0
    # each engine on its own (both served a shard of the call above: 5 groups over 2 idle engines)
    ray = fleet.ray
    for actor in fleet.actors:
        outs = ray.get(actor.generate.remote(PROMPTS[:2], [GREEDY] * 2, 1, 0))
        assert [o.generated_tokens for o in outs] == greedy_oracle(state["model"], PROMPTS[:2], MAX_NEW)


def test_seeded_samples_equal_the_in_process_engine(fleet_setup):
    fleet, model_dir, _ = fleet_setup
    from transformers import AutoModelForCausalLM

    temps = [1.0, 0.7, 1.3, 1.0, 0.9]
    batch = fleet.generate(PROMPTS, temps=temps, group_size=3, max_new_tokens=MAX_NEW, seed=11)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    with RolloutEngine(model, config=ContinuousBatchingConfig(**ENGINE)) as engine:
        ref = engine.generate(PROMPTS, temps=temps, group_size=3, max_new_tokens=MAX_NEW, seed=11)
    assert rows(batch) == rows(ref)
    assert torch.equal(batch.logprobs, ref.logprobs)
    other = fleet.generate(PROMPTS, temps=temps, group_size=3, max_new_tokens=MAX_NEW, seed=12)
    assert rows(other) != rows(batch)  # a seed is not ignored


def test_sessions_keep_their_groups_on_one_engine(fleet_setup, monkeypatch):
    """`session_ids`: a session's groups run on the engine that took its first one, seeded as the call's groups they
    are (the same rows as without sessions); `finish_session` forgets the engine."""
    fleet, _, _ = fleet_setup
    from rollout.fleet import ray_fleet, sessions

    placed = []

    def spy(*args):
        placed.append(sessions.place_sessions(*args))
        return placed[-1]

    monkeypatch.setattr(ray_fleet, "place_sessions", spy)
    batch = fleet.generate(PROMPTS, temps=1.0, group_size=2, max_new_tokens=MAX_NEW, seed=5,
                           session_ids=["a", "b", "a", "b", "a"])
    plain = fleet.generate(PROMPTS, temps=1.0, group_size=2, max_new_tokens=MAX_NEW, seed=5)
    assert rows(batch) == rows(plain)
    (first,) = placed
    assert first[0] == first[2] == first[4] != first[1] == first[3]
    assert fleet.sessions.members == {"a": first[0], "b": first[1]}
    fleet.generate(PROMPTS[:2], temps=1.0, max_new_tokens=2, session_ids=["b", "a"])  # later turns: same engines
    assert placed[-1] == [first[1], first[0]]
    fleet.finish_session("a")
    assert fleet.sessions.members == {"b": first[1]}


def test_fleet_batches_carry_sampling_masks(fleet_setup):
    """`SamplingParams(return_sampling_mask=True)` through the fleet: `batch.sampling_masks`, one top-k-wide mask per
    token, each holding its token."""
    fleet, _, _ = fleet_setup
    from rollout import SamplingParams

    sp = SamplingParams(temperature=1.0, top_k=3, seed=2, max_tokens=MAX_NEW, return_sampling_mask=True)
    batch = fleet.generate(PROMPTS, group_size=2, sampling=sp)
    assert len(batch.sampling_masks) == 2 * len(PROMPTS)
    for tokens, masks in zip(rows(batch), batch.sampling_masks, strict=True):
        assert len(masks) == len(tokens) and all(len(m) == 3 and t in m for t, m in zip(tokens, masks, strict=True))


def test_update_weights_reaches_every_engine(fleet_setup):
    fleet, _, state = fleet_setup
    new = make_model("qwen3", seed=5)
    assert greedy_oracle(new, PROMPTS, MAX_NEW) != greedy_oracle(state["model"], PROMPTS, MAX_NEW)
    version = fleet.update_weights(new)
    state["model"] = new
    assert version == 1 == fleet.policy_version
    assert fleet.engine_versions() == [1, 1]
    ray = fleet.ray
    for actor in fleet.actors:
        outs = ray.get(actor.generate.remote(PROMPTS, [GREEDY] * 5, 1, 0))
        assert [o.generated_tokens for o in outs] == greedy_oracle(new, PROMPTS, MAX_NEW)
        assert all(set(o.versions) == {1} for o in outs)
    batch = fleet.generate(PROMPTS, temps=0.0, max_new_tokens=MAX_NEW)
    assert rows(batch) == greedy_oracle(new, PROMPTS, MAX_NEW) and batch.policy_version == 1


def test_score_equals_teacher_forced_logprobs_of_the_current_weights(fleet_setup):
    fleet, _, state = fleet_setup
    from support.tiny_models import teacher_forced_logprobs

    completions = [[3, 4, 5], [9, 8], [1, 2, 3, 4], [70], [5, 6]]
    scored = fleet.score(PROMPTS, completions)
    for i, (p, c) in enumerate(zip(PROMPTS, completions, strict=True)):
        torch.testing.assert_close(scored.logprobs[i, : len(c)], teacher_forced_logprobs(state["model"], p, c),
                                   atol=1e-4, rtol=0)
        assert int(scored.mask[i].sum()) == len(c)


def test_an_engine_killed_mid_call_is_replaced_and_its_groups_resubmitted(fleet_setup, caplog):
    fleet, _, state = fleet_setup
    ray = fleet.ray
    long_new = 300  # NOTE: long enough that the kill lands while engine 0 is generating its shard
    expected = greedy_oracle(state["model"], PROMPTS, long_new)
    old_pid = fleet.pids[0]
    restarts, resubmitted = fleet.restarts, fleet.resubmitted
    killed = threading.Event()

    def kill_when_busy():
        deadline = time.monotonic() + 60
        while fleet.load[0] == 0 and time.monotonic() < deadline:
            time.sleep(0.005)
        time.sleep(0.05)
        ray.kill(fleet.actors[0], no_restart=False)  # NOTE: as the OOM killer or a lost node would
        killed.set()

    killer = threading.Thread(target=kill_when_busy)
    killer.start()
    with caplog.at_level(logging.WARNING, logger="rollout.fleet"):
        batch = fleet.generate(PROMPTS, temps=0.0, max_new_tokens=long_new)
    killer.join(70)
    assert killed.is_set()
    assert rows(batch) == expected  # the call completed, exact
    assert fleet.restarts == restarts + 1 and fleet.resubmitted == resubmitted + 1
    lines = [r for r in caplog.records if r.name == "rollout.fleet" and "failed" in r.getMessage()]
    assert len(lines) == 1, [r.getMessage() for r in lines]
    # the replacement: a new process, on the current weights and version before it serves anything
    assert fleet.engine_versions() == [fleet.policy_version] * 2
    assert fleet.pids[0] != old_pid and _gone(old_pid)
    outs = ray.get(fleet.actors[0].generate.remote(PROMPTS, [GREEDY] * 5, 1, 0))
    assert [o.generated_tokens for o in outs] == greedy_oracle(state["model"], PROMPTS, MAX_NEW)


def test_a_hung_engine_is_dropped_at_its_deadline_and_replaced(fleet_setup, caplog):
    fleet, _, state = fleet_setup
    import signal

    hung_pid = fleet.pids[1]
    os.kill(hung_pid, signal.SIGSTOP)  # NOTE: alive but silent, as a wedged engine
    fleet.request_timeout_s, timeout = 20.0, fleet.request_timeout_s
    try:
        with caplog.at_level(logging.WARNING, logger="rollout.fleet"):
            start = time.monotonic()
            batch = fleet.generate(PROMPTS, temps=0.0, max_new_tokens=MAX_NEW)
            took = time.monotonic() - start
    finally:
        fleet.request_timeout_s = timeout
        if not _gone(hung_pid):
            os.kill(hung_pid, signal.SIGCONT)
    assert rows(batch) == greedy_oracle(state["model"], PROMPTS, MAX_NEW)  # its groups ran on engine 0
    assert 20.0 <= took < 20.0 + 120.0
    lines = [r.getMessage() for r in caplog.records if r.name == "rollout.fleet" and "failed" in r.getMessage()]
    assert len(lines) == 1 and "engine 1" in lines[0] and "no answer within 20 s" in lines[0], lines
    assert fleet.engine_versions() == [fleet.policy_version] * 2  # the replacement is up, on the current weights
    assert fleet.pids[1] != hung_pid and _gone(hung_pid)


def _gone(pid: int) -> bool:
    """No such process, or only its zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def test_shards_are_contiguous_and_go_to_the_least_loaded_engines():
    assert plan_shards(5, [0, 0], [0, 1]) == [(0, 0, 3), (1, 3, 5)]
    assert plan_shards(4, [3, 0], [0, 1]) == [(0, 0, 1), (1, 1, 4)]  # engine 0 is busy: it gets less
    assert plan_shards(3, [0, 0, 0], [0, 2]) == [(0, 0, 2), (2, 2, 3)]  # engine 1 is dead: never planned
    assert plan_shards(0, [0], [0]) == []


def test_without_ray_the_fleet_names_the_extra(monkeypatch):
    from rollout.fleet import RolloutFleet

    monkeypatch.setitem(sys.modules, "ray", None)  # NOTE: `import ray` raises ImportError
    with pytest.raises(ImportError, match=r"\[ray\]"):
        RolloutFleet("any-dir", num_engines=1)


def test_the_weight_payload_round_trips_every_dtype():
    from rollout.fleet.engine_worker import from_payload, to_payload

    state = {"w": torch.randn(3, 4), "b": torch.randn(5).to(torch.bfloat16), "h": torch.randn(2).half(),
             "i": torch.arange(4)}
    back = from_payload(to_payload(state))
    assert list(back) == list(state)
    for name, tensor in state.items():
        assert back[name].dtype == tensor.dtype and torch.equal(back[name], tensor), name
