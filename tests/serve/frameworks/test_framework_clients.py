"""The RL frameworks' own client code against `rollout serve` on a tiny model (issue 57): verifiers' `TrainClient`,
SkyRL's `RemoteInferenceClient`, AReaL's `RemotevLLMEngine` (each in its own venv, which `.ci/run` builds: their
pins clash with ours) and TRL's default `AsyncRolloutWorker` (in this venv, `[trl]` extra). Each client's answers
are checked against what the server says to a plain request with the same prompt and seed, so a client that
parsed nothing, or something else, fails. A test skips, naming the missing piece, when its client is absent.

A client venv is found at `$ROLLOUT_<NAME>_PYTHON` (a python executable) or `<repo>/.venv-<name>/bin/python`."""

from __future__ import annotations

import copy
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

for _mod in ("fastapi", "uvicorn", "httpx"):
    pytest.importorskip(_mod, reason=f"rollout serve tests need {_mod} (pip install -e '.[serve,dev]')")

import httpx  # noqa: E402

sys.path.insert(0, str(Path(__file__).parents[2]))
HERE = Path(__file__).parent
REPO = Path(__file__).parents[3]
PROMPT = [7, 30, 41, 9, 77]
DRIVER_TIMEOUT_S = 240


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from support.serving import save_tiny, serving

    with serving(save_tiny(tmp_path_factory.mktemp("tiny") / "model"), key=None) as s:  # NOTE: SkyRL, AReaL send none
        yield s


def client_python(name: str, module: str) -> str:
    """The python of client `name`'s venv, or a skip naming how to make it."""
    python = os.environ.get(f"ROLLOUT_{name.upper()}_PYTHON") or str(REPO / f".venv-{name}" / "bin" / "python")
    if not Path(python).exists():
        pytest.skip(f"{name}'s client venv is absent ({python}; .ci/run builds it, or set "
                    f"ROLLOUT_{name.upper()}_PYTHON)")
    # NOTE: SkyRL's pydantic models need typing_extensions' TypedDict on Python 3.11 (its drivers patch it too)
    patch = "import typing, typing_extensions; typing.TypedDict = typing_extensions.TypedDict; "
    probe = subprocess.run([python, "-c", f"{patch}import {module}"], capture_output=True, text=True, timeout=120)
    if probe.returncode != 0:
        pytest.skip(f"{name}'s client does not import in {python}: {probe.stderr.strip().splitlines()[-1:]}")
    return python


def drive(python: str, script: str, *args: str) -> dict:
    run = subprocess.run([python, str(HERE / script), *args], capture_output=True, text=True,
                         timeout=DRIVER_TIMEOUT_S, cwd=HERE)
    assert run.returncode == 0, f"{script} failed:\n{run.stdout[-3000:]}\n{run.stderr[-5000:]}"
    return json.loads(run.stdout.strip().splitlines()[-1])


def generate(server, ids: list[int], **sampling) -> dict:
    r = httpx.post(server.url + "/inference/v1/generate", timeout=120,
                   json={"token_ids": ids, "sampling_params": {"logprobs": 0, **sampling}})
    assert r.status_code == 200, r.text
    return r.json()["choices"]


def test_verifiers_train_client(server):
    python = client_python("verifiers", "verifiers.v1.clients.train")
    out = drive(python, "drive_verifiers.py", server.url, "unused-key", str(server.model_dir))
    tok = server.app.state.tokenizer
    want = tok.apply_chat_template([{"role": "user", "content": "Reverse the word hello."}],
                                   add_generation_prompt=True, tokenize=True, return_dict=False)
    assert out["prompt_ids"] == list(want)
    (direct,) = generate(server, out["prompt_ids"], max_tokens=8, temperature=1.0, seed=5, top_k=4, ignore_eos=True,
                         return_sampling_mask=True)
    assert out["completion_ids"] == direct["token_ids"] and len(out["completion_ids"]) == 8
    assert out["completion_logprobs"] == pytest.approx([e["logprob"] for e in direct["logprobs"]["content"]],
                                                       abs=1e-4)
    assert out["finish_reason"] == "length" and out["id"].startswith("generate-tokens-")
    assert out["mask_counts"] == [4] * 8  # top_k 4: verifiers parsed our sampling_mask rows
    rows = [out["mask_ids"][4 * i:4 * i + 4] for i in range(8)]
    assert rows == direct["sampling_mask"] and all(t in r for t, r in zip(out["completion_ids"], rows, strict=True))


def test_skyrl_remote_inference_client(server):
    python = client_python("skyrl", "skyrl.backends.skyrl_train.inference_servers.remote_inference_client")
    out = drive(python, "drive_skyrl.py", server.url)
    tok = server.app.state.tokenizer
    ids = tok("Reverse the word hello.", add_special_tokens=True)["input_ids"]
    assert out["world_size"] == [1, 1] and out["prompt_ids"] == ids
    (direct,) = generate(server, ids, max_tokens=6, temperature=1.0, seed=1, ignore_eos=True)
    gen = out["generate"]
    assert gen["response_ids"] == [direct["token_ids"]] * 2  # two sessions, the same seed
    assert gen["stop_reasons"] == ["length", "length"] and [len(x) for x in gen["logprobs"]] == [6, 6]
    assert gen["responses"][0] == out["detok"] == tok.decode(direct["token_ids"])
    sample = out["sample"]
    pair = generate(server, ids, max_tokens=4, temperature=1.0, seed=3, n=2)
    assert [s["tokens"] for s in sample["sequences"]] == [c["token_ids"] for c in pair]
    assert sample["prompt_logprobs"][0] is None and len(sample["prompt_logprobs"]) == len(ids)
    assert all(len(k) == 2 for k in sample["topk_prompt_logprobs"][1:])
    assert out["paused_while_running"] and out["kept_tokens"] == 900 and out["kept_stop"] == "length"
    assert out["asleep"] and out["awake_again"] and out["after_wake"] == direct["token_ids"]


