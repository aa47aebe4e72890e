"""Two `rollout serve` processes behind sglang-router 0.3.2 (the router slime / miles put in front of their
SGLang engines), speaking SGLang's native `/generate`. An optional tool in a venv of its own (`pip install
sglang-router==0.3.2`; `.ci/run` makes one): the test runs `python -m
sglang_router.launch_router` with the Python named by `ROLLOUT_SGLANG_ROUTER_PYTHON`, or this one when it has
`sglang_router`, and skips without either.

Must show: the workers register (the router's probes answered, no 4xx/5xx in the servers' access logs), both
servers answer `/generate`, greedy outputs through the router equal a direct request's, `/flush_cache` reaches
both, and the cache-aware policy keeps a prompt on the server that holds its prefix (its repeats hit that
server's prefix cache)."""

from __future__ import annotations

import concurrent.futures as cf
import os
import random
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("uvicorn")
pytestmark = pytest.mark.timeout(300)


def _router_python() -> str | None:
    named = os.environ.get("ROLLOUT_SGLANG_ROUTER_PYTHON")
    if named:
        return named if Path(named).is_file() else None
    try:
        import sglang_router  # noqa: F401
    except ImportError:
        return None
    return sys.executable


PYTHON = _router_python()
if PYTHON is None:
    pytest.skip("no sglang-router (pip install sglang-router==0.3.2 in a venv of its own, then "
                "set ROLLOUT_SGLANG_ROUTER_PYTHON=/path/to/that/venv/bin/python)", allow_module_level=True)

import httpx  # noqa: E402
from support.serving import free_port, save_tiny  # noqa: E402

KEY = "router-key"
ACCESS = re.compile(r'"(GET|POST) (\S+) HTTP/[\d.]+" (\d{3})')


def access_lines(log: Path) -> list[tuple[str, int]]:
    """(path, status) of every request in a server's uvicorn access log."""
    return [(m.group(2), int(m.group(3))) for m in ACCESS.finditer(log.read_text())]


def wait_ready(url: str, proc: subprocess.Popen, log: Path, workers: int, timeout_s: float = 60.0) -> None:
    """Until the router answers /health and lists `workers` healthy workers."""
    deadline = time.monotonic() + timeout_s
    while True:
        assert proc.poll() is None, f"sglang-router exited: {log.read_text()[-3000:]}"
        assert time.monotonic() < deadline, f"sglang-router did not become ready: {log.read_text()[-3000:]}"
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                r = httpx.get(url + "/workers", timeout=2)
                listed = r.json().get("workers", r.json()) if r.status_code == 200 else None
                if listed is None or len(listed) >= workers:
                    return
        except (httpx.TransportError, ValueError):
            pass
        time.sleep(0.2)


def generate(url: str, ids: list[int], n: int = 8) -> httpx.Response:
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": n, "temperature": 0, "ignore_eos": True},
            "return_logprob": True}
    return httpx.post(url + "/generate", json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=120)


def test_sglang_router_over_two_servers(tmp_path, monkeypatch):
    from rollout.fleet.server_procs import ServerProcesses

    monkeypatch.setenv("PYTHONUNBUFFERED", "1")  # NOTE: the servers' access logs are read while they run
    model = save_tiny(tmp_path / "model")
    serve_args = ["--served-model-name", "tiny", "--api-key", KEY, "--page-size", "16", "--num-blocks", "256",
                  "--log-level", "info"]
    with ServerProcesses(model, n=2, threads=1, serve_args=serve_args, log_dir=str(tmp_path / "logs"),
                         start_timeout_s=180) as servers:
        port = free_port()
        log = tmp_path / "router.log"
        cmd = [PYTHON, "-m", "sglang_router.launch_router", "--host", "127.0.0.1", "--port", str(port),
               "--worker-urls", *servers.urls, "--policy", "cache_aware", "--api-key", KEY,
               "--log-level", "info"]
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # NOTE: the router's venv, not ours
        with open(log, "w") as out:
            proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        url = f"http://127.0.0.1:{port}"
        try:
            wait_ready(url, proc, log, workers=2)
            rng = random.Random(0)
            prompts = [[rng.randrange(8, 120) for _ in range(40)] for _ in range(8)]
            with cf.ThreadPoolExecutor(8) as pool:  # NOTE: at once, so the load spreads them
                answers = list(pool.map(lambda p: generate(url, p), prompts))
            assert [r.status_code for r in answers] == [200] * len(prompts), [r.text for r in answers][:3]
            routed = [sum(path == "/generate" for path, _ in access_lines(p)) for p in servers.logs]
            assert all(n > 0 for n in routed) and sum(routed) == len(prompts), routed  # NOTE: both servers used
            for ids, r in zip(prompts, answers, strict=True):
                direct = generate(servers.urls[0], ids).json()
                assert r.json()["output_ids"] == direct["output_ids"]  # NOTE: greedy, same weights
                assert [e[0] for e in r.json()["meta_info"]["output_token_logprobs"]] == pytest.approx(
                    [e[0] for e in direct["meta_info"]["output_token_logprobs"]], abs=1e-5)
            # cache-aware: a prompt's repeats go where its prefix is (a hit on that server's prefix cache)
            r = httpx.post(url + "/flush_cache", headers={"Authorization": f"Bearer {KEY}"}, timeout=60)
            assert r.status_code == 200, r.text
            flushed = [sum(path == "/flush_cache" for path, _ in access_lines(p)) for p in servers.logs]
            assert flushed == [1, 1], flushed  # NOTE: fanned out to both
            before = [sum(path == "/generate" for path, _ in access_lines(p)) for p in servers.logs]
            repeats = [generate(url, prompts[0], n=2).json() for _ in range(4)]
            after = [sum(path == "/generate" for path, _ in access_lines(p)) for p in servers.logs]
            grew = [a - b for a, b in zip(after, before, strict=True)]
            assert sorted(grew) == [0, 4], grew  # NOTE: all four on one server
            assert all(o["meta_info"]["cached_tokens"] >= 32 for o in repeats[1:]), [
                o["meta_info"]["cached_tokens"] for o in repeats]
        finally:
            proc.terminate()
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
        seen = [access_lines(p) for p in servers.logs]
    bad = [(path, status) for lines in seen for path, status in lines if status >= 400]
    assert not bad, bad[:10]
    for lines in seen:  # NOTE: the router's registration probe reached each worker
        assert ("/health", 200) in lines, sorted(set(lines))
