"""The serving examples of README.md and docs/serving.md, run as written (model path and port swapped) against
`rollout serve` on a tiny model with the GRPO demo's tokenizer: the curl completion, then the OpenAI-client
chat, its extra fields and a streamed completion."""

from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from support.markdown import fenced_blocks
from support.training import save_tiny_addition_checkpoint

pytest.importorskip("uvicorn")
pytestmark = pytest.mark.timeout(300)

ROOT = Path(__file__).resolve().parents[2]


def shell_lines(block: str) -> list[str]:
    """The block's commands, continuation lines joined, comments dropped."""
    joined = re.sub(r"\\\n\s*", " ", block)
    return [line.split("   #")[0].strip() for line in joined.splitlines() if line.strip() and not line.startswith("#")]


@pytest.fixture(scope="module")
def example_server(tmp_path_factory):
    """README's `rollout serve` line on a tiny demo-tokenizer model (`ServerProcesses`: a free port, stopped after)."""
    from rollout.fleet.server_procs import ServerProcesses

    readme_serve = next(b for b in fenced_blocks((ROOT / "README.md").read_text(), "bash") if "rollout serve" in b)
    serve, curl = shell_lines(readme_serve)
    argv = shlex.split(serve)
    assert argv[:3] == [".venv/bin/rollout", "serve", "runs/grpo/final"], serve
    model = save_tiny_addition_checkpoint(tmp_path_factory.mktemp("demo") / "final")
    with ServerProcesses(model, serve_args=[*argv[3:], "--log-level", "warning"], start_timeout_s=120,
                         log_dir=str(tmp_path_factory.mktemp("log"))) as procs:
        yield int(procs.urls[0].rsplit(":", 1)[1]), curl


@pytest.mark.skipif(shutil.which("curl") is None, reason="no curl on this machine")
def test_readme_curl_completion_runs_on_the_demo_model(example_server):
    port, curl = example_server
    assert curl.startswith("curl ") and "localhost:8000" in curl
    out = subprocess.run(curl.replace("localhost:8000", f"127.0.0.1:{port}"), shell=True, capture_output=True,
                         text=True, timeout=60, check=True).stdout
    body = json.loads(out)
    choice = body["choices"][0]
    assert len(choice["token_ids"]) >= 1 and set(choice["text"]) <= set("0123456789+=")
    assert choice["prompt_token_ids"] == [1, 5, 6, 7, 14, 8, 9, 10, 15]  # NOTE: <bos> 123+456=


def test_serving_docs_python_example_runs_on_the_demo_model(example_server, tmp_path):
    pytest.importorskip("openai")
    port, _ = example_server
    (code,) = [b for b in fenced_blocks((ROOT / "docs" / "serving.md").read_text(), "python") if "OpenAI(" in b]
    script = tmp_path / "example.py"
    script.write_text(code.replace("127.0.0.1:8000", f"127.0.0.1:{port}"))
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert lines[1].startswith("[1, 5, 6, 7, 14, 8, 9, 10, 15]")  # NOTE: the chat template's ids: <bos> 123+456=
    assert len(lines[2].split(",")) == len(lines[1].split("] [")[1].split(","))  # NOTE: a logprob per token
