"""Async GRPO with the rollout in a separate process (issue 28): `DisaggGRPOTrainer` + `async_rollout=True`.

- `/update_weights_from_disk?in_flight=keep` (and `/finish_weight_update?in_flight=keep`, what
  `RolloutPool.update_weights(model, in_flight="keep")` sends) applies the weights while a request runs, without
  a pause: the update returns before the request ends, its `weight_versions` switch once, the tokens before the
  switch are the old model's HF greedy ones and those after equal HF greedy under the new weights over the KV
  computed under the old ones (KV kept);
- against one `rollout serve` child process: `max_staleness=0` reproduces the synchronous disaggregated run's
  updates exactly (same seeds), `max_staleness=1` runs ahead by at most one version (per-token versions from the
  server), and the server ends at the learner's last weights; no server process is left.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch

for _mod in ("fastapi", "uvicorn", "httpx"):
    pytest.importorskip(_mod, reason=f"disaggregated rollout tests need {_mod} (pip install -e '.[serve,dev]')")

import httpx  # noqa: E402
from support.tiny_models import hf_greedy, make_model  # noqa: E402
from support.training import save_tiny_addition_checkpoint, trained_state  # noqa: E402

from rollout.fleet.pool import RolloutPool  # noqa: E402
from rollout.fleet.server_procs import ServerProcesses  # noqa: E402
from trainers import GRPOConfig  # noqa: E402
from trainers.disagg import DisaggGRPOTrainer  # noqa: E402
from trainers.tasks import AdditionTask, addition_reward, make_addition_tokenizer  # noqa: E402

pytestmark = pytest.mark.timeout(240)


@torch.no_grad()
def kept_kv_oracle(old, new, prompt: list[int], generated: list[int], k: int, n: int) -> list[int]:
    """Greedy tokens k+1.. when the first k were sampled under `old` (KV of prompt + generated[:k-1] is old's)."""
    past = old(torch.tensor([prompt + generated[: k - 1]]), use_cache=True).past_key_values
    token, out = generated[k - 1], []
    for _ in range(n):
        step = new(torch.tensor([[token]]), past_key_values=past, use_cache=True)
        past, token = step.past_key_values, int(step.logits[0, -1].argmax())
        out.append(token)
    return out


def test_in_flight_keep_route_applies_weights_under_a_running_request(tmp_path):
    from support.serving import save_tiny, serving

    old, new = make_model("qwen3", seed=0), make_model("qwen3", seed=7)
    new.save_pretrained(tmp_path / "m7")
    prompt, n = [4] * 10, 600
    with serving(save_tiny(tmp_path / "model", seed=0)) as server:
        def call(method, path, body=None, **params):
            return httpx.request(method, server.url + path, json=body, params=params or None, timeout=120,
                                 headers={"Authorization": f"Bearer {server.key}"})

        v0 = call("GET", "/get_weight_version").json()["weight_version"]
        bad = call("POST", "/update_weights_from_disk", {"model_path": str(tmp_path / "m7")}, in_flight="later")
        assert bad.status_code == 400 and "in_flight" in bad.text
        box: dict = {}
        body = {"prompt": prompt, "max_tokens": n, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
        running = threading.Thread(target=lambda: box.setdefault("r", call("POST", "/v1/completions", body)))
        running.start()
        deadline = time.monotonic() + 60
        while not any(r.generated for r in dict(server.engine.manager.core.requests).values()):
            assert running.is_alive() and time.monotonic() < deadline, "the request was never seen running"
            time.sleep(0.01)
        r = call("POST", "/update_weights_from_disk", {"model_path": str(tmp_path / "m7")}, in_flight="keep")
        assert r.status_code == 200 and r.json()["weight_version"] == v0 + 1
        running.join(120)
    choice = box["r"].json()["choices"][0]
    got, versions = choice["token_ids"], choice["weight_versions"]
    k = versions.count(v0)
    assert len(got) == n and 0 < k < n, k  # applied mid-request: no pause, no wait for the request to end
    assert versions == [v0] * k + [v0 + 1] * (n - k)
    assert got[:k] == hf_greedy(old, prompt, k)
    assert got[k:] == kept_kv_oracle(old, new, prompt, got, k, n - k)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return save_tiny_addition_checkpoint(tmp_path_factory.mktemp("tiny") / "model")


@pytest.fixture(scope="module")
def server(checkpoint, tmp_path_factory):
    serve_args = ["--page-size", "4", "--num-blocks", "256", "--dtype", "float32", "--log-level", "warning"]
    with ServerProcesses(checkpoint, n=1, threads=1, serve_args=serve_args,
                         log_dir=str(tmp_path_factory.mktemp("logs")), start_timeout_s=180) as procs:
        yield procs
    assert all(p.poll() is not None for p in procs.procs)  # stopped: no orphan server


def run(checkpoint, server, tmp_path, **overrides):
    """A fresh learner from `checkpoint` on a fresh pool; the server is first reset to the checkpoint's weights."""
    from transformers import AutoModelForCausalLM

    tokenizer = make_addition_tokenizer()
    model = AutoModelForCausalLM.from_pretrained(checkpoint)
    pool = RolloutPool(server.urls, tokenizer=tokenizer)
    pool.update_weights(model)  # NOTE: the previous run left its weights there
    settings = dict(output_dir=str(tmp_path), max_steps=3, prompts_per_step=4, group_size=4, max_new_tokens=8,
                    temperature=1.0, learning_rate=2e-3, num_minibatches=2, log_stdout=False, progress=False, seed=0)
    config = GRPOConfig(**{**settings, **overrides})
    dataset = AdditionTask(num_digits=3, seed=0).to_dataset(64)
    with DisaggGRPOTrainer(model, tokenizer, [addition_reward], dataset, config, pool=pool) as trainer:
        history = trainer.train()
        state = trained_state(trainer)
        served_version = httpx.get(server.urls[0] + "/get_weight_version", timeout=60).json()["weight_version"]
    return history, state, served_version, model


def test_staleness_zero_on_a_server_equals_the_synchronous_run(checkpoint, server, tmp_path):
    want, want_state, _, _ = run(checkpoint, server, tmp_path / "sync")
    got, state, _, _ = run(checkpoint, server, tmp_path / "async", async_rollout=True, max_staleness=0)
    for a, b in zip(want, got, strict=True):
        for key in ("reward_mean", "loss", "clip_fraction", "response_length", "grad_norm"):
            assert b[key] == a[key], (b["step"], key)
        assert b["staleness_max"] == 0.0
    for name, tensor in want_state.items():
        assert torch.equal(state[name], tensor), name
    assert want[-1]["loss"] != want[0]["loss"]  # it did train


def test_staleness_one_on_a_server_runs_ahead_by_at_most_one(checkpoint, server, tmp_path):
    history, _, served, model = run(checkpoint, server, tmp_path, async_rollout=True, max_staleness=1, max_steps=4)
    assert [h["step"] for h in history] == [1, 2, 3, 4]
    assert history[0]["staleness_max"] == 0.0
    assert max(h["staleness_max"] for h in history) == 1.0  # ran ahead, never more than K
    assert all(h["policy_version"] >= h["step"] - 2 for h in history)  # batch j from version >= j - 1 - K
    # the server holds the learner's final weights: its logprobs of a greedy continuation equal the learner's
    prompt = make_addition_tokenizer()("12+34=")["input_ids"]
    r = httpx.post(server.urls[0] + "/v1/completions", timeout=60,
                   json={"prompt": prompt, "max_tokens": 6, "temperature": 0, "ignore_eos": True,
                         "return_token_ids": True, "logprobs": 0})
    choice = r.json()["choices"][0]
    assert choice["token_ids"] == hf_greedy(model.eval(), prompt, 6)
    assert set(choice["weight_versions"]) == {served}
