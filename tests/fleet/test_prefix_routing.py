"""Prefix-aware routing (`rollout.fleet.prefix_routing`): the router's choices, and `RolloutPool` on two
servers sending an agent's later turns where its earlier ones were cached (more prompt tokens served by the
servers' prefix caches than least-loaded routing gets on the same multi-turn workload)."""

from __future__ import annotations

import random

import pytest

from rollout.fleet.prefix_routing import PrefixRouter


def test_the_longest_known_prefix_wins_unless_its_server_is_too_busy():
    r = PrefixRouter(block_tokens=4, max_imbalance=2)
    a, b = list(range(12)), [50 + i for i in range(12)]
    load = {"s0": 0, "s1": 0}
    assert r.pick(a, load, ["s0", "s1"]) == "s0"  # NOTE: nothing known: the least loaded (first of equals)
    load["s0"] = 1
    assert r.pick(b, load, ["s0", "s1"]) == "s1"
    assert r.pick(a + [99, 98, 97, 96], load, ["s0", "s1"]) == "s0"  # NOTE: a's 3 blocks live on s0
    assert r.pick(a[:5], load, ["s0", "s1"]) == "s0"  # NOTE: one whole block of a is enough
    assert r.pick(a[:3], load, ["s0", "s1"]) == "s1"  # NOTE: no whole block: by load
    load["s0"] = 4  # NOTE: 4 - 0 > max_imbalance: load wins over the cache
    assert r.pick(a, load, ["s0", "s1"]) == "s1"
    assert r.pick(a, {"s0": 0, "s1": 0}, ["s1"]) == "s1"  # NOTE: a server not among the candidates is skipped
    r.forget("s1")
    assert all(u != "s1" for u in r.owner.values())
    assert r.routed == 7 and r.prefix_routed == 3


def test_the_table_is_bounded_and_bad_settings_are_refused():
    r = PrefixRouter(block_tokens=2, max_entries=5)
    for i in range(20):
        r.pick([i, i, i, i], {"s0": 0}, ["s0"])
    assert len(r.owner) == 5
    for bad in ({"block_tokens": 0}, {"max_imbalance": -1}, {"max_entries": 0}):
        with pytest.raises(ValueError):
            PrefixRouter(**bad)


def test_a_pool_routes_later_turns_to_the_server_that_cached_the_earlier_ones(tmp_path_factory):
    pytest.importorskip("uvicorn")
    from support.serving import save_tiny

    from rollout.fleet.pool import RolloutPool
    from rollout.fleet.server_procs import ServerProcesses

    args = ["--page-size", "16", "--num-blocks", "512", "--dtype", "float32", "--log-level", "warning"]
    model_dir = save_tiny(tmp_path_factory.mktemp("tiny") / "model", seed=0)
    rng = random.Random(0)
    starts = [[rng.randrange(5, 100) for _ in range(40)] for _ in range(8)]
    fractions = {}
    with ServerProcesses(str(model_dir), n=2, threads=1, serve_args=args,
                         log_dir=str(tmp_path_factory.mktemp("logs")), start_timeout_s=180) as procs:
        for routing in ("least_loaded", "prefix"):
            # NOTE: the same conversations, new to the servers each time (a different first token per routing)
            convs = [[1 if routing == "prefix" else 2, *s] for s in starts]
            with RolloutPool(procs.urls, routing=routing, weight_transfer="disk",
                             disk_dir=str(tmp_path_factory.mktemp("w"))) as pool:
                order = random.Random(1)
                for turn in range(3):
                    ids = order.sample(range(len(convs)), len(convs))  # NOTE: agents come back in any order
                    batch = pool.generate([convs[i] for i in ids], temps=0.0, max_new_tokens=16, seed=turn)
                    for row, i in enumerate(ids):
                        n = int(batch.completion_lengths[row])
                        tool = [rng.randrange(5, 100) for _ in range(8)]  # NOTE: a tool's reply
                        convs[i] = convs[i] + batch.completion_ids[row, :n].tolist() + tool
                fractions[routing] = pool.cached_fraction
                if routing == "prefix":
                    assert pool.router.prefix_routed >= 2 * len(starts)  # NOTE: turns 2 and 3 followed turn 1
    print("cached fraction of prompt tokens by routing:", fractions)
    assert fractions["prefix"] > 0.4
    assert fractions["prefix"] > fractions["least_loaded"] + 0.1, fractions
