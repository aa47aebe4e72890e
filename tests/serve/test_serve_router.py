"""Two `rollout serve` processes behind vllm-router's `cache_aware` policy (an optional tool, in a venv of its
own: `pip install vllm-router==0.1.17`; the test runs the `vllm-router` executable named by
`ROLLOUT_VLLM_ROUTER` or found on PATH, and skips without one). The router tokenizes every request on each
worker first (vLLM's `POST /v1/completions/render`, then `/tokenize` where that is a 404): the servers' access
logs must show those calls and not one 4xx/5xx, both servers must answer completions, and greedy outputs
through the router must equal a direct request's."""

from __future__ import annotations

import concurrent.futures as cf
import os
import random
import re
import shutil
import subprocess
import time
from pathlib import Path

import pytest

pytest.importorskip("uvicorn")
pytestmark = pytest.mark.timeout(300)

ROUTER = os.environ.get("ROLLOUT_VLLM_ROUTER") or shutil.which("vllm-router")
if not ROUTER or not Path(ROUTER).is_file():
    pytest.skip("no vllm-router executable (pip install vllm-router==0.1.17 in a venv of its own, then put its "
                "bin/ on PATH or set ROLLOUT_VLLM_ROUTER=/path/to/vllm-router)", allow_module_level=True)

import httpx  # noqa: E402
from support.serving import free_port, save_tiny  # noqa: E402

KEY = "router-key"
ACCESS = re.compile(r'"(GET|POST) (\S+) HTTP/[\d.]+" (\d{3})')


def access_lines(log: Path) -> list[tuple[str, int]]:
    """(path, status) of every request in a server's uvicorn access log."""
    return [(m.group(2), int(m.group(3))) for m in ACCESS.finditer(log.read_text())]


def wait_healthy(url: str, proc: subprocess.Popen, log: Path, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        assert proc.poll() is None, f"vllm-router exited: {log.read_text()[-2000:]}"
        assert time.monotonic() < deadline, f"vllm-router did not answer /health: {log.read_text()[-2000:]}"
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)


def complete(url: str, prompt: str) -> httpx.Response:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    return httpx.post(url + "/v1/completions", json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=60)


def test_cache_aware_router_over_two_servers(tmp_path, monkeypatch):
    from rollout.fleet.server_procs import ServerProcesses

    monkeypatch.setenv("PYTHONUNBUFFERED", "1")  # NOTE: the servers' access logs are read while they run
    model = save_tiny(tmp_path / "model")
    serve_args = ["--served-model-name", "tiny", "--api-key", KEY, "--page-size", "16", "--num-blocks", "256",
                  "--log-level", "info"]
    with ServerProcesses(model, n=2, threads=1, serve_args=serve_args, log_dir=str(tmp_path / "logs"),
                         start_timeout_s=180) as servers:
        port = free_port()
        log = tmp_path / "router.log"
        cmd = [ROUTER, "--host", "127.0.0.1", "--port", str(port), "--worker-urls", *servers.urls,
               "--policy", "cache_aware", "--api-key", KEY, "--log-level", "info"]
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # NOTE: the router's venv, not ours
        with open(log, "w") as out:
            proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        url = f"http://127.0.0.1:{port}"
        try:
            wait_healthy(url, proc, log)
            rng = random.Random(0)
            prompts = ["".join(rng.choice("abcdefghij") for _ in range(20)) for _ in range(8)] * 4
            with cf.ThreadPoolExecutor(8) as pool:
                answers = list(pool.map(lambda p: complete(url, p), prompts))
            assert [r.status_code for r in answers] == [200] * len(prompts), [r.text for r in answers][:3]
            routed = [sum(path == "/v1/completions" for path, _ in access_lines(p)) for p in servers.logs]
            assert all(n > 0 for n in routed) and sum(routed) == len(prompts), routed  # NOTE: both servers used
            direct = {p: complete(servers.urls[0], p).json()["choices"][0]["text"] for p in set(prompts)}
            for prompt, r in zip(prompts, answers, strict=True):
                assert r.json()["choices"][0]["text"] == direct[prompt], prompt  # NOTE: greedy, same weights
            parts = [{"type": "text", "text": "12+"}, {"type": "text", "text": "34="}]
            r = httpx.post(url + "/v1/chat/completions", headers={"Authorization": f"Bearer {KEY}"}, timeout=60,
                           json={"model": "tiny", "messages": [{"role": "user", "content": parts}],
                                 "max_tokens": 4, "temperature": 0})
            assert r.status_code == 200, r.text
        finally:
            proc.terminate()
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
        seen = [access_lines(p) for p in servers.logs]
    bad = [(path, status) for lines in seen for path, status in lines if status >= 400]
    assert not bad, bad[:10]  # NOTE: issue 45: 404s on /tokenize sent every request to one worker
    for lines in seen:  # NOTE: cache_aware asked each worker for the prompt's ids (render, else /tokenize)
        assert any(path in ("/v1/completions/render", "/tokenize") for path, _ in lines), sorted(set(lines))
