"""`python -m rollout serve` as a subprocess: the flags are parsed and reach the server and the engine
(`--max-model-len`, `--dtype`, `--logprobs-mode`, an engine flag `--num-blocks`, `--api-key`,
`--metrics-require-api-key`)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import torch
from support.distributions import expected_logprobs
from support.serving import free_port, save_tiny

pytest.importorskip("uvicorn")
pytestmark = pytest.mark.timeout(240)

ROOT = Path(__file__).resolve().parents[2]
KEY = "cli-key"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny(tmp_path_factory.mktemp("tiny") / "model")


@pytest.fixture(scope="module")
def served(model_dir, tmp_path_factory):
    port = free_port()
    log = tmp_path_factory.mktemp("log") / "serve.log"
    cmd = [sys.executable, "-m", "rollout", "serve", str(model_dir), "--port", str(port), "--api-key", KEY,
           "--max-model-len", "40", "--dtype", "bfloat16", "--logprobs-mode", "raw", "--num-blocks", "48",
           "--page-size", "16", "--log-level", "warning", "--metrics-require-api-key"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, f"rollout serve exited: {log.read_text()[-2000:]}"
            assert time.monotonic() < deadline, f"rollout serve did not start: {log.read_text()[-2000:]}"
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


def post(url, body):
    return httpx.post(url + "/v1/completions", json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=60)


def test_api_key_flag_guards_the_routes(served, model_dir):
    assert httpx.post(served + "/v1/completions", json={"model": "x", "prompt": "a"}, timeout=30).status_code == 401
    assert httpx.get(served + "/metrics", timeout=30).status_code == 401  # --metrics-require-api-key
    models = httpx.get(served + "/v1/models", headers={"Authorization": f"Bearer {KEY}"}, timeout=30).json()
    assert models["data"][0]["root"] == str(model_dir) and models["data"][0]["max_model_len"] == 40


def test_engine_flag_sets_the_page_pool(served):
    text = httpx.get(served + "/metrics", headers={"Authorization": f"Bearer {KEY}"}, timeout=30).text
    assert float(re.search(r"^rollout_num_blocks (\S+)$", text, re.M).group(1)) == 48
    assert float(re.search(r"^rollout_page_size (\S+)$", text, re.M).group(1)) == 16


def test_max_model_len_flag_caps_prompt_plus_max_tokens(served, model_dir):
    r = post(served, {"model": str(model_dir), "prompt": list(range(10, 40)), "max_tokens": 11})
    assert r.status_code == 400 and "40 tokens" in r.json()["error"]["message"]
    assert post(served, {"model": str(model_dir), "prompt": list(range(10, 40)), "max_tokens": 10}).status_code == 200


def test_dtype_and_logprobs_mode_flags(served, model_dir):
    """Raw logprobs (not the T=2, top-k=3 processed ones) of the bf16 model."""
    from transformers import AutoModelForCausalLM

    prompt = list(range(20, 30))
    body = {"model": str(model_dir), "prompt": prompt, "max_tokens": 1, "temperature": 2.0, "top_k": 3, "n": 32,
            "seed": 1, "logprobs": 0, "return_token_ids": True, "ignore_eos": True}
    r = post(served, body)
    assert r.status_code == 200, r.text
    tokens = torch.tensor([c["token_ids"][0] for c in r.json()["choices"]])
    reported = torch.tensor([c["logprobs"]["token_logprobs"][0] for c in r.json()["choices"]])
    logits = {}
    for dtype in (torch.bfloat16, torch.float32):
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
        with torch.no_grad():
            logits[dtype] = model(torch.tensor([prompt])).logits[0, -1].float()
    raw_bf16 = torch.log_softmax(logits[torch.bfloat16], -1)[tokens]
    raw_fp32 = torch.log_softmax(logits[torch.float32], -1)[tokens]
    processed = expected_logprobs(logits[torch.bfloat16], temperature=2.0, top_k=3)[tokens]
    assert (reported - raw_bf16).abs().max() < 0.05  # bf16 engine vs the bf16 model's own forward
    assert (reported - processed).abs().min() > 0.1  # raw, not processed
    # bf16, not fp32: the served numbers sit closer to the bf16 model than to the fp32 one
    assert (reported - raw_bf16).abs().mean() < (reported - raw_fp32).abs().mean()


def test_wait_policy_advice_only_for_spinning_multithreaded_servers():
    from rollout.serve.cli import wait_policy_advice

    advice = wait_policy_advice({}, 2)
    assert advice and "OMP_WAIT_POLICY=PASSIVE" in advice and "OMP_NUM_THREADS=1" in advice
    assert wait_policy_advice({"OMP_WAIT_POLICY": "PASSIVE"}, 2) is None
    assert wait_policy_advice({"OMP_WAIT_POLICY": "ACTIVE"}, 8) is None  # NOTE: a choice made, not advised
    assert wait_policy_advice({}, 1) is None  # NOTE: one thread has no siblings to wait on
