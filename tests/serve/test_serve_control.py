"""RL control of `rollout serve`: pause modes, weights from disk, a trainer process pushing weights over gloo
(`RolloutClient.update_weights`), sleep / wake, and the entry point's bind check. One server per module.

Run as a script (`python tests/serve/test_serve_control.py push URL KEY SEED`) it is that trainer process."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import threading
import time
import weakref
from pathlib import Path

import pytest

if __name__ != "__main__":
    for _mod in ("fastapi", "uvicorn", "prometheus_client", "httpx"):
        pytest.importorskip(_mod, reason=f"rollout serve tests need {_mod} (pip install -e '.[serve,dev]')")


sys.path.insert(0, str(Path(__file__).parents[1]))
from support.serving import call  # noqa: E402
from support.tiny_models import hf_greedy, make_model  # noqa: E402

PROMPT = [7, 30, 41, 9, 77, 12, 5, 66, 90, 3, 21, 54, 18, 33, 71, 8, 44, 2, 99, 60]  # 20 tokens: a full page
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from support.serving import save_tiny, serving

    with serving(save_tiny(tmp_path_factory.mktemp("tiny") / "model")) as s:
        yield s


def greedy(server, prompt=PROMPT, n=8) -> dict:
    r = call(server, "POST", "/v1/completions", {"prompt": prompt, "max_tokens": n, "temperature": 0,
                                                 "ignore_eos": True, "return_token_ids": True})
    assert r.status_code == 200, r.text
    return r.json()


def tokens(body: dict) -> list[int]:
    return body["choices"][0]["token_ids"]


def version(server) -> int:
    return call(server, "GET", "/get_weight_version").json()["weight_version"]


def in_thread(fn):
    box: dict = {}
    t = threading.Thread(target=lambda: box.setdefault("out", fn()), daemon=True)
    t.start()
    return t, box


def live_requests(server) -> dict:
    return dict(server.engine.manager.core.requests)


def wait_until_running(server, thread, what: str, timeout: float = 30.0) -> None:
    """Until the server holds a live request that has generated a token; fails (never hangs) when the
    deadline passes or the client thread ends first (the request finished between two polls)."""
    deadline = time.monotonic() + timeout
    while not any(r.generated for r in live_requests(server).values()):
        assert thread.is_alive(), f"{what} finished before it was seen running"
        assert time.monotonic() < deadline, f"{what} never started running"
        time.sleep(0.01)


def wait_until_held(server, n: int, what: str, timeout: float = 30.0) -> None:
    """Until the manager holds `n` requests submitted while paused: the event a fixed sleep used to
    stand in for. Fails (never hangs) at the deadline."""
    manager = server.engine.manager
    deadline = time.monotonic() + timeout
    while manager.debug_state()["held"] < n:
        assert time.monotonic() < deadline, f"{what} never reached the server's held requests"
        time.sleep(0.005)


def test_pause_keep_holds_new_and_running_then_resume_releases(server):
    running, run_box = in_thread(lambda: greedy(server, [4] * 10, n=600))
    wait_until_running(server, running, "the 600-token request")
    assert call(server, "POST", "/pause", mode="keep").status_code == 200
    assert call(server, "GET", "/is_paused").json() == {"is_paused": True}
    frozen = {rid: len(r.generated) for rid, r in live_requests(server).items()}
    new, new_box = in_thread(lambda: greedy(server))
    wait_until_held(server, 1, "the request sent while paused")
    with server.engine.manager.step_lock:  # NOTE: no step is under way while we look
        assert {rid: len(r.generated) for rid, r in live_requests(server).items()} == frozen  # no step ran
    assert running.is_alive() and new.is_alive()
    assert 0 < next(iter(frozen.values())) < 600
    assert call(server, "POST", "/resume").status_code == 200
    running.join(60)
    new.join(60)
    assert len(tokens(run_box["out"])) == 600 and run_box["out"]["choices"][0]["finish_reason"] == "length"
    assert tokens(new_box["out"]) == hf_greedy(make_model("qwen3", seed=0), PROMPT, 8)
    assert call(server, "GET", "/is_paused").json() == {"is_paused": False}


def test_pause_abort_and_wait(server):
    running, box = in_thread(lambda: greedy(server, [4] * 10, n=600))
    wait_until_running(server, running, "the 600-token request")
    assert call(server, "POST", "/pause", mode="abort").status_code == 200
    running.join(30)
    assert box["out"]["choices"][0]["finish_reason"] == "abort" and len(tokens(box["out"])) < 600
    held, held_box = in_thread(lambda: greedy(server))
    wait_until_held(server, 1, "the request sent while paused")
    assert held.is_alive()
    call(server, "POST", "/resume")
    held.join(30)
    assert len(tokens(held_box["out"])) == 8
    running, box = in_thread(lambda: greedy(server, [4] * 10, n=200))
    wait_until_running(server, running, "the 200-token request")
    assert call(server, "POST", "/pause", mode="wait").status_code == 200
    assert not live_requests(server)  # the running request finished before pause returned
    running.join(30)
    assert box["out"]["choices"][0]["finish_reason"] == "length"
    call(server, "POST", "/resume")
    assert call(server, "POST", "/pause", mode="bogus").json()["error"]["param"] == "mode"


def test_update_weights_from_disk_serves_new_policy(server, tmp_path):
    old = greedy(server)  # NOTE: leaves PROMPT's full page in the prefix cache
    assert tokens(old) == hf_greedy(make_model("qwen3", seed=0), PROMPT, 8)
    assert greedy(server)["usage"]["prompt_tokens_details"]["cached_tokens"] == 16
    v0 = version(server)
    new_model = make_model("qwen3", seed=2)
    new_model.save_pretrained(tmp_path / "new")
    r = call(server, "POST", "/update_weights_from_disk", {"model_path": str(tmp_path / "new")})
    assert r.status_code == 200 and r.json() == {"success": True, "weight_version": v0 + 1,  # + SGLang's field
                                                 "message": r.json()["message"], "num_paused_requests": 0}
    want = hf_greedy(new_model, PROMPT, 8)
    assert want != tokens(old)
    after = greedy(server)
    assert tokens(after) == want and after["usage"]["prompt_tokens_details"]["cached_tokens"] == 0  # no stale KV
    bad = call(server, "POST", "/update_weights_from_disk", {"model_path": str(tmp_path / "missing")})
    assert bad.status_code == 404 and bad.json()["error"]["param"] == "model_path"
    make_model("gpt2", seed=3).save_pretrained(tmp_path / "other")  # another architecture's checkpoint
    bad = call(server, "POST", "/update_weights_from_disk", {"model_path": str(tmp_path / "other")})
    assert bad.status_code == 400 and "unknown parameter names" in bad.json()["error"]["message"]
    assert version(server) == v0 + 1 and tokens(greedy(server)) == want  # the new weights keep serving


def test_pause_defaults_to_abort_and_updates_take_the_same_modes(server, tmp_path):
    """`rollout.in_flight`: /pause without a mode aborts (vLLM's default); the update routes take abort | wait |
    keep too: in_flight=abort cancels the running request and the new weights serve; an old or unknown spelling
    is a 400 naming in_flight and the accepted modes, and nothing changes."""
    running, box = in_thread(lambda: greedy(server, [4] * 10, n=600))
    wait_until_running(server, running, "the 600-token request")
    r = call(server, "POST", "/pause")
    assert r.status_code == 200 and r.json()["mode"] == "abort"
    running.join(30)
    assert box["out"]["choices"][0]["finish_reason"] == "abort" and len(tokens(box["out"])) < 600
    call(server, "POST", "/resume")

    model = make_model("qwen3", seed=6)
    model.save_pretrained(tmp_path / "m6")
    v0 = version(server)
    for bad in ("finish", "later"):
        r = call(server, "POST", "/update_weights_from_disk", {"model_path": str(tmp_path / "m6")}, in_flight=bad)
        assert r.status_code == 400 and r.json()["error"]["param"] == "in_flight"
        assert "'abort', 'wait', 'keep'" in r.json()["error"]["message"]
    assert version(server) == v0
    running, box = in_thread(lambda: greedy(server, [4] * 10, n=600))
    wait_until_running(server, running, "the 600-token request")
    r = call(server, "POST", "/update_weights_from_disk", {"model_path": str(tmp_path / "m6")}, in_flight="abort")
    assert r.status_code == 200 and r.json()["weight_version"] == v0 + 1
    running.join(30)
    assert box["out"]["choices"][0]["finish_reason"] == "abort" and len(tokens(box["out"])) < 600
    assert not server.engine.manager.is_paused()  # the update's own pause was lifted
    assert tokens(greedy(server)) == hf_greedy(model, PROMPT, 8)


def test_update_while_paused_keep_applies_to_held_requests(server, tmp_path):
    model = make_model("qwen3", seed=4)
    model.save_pretrained(tmp_path / "m4")
    call(server, "POST", "/pause", mode="keep")
    held, box = in_thread(lambda: greedy(server))
    wait_until_held(server, 1, "the request sent while paused")
    r = call(server, "POST", "/update_weights_from_disk", {"model_path": str(tmp_path / "m4")})
    assert r.status_code == 200 and held.is_alive()
    call(server, "POST", "/resume")
    held.join(30)
    assert tokens(box["out"]) == hf_greedy(model, PROMPT, 8)


def test_weight_versions_show_an_update_landing_mid_request(server, tmp_path):
    """A request kept running across an update: `weight_versions` (one per token, beside `token_ids`)
    switches from the old version to the new one at the token where it was frozen."""
    model = make_model("qwen3", seed=7)
    model.save_pretrained(tmp_path / "m7")
    v0 = version(server)
    running, box = in_thread(lambda: greedy(server, [4] * 10, n=300))
    wait_until_running(server, running, "the 300-token request")
    call(server, "POST", "/pause", mode="keep")
    frozen = len(next(iter(live_requests(server).values())).generated)
    r = call(server, "POST", "/update_weights_from_disk", {"model_path": str(tmp_path / "m7")})
    assert r.status_code == 200 and r.json()["weight_version"] == v0 + 1
    call(server, "POST", "/resume")
    running.join(60)
    choice = box["out"]["choices"][0]
    assert len(choice["token_ids"]) == 300 and 0 < frozen < 300
    assert choice["weight_versions"] == [v0] * frozen + [v0 + 1] * (300 - frozen)
    assert greedy(server)["choices"][0]["weight_versions"] == [v0 + 1] * 8


def test_trainer_process_pushes_weights_over_gloo(server):
    v0 = version(server)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, __file__, "push", server.url, server.key, "5"], env=env,
                         capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1] == f"version {v0 + 1}"
    assert version(server) == v0 + 1
    assert tokens(greedy(server)) == hf_greedy(make_model("qwen3", seed=5), PROMPT, 8)
    # a push of mismatching tensors is refused before any tensor moves; the pushed weights keep serving
    from rollout.client import RolloutClient

    with RolloutClient(server.url, server.key) as client:
        with pytest.raises(RuntimeError, match="unknown parameter name"):
            client.update_weights(make_model("gpt2", seed=6))
    assert version(server) == v0 + 1 and tokens(greedy(server)) == hf_greedy(make_model("qwen3", seed=5), PROMPT, 8)


def test_sleep_holds_requests_until_wake_up(server):
    want = tokens(greedy(server))
    cache = server.engine.manager.core.cache
    kv = [weakref.ref(t) for t in (*cache.keys.values(), *cache.values.values())]
    assert kv
    assert call(server, "POST", "/sleep").json()["is_sleeping"] is True
    gc.collect()
    assert cache.nbytes == 0
    assert all(ref() is None for ref in kv), "a KV tensor outlived /sleep (still referenced somewhere)"
    held, box = in_thread(lambda: greedy(server))
    wait_until_held(server, 1, "the request sent while asleep")
    assert held.is_alive()
    assert call(server, "POST", "/wake_up").json()["is_sleeping"] is False
    held.join(30)
    assert tokens(box["out"]) == want
    assert call(server, "POST", "/reset_prefix_cache").json() == {"success": True}
    assert greedy(server)["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


def test_entry_point_refuses_public_bind_without_key(tmp_path, monkeypatch):
    env = {k: v for k, v in os.environ.items() if k != "ROLLOUT_API_KEY"}
    env["PYTHONPATH"] = str(REPO)
    cmd = [sys.executable, "-m", "rollout", "serve", str(tmp_path / "none"), "--host", "0.0.0.0"]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode != 0 and "refusing to bind" in out.stderr
    from rollout.serve import cli

    with pytest.raises(SystemExit, match="refusing to bind"):
        cli.main([str(tmp_path / "none"), "--host", "10.1.2.3"])
    # with the key from the environment it gets past the check (and fails on the missing model instead)
    monkeypatch.setenv("ROLLOUT_API_KEY", "k")
    with pytest.raises(OSError):
        cli.main([str(tmp_path / "none"), "--host", "0.0.0.0"])


def _push(url: str, key: str, seed: int) -> None:
    """The trainer process: push a fresh policy's weights to the server, print the new version."""
    from rollout.client import RolloutClient

    with RolloutClient(url, key) as client:
        print(f"version {client.update_weights(make_model('qwen3', seed=seed))}")


if __name__ == "__main__" and sys.argv[1:2] == ["push"]:
    _push(sys.argv[2], sys.argv[3], int(sys.argv[4]))
