"""inspect-ai (an optional tool, in a venv of its own: `pip install inspect-ai==0.3.285`) runs an eval whose user
turns are lists of text parts through `rollout serve`, with its `openai-api` provider and with its `vllm`
provider pointed at our base URL (`benchmarks/serve_inspect.py`). The test runs that script under the python
named by `ROLLOUT_INSPECT_PYTHON`, or the one behind an `inspect` executable on PATH, and skips without one:
the eval succeeds and every greedy completion equals a direct request with the parts joined by "\\n"."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

pytest.importorskip("uvicorn")
pytestmark = pytest.mark.timeout(300)

ROOT = Path(__file__).resolve().parents[2]


def inspect_python() -> str | None:
    if os.environ.get("ROLLOUT_INSPECT_PYTHON"):
        return os.environ["ROLLOUT_INSPECT_PYTHON"]
    exe = shutil.which("inspect")
    if exe is None:
        return None
    first = Path(exe).read_text(errors="replace").splitlines()[:1]
    return first[0][2:].strip() if first and first[0].startswith("#!") else None


PYTHON = inspect_python()
if not PYTHON or not Path(PYTHON).is_file():
    pytest.skip("no inspect-ai (pip install inspect-ai==0.3.285 in a venv of its own, then put its bin/ on PATH "
                "or set ROLLOUT_INSPECT_PYTHON=/path/to/venv/bin/python)", allow_module_level=True)

import httpx  # noqa: E402
from support.serving import save_tiny, serving  # noqa: E402


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with serving(save_tiny(tmp_path_factory.mktemp("inspect") / "model")) as s:
        yield s


@pytest.mark.parametrize("provider", ["openai-api", "vllm"])
def test_inspect_eval_with_multi_part_messages(server, provider, tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # NOTE: inspect's venv, not ours
    cmd = [PYTHON, str(ROOT / "benchmarks" / "serve_inspect.py"), "--base-url", server.url + "/v1", "--api-key",
           server.key, "--model", "tiny", "--provider", provider, "--max-tokens", "8", "--log-dir", str(tmp_path)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["status"] == "success" and len(result["samples"]) == 4, result
    for sample in result["samples"]:
        assert sample["error"] is None, sample
        joined = "\n".join(sample["parts"])  # NOTE: vLLM joins text parts with "\n" for a string template
        body = {"model": "tiny", "messages": [{"role": "user", "content": joined}], "max_tokens": 8, "temperature": 0}
        r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60,
                       headers={"Authorization": f"Bearer {server.key}"})
        assert sample["completion"] == r.json()["choices"][0]["message"]["content"], sample