def test_skyrl_tinker_external_inference_client(server):
    """SkyRL's Tinker server samples through `ExternalInferenceClient` (token prompts to `/v1/completions`, `n`, `seed`,
    `logprobs: true`, `prompt_logprobs`, `X-Session-ID`): its `SampleOutput` is our answer to the same body."""
    python = client_python("skyrl", "skyrl.tinker.extra.external_inference")
    out = drive(python, "drive_skyrl_tinker.py", server.url, json.dumps(PROMPT))
    r = httpx.post(server.url + "/v1/completions", timeout=120, json={
        "model": "tiny", "prompt": PROMPT, "n": 2, "seed": 11, "max_tokens": 5, "temperature": 1.0, "top_p": 1,
        "top_k": -1, "logprobs": True, "return_token_ids": True, "prompt_logprobs": 1})
    choices = r.json()["choices"]
    assert [s["tokens"] for s in out["sequences"]] == [c["token_ids"] for c in choices]
    for seq, c in zip(out["sequences"], choices, strict=True):
        assert seq["logprobs"] == pytest.approx(c["logprobs"]["token_logprobs"], abs=1e-4)
        assert seq["stop_reason"] == c["finish_reason"]
    plp = choices[0]["prompt_logprobs"]
    assert out["prompt_logprobs"][0] is None and len(out["prompt_logprobs"]) == len(PROMPT)
    assert out["prompt_logprobs"][1:] == pytest.approx([plp[i][str(t)]["logprob"] for i, t in enumerate(PROMPT)
                                                        if i > 0], abs=1e-4)
    assert all(len(k) == 1 for k in out["topk_prompt_logprobs"][1:])


def test_areal_remote_vllm_engine(server):
    python = client_python("areal", "areal.engine.vllm_remote")
    addr = server.url.removeprefix("http://")
    out = drive(python, "drive_areal.py", addr, json.dumps(PROMPT))
    assert out["input_tokens"] == PROMPT
    assert 1 <= len(out["output_tokens"]) <= 6 and len(out["output_logprobs"]) == len(out["output_tokens"])
    assert all(math.isfinite(x) and x <= 0 for x in out["output_logprobs"])
    assert out["output_versions"] == [0] * len(out["output_tokens"])
    r = httpx.post(server.url + "/v1/completions", timeout=120, json={"prompt": PROMPT, "max_tokens": 6,
                                                                       "temperature": 0, "return_token_ids": True})
    assert out["greedy_tokens"] == r.json()["choices"][0]["token_ids"]


def reward_len(completions, **kwargs):
    return [float(len(str(c))) for c in completions]


def test_trl_async_rollout_worker(server, monkeypatch):
    """TRL 1.16's default worker (its own child process, `/v1/completions` with 63-bit seeds) fills its buffer with
    `RolloutSample`s from our server. `is_vllm_available` is patched: the worker only checks it (no vLLM import)."""
    pytest.importorskip("trl.experimental.async_grpo.async_rollout_worker",
                        reason="TRL's AsyncGRPO needs trl>=1.16 ([trl] extra)")
    datasets = pytest.importorskip("datasets", reason="TRL's worker takes a datasets.Dataset")
    from trl.experimental.async_grpo import async_rollout_worker as arw

    monkeypatch.setattr(arw, "is_vllm_available", lambda *a, **k: True)
    from accelerate import PartialState

    PartialState()  # NOTE: the trainer's process has one; the worker logs through accelerate's logger
    tok = copy.deepcopy(server.app.state.tokenizer)
    # NOTE: TRL parses each turn with the tokenizer's response template; the tiny chat template is ChatML-shaped
    tok.response_template = {"defaults": {"role": "assistant"}, "start_anchor": "<|im_start|>assistant\n",
                             "fields": {"content": {"close_pattern": r"<\|im_end\|>\s*", "content": "text"}}}
    data = datasets.Dataset.from_list([{"prompt": [{"role": "user", "content": "Say hi."}]}] * 4)
    worker = arw.AsyncRolloutWorker(model_name="tiny", dataset=data, reward_funcs=[reward_len],
                                    processing_class=tok, eos_token_ids=[tok.eos_token_id], num_generations=2,
                                    max_tokens=6, vllm_server_url=server.url, max_inflight_tasks=2,
                                    child_ready_timeout=240)
    worker.start()
    try:
        samples = [worker.rollout_buffer.get(timeout=180) for _ in range(2)]
    finally:
        worker.stop()
    for s in samples:
        completion = int(s.completion_mask.sum())
        assert 1 <= completion <= 6 and len(s.old_log_probs) == len(s.input_ids)
        lps = s.old_log_probs[s.completion_mask.astype(bool)]
        assert all(math.isfinite(x) and x <= 0 for x in lps) and s.model_version == 0
        assert math.isfinite(s.advantage)
    assert samples[0].group_id == samples[1].group_id
