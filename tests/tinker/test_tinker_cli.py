"""`rollout tinker-serve BASE_MODEL_DIR`: its refusals, and the real command serving on 127.0.0.1 behind its
key."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
from support.serving import free_port, save_tiny


def test_refuses_a_public_bind_without_a_key_and_a_key_the_sdk_cannot_send(tmp_path, monkeypatch):
    from rollout.tinker.cli import main

    monkeypatch.delenv("TINKER_API_KEY", raising=False)
    with pytest.raises(SystemExit, match="refusing to bind '0.0.0.0' without an API key"):
        main([str(tmp_path), "--host", "0.0.0.0"])
    with pytest.raises(SystemExit, match="start with 'tml-'"):
        main([str(tmp_path), "--api-key", "secret"])


def test_usage_names_tinker_serve(capsys):
    from rollout.__main__ import main

    assert main(["nope"]) == 2
    assert "rollout tinker-serve BASE_MODEL_DIR" in capsys.readouterr().err


@pytest.mark.timeout(180)
def test_the_command_serves_behind_its_key(tmp_path):
    pytest.importorskip(
        "tinker.proto.tinker_public_pb2", reason="the tinker SDK is not installed (the tinker extra)"
    )
    pytest.importorskip("peft", reason="the tinker extra")
    import httpx

    model_dir = save_tiny(tmp_path / "tiny")
    port = free_port()
    env = {**os.environ, "TINKER_API_KEY": "tml-cli-key", "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "rollout",
            "tinker-serve",
            str(model_dir),
            "--port",
            str(port),
            "--checkpoint-dir",
            str(tmp_path / "ckpt"),
            "--num-blocks",
            "64",
        ],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    url = f"http://127.0.0.1:{port}/api/v1"
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, proc.stderr.read().decode()[-2000:]
            try:
                if httpx.get(f"{url}/healthz", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "tinker-serve did not start in 120 s"
            time.sleep(0.25)
        assert httpx.post(f"{url}/create_session", json={}, timeout=10).status_code == 401
        wrong = httpx.post(f"{url}/create_session", json={}, headers={"X-API-Key": "tml-wrong"}, timeout=10)
        assert wrong.status_code == 401
        ok = httpx.post(
            f"{url}/create_session", json={"tags": []}, headers={"X-API-Key": "tml-cli-key"}, timeout=10
        )
        assert ok.status_code == 200 and ok.json()["session_id"].startswith("sess-")
        bad = httpx.post(
            f"{url}/create_model",
            json={"session_id": "nope", "model_seq_id": 0},
            headers={"X-API-Key": "tml-cli-key"},
            timeout=10,
        )
        assert bad.status_code == 400 and "unknown session_id 'nope'" in bad.json()["error"]
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
