"""Two `rollout serve` instances behind vllm-router's `cache_aware` policy (an optional tool: skipped without
`vllm_router`, e.g. `pip install --target DIR vllm-router orjson setproctitle` and DIR on PYTHONPATH): every
request answered (no 404 from the routes the router calls), both servers used under concurrent distinct
prompts, greedy outputs identical whichever server answered, list content through the router too."""

from __future__ import annotations

import concurrent.futures as cf
import importlib.util
import os
import random
import re
import subprocess
import sys
import time

import pytest

for _mod in ("vllm_router", "orjson", "fastapi", "uvicorn", "httpx"):
    if importlib.util.find_spec(_mod) is None:
        pytest.skip(f"the router test needs {_mod} (pip install vllm-router==0.1.17)", allow_module_level=True)

import httpx  # noqa: E402
from support.serving import free_port, save_tiny, serving  # noqa: E402


def requests_of(server) -> float:
    text = httpx.get(server.url + "/metrics", timeout=30).text
    return float(re.search(r"^rollout_server_requests_total (\S+)$", text, re.M).group(1))


def test_cache_aware_router_over_two_servers(tmp_path):
    with serving(save_tiny(tmp_path / "a")) as one, serving(save_tiny(tmp_path / "b")) as two:
        port = free_port()
        log = tmp_path / "router.log"
        cmd = [sys.executable, "-m", "vllm_router.launch_router", "--host", "127.0.0.1", "--port", str(port),
               "--worker-urls", one.url, two.url, "--policy", "cache_aware", "--api-key", one.key]
        with open(log, "w") as out:
            proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=dict(os.environ))
        url, headers = f"http://127.0.0.1:{port}", {"Authorization": f"Bearer {one.key}"}
        try:
            deadline = time.monotonic() + 60
            while True:
                assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-2000:]
                try:
                    if httpx.get(url + "/health", timeout=2).status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                time.sleep(0.2)
            rng = random.Random(0)
            prompts = ["".join(rng.choice("abcdefghij") for _ in range(20)) for _ in range(6)] * 5

            def complete(prompt: str) -> httpx.Response:
                body = {"model": "tiny", "prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
                return httpx.post(url + "/v1/completions", json=body, headers=headers, timeout=60)

            with cf.ThreadPoolExecutor(6) as pool:
                answers = list(pool.map(complete, prompts))
            assert [r.status_code for r in answers] == [200] * len(prompts), [r.text for r in answers][:3]
            texts: dict[str, set[str]] = {}
            for prompt, r in zip(prompts, answers, strict=True):
                texts.setdefault(prompt, set()).add(r.json()["choices"][0]["text"])
            assert all(len(v) == 1 for v in texts.values())  # NOTE: same weights: greedy is the same anywhere
            parts = [{"type": "text", "text": "12+"}, {"type": "text", "text": "34="}]
            r = httpx.post(url + "/v1/chat/completions", headers=headers, timeout=60, json={
                "model": "tiny", "messages": [{"role": "user", "content": parts}], "max_tokens": 4, "temperature": 0})
            assert r.status_code == 200, r.text
            assert requests_of(one) > 0 and requests_of(two) > 0
        finally:
            proc.terminate()
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
