"""Sticky sessions (`rollout.fleet.sessions`): a session's groups go to one member (a `RolloutPool` server, a
`RolloutFleet` engine) until finished or the member dies; requests without one route as before. The pool case runs
two `rollout serve` servers in this process and counts what each one served."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from rollout.fleet.sessions import SessionTable, check_session_ids, place_sessions

sys.path.insert(0, str(Path(__file__).parents[1]))


def test_table_sticks_forgets_and_bounds():
    t = SessionTable(max_sessions=2)
    t.stick("a", "u1")
    t.stick("b", "u2")
    assert t.get("a", ["u1", "u2"]) == "u1"
    assert t.get("b", ["u1"]) is None and "b" not in t.members  # its member is gone: routes afresh
    t.stick("b", "u1")
    t.stick("c", "u2")  # NOTE: over max_sessions: the least recently used ("a") goes
    assert list(t.members) == ["b", "c"]
    t.forget("u1")
    assert list(t.members) == ["c"]
    assert t.finish("c") == "u2" and t.finish("c") is None


def test_place_sessions_least_loaded_then_sticky():
    t = SessionTable()
    first = place_sessions(["s1", "s2", None, "s1"], t, {0: 0, 1: 0}, [0, 1])
    assert first[0] != first[1] and first[3] == first[0]
    again = place_sessions(["s2", "s1"], t, {0: 100, 1: 0}, [0, 1])  # NOTE: stickiness beats load
    assert again == [first[1], first[0]]
    assert place_sessions(["s1"], t, {0: 0, 1: 0}, [first[1]]) == [first[1]]  # its engine left: re-placed


def test_session_ids_are_checked():
    assert check_session_ids(None, 2) == [None, None]
    for bad in (["a"], "ab", ["a", ""], ["a", 3]):
        with pytest.raises(ValueError, match="session_ids"):
            check_session_ids(bad, 2)


@pytest.mark.timeout(300)
def test_pool_keeps_a_session_on_one_server(tmp_path):
    pytest.importorskip("uvicorn", reason="needs the [serve] extra")
    from support.serving import save_tiny, serving

    from rollout.fleet.pool import RolloutPool

    model = save_tiny(tmp_path / "m")
    with serving(model, key=None) as a, serving(model, key=None) as b:
        servers = {a.url: a, b.url: b}

        def served() -> dict[str, int]:
            return {u: s.app.state.bridge.counters["requests"] for u, s in servers.items()}

        pool = RolloutPool([a.url, b.url], routing="least_loaded", weight_transfer="disk")
        try:
            prompts = [[5, 6, 7, 8 + i] for i in range(6)]
            sessions = ["s0", "s1", "s0", "s1", "s0", "s1"]
            before = served()
            pool.generate(prompts, group_size=2, max_new_tokens=3, session_ids=sessions)
            homes = {s: pool.sessions.members[s] for s in ("s0", "s1")}
            assert homes["s0"] != homes["s1"]  # least loaded spreads the two sessions
            for _ in range(2):  # later turns stay where the session is, whatever the load
                pool.generate(prompts[:3], group_size=1, max_new_tokens=2, session_ids=["s0"] * 3)
            after = served()
            assert after[homes["s0"]] - before[homes["s0"]] == 3 + 6
            assert after[homes["s1"]] - before[homes["s1"]] == 3
            pool.finish_session("s0")
            assert "s0" not in pool.sessions.members
            pool.generate(prompts[:4], group_size=1, max_new_tokens=2)  # NOTE: no session: both servers used
            assert all(v > after[u] for u, v in served().items())
            with pytest.raises(ValueError, match="session_ids"):
                pool.generate(prompts, session_ids=["s0"])
        finally:
            pool.close()
