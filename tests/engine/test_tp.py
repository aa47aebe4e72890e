"""Tensor parallelism (issue 30): the engine on models loaded with `DistributedConfig(tp_size=2)` under
`torchrun --nproc-per-node 2` on CPU (gloo). One launch of `support/tp_worker.py` runs every check (both
ranks write what they saw); the tests compare the ranks with each other and with the unsharded model."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
WORKER = ROOT / "tests" / "support" / "tp_worker.py"
sys.path.insert(0, str(ROOT / "tests"))

from support.serving import free_port  # noqa: E402
from support.tp_worker import ARCHS, full_state, grpo_trainer, save_checkpoints  # noqa: E402

pytestmark = pytest.mark.timeout(240)
STUCK_TIMEOUT_S = 3.0


def run_bounded(command: list[str], env: dict, timeout: float) -> subprocess.CompletedProcess:
    """Run a torchrun launch in its own process group; past `timeout` the whole group is killed (killing only
    torchrun would leave its workers behind), then the test fails with their output."""
    proc = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"the torchrun launch ran past {timeout} s:\n{out[-3000:]}\n{err[-6000:]}")
    return subprocess.CompletedProcess(command, proc.returncode, out, err)


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    ckpt = save_checkpoints(tmp_path_factory.mktemp("tp_ckpt"))
    out = tmp_path_factory.mktemp("tp_out")
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
               str(free_port()), str(WORKER), "--ckpt", str(ckpt), "--out", str(out)]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=f"{ROOT}{os.pathsep}{ROOT / 'tests'}",
               CUDA_VISIBLE_DEVICES="")
    proc = run_bounded(command, env, timeout=200)
    ranks = [out / f"rank{r}.json" for r in (0, 1)]
    assert all(p.exists() for p in ranks) and (out / "stuck.json").exists(), proc.stdout[-3000:] + proc.stderr[-6000:]
    # NOTE: the launch fails on purpose: the last check's rank 0 exits 3 after its stuck peer timed out
    assert proc.returncode != 0
    return [json.loads(p.read_text()) for p in ranks], json.loads((out / "stuck.json").read_text()), str(out), ckpt


def test_both_ranks_see_the_same_results(launched):
    (r0, r1), *_ = launched
    assert r0 == r1 and r0["archs"].keys() == set(ARCHS)


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_equals_unsharded_generate_and_logprobs_teacher_forcing(launched, arch):
    """Mixed lengths, 16-token steps (chunked prefill), a shared prefix, 12 pages (preemption)."""
    (r0, _), *_ = launched
    case = r0["archs"][arch]
    for (tokens, logprobs, _), (ref_tokens, ref_logprobs) in zip(case["got"], case["ref"], strict=True):
        assert tokens == ref_tokens
        assert max(abs(a - b) for a, b in zip(logprobs, ref_logprobs, strict=True)) < 1e-4
    stats = case["stats"]
    assert stats["preemptions"] >= 1
    assert stats["computed_prompt_tokens"] + stats["cached_prompt_tokens"] >= sum(len(p) for p in _prompts())
    assert stats["free_blocks"] == stats["num_blocks"]
    if arch in ("llama", "qwen3"):  # NOTE: full attention: the 24-token shared prefix is computed once
        assert stats["cached_prompt_tokens"] >= 16


def test_preemption_with_cpu_offload(launched):
    (r0, _), *_ = launched
    got, stats = r0["offload"]
    assert stats["offloaded_pages"] >= 1 and stats["restored_pages"] >= 1
    assert [g[0] for g in got] == [r[0] for r in r0["archs"]["qwen3"]["ref"]]


def _prompts():
    from support.tp_worker import prompts

    return prompts()


def test_each_rank_holds_half_the_kv_bytes(launched):
    (r0, r1), *_ = launched
    tp_bytes, full_bytes = r0["kv_bytes"]
    assert tp_bytes * 2 == full_bytes and r1["kv_bytes"][0] == tp_bytes


def test_rank0_submissions_and_cancellations_reach_every_rank(launched):
    (r0, r1), *_ = launched
    for r in (r0, r1):
        assert r["cancel"]["long"][0] == "CANCELLED" and 2 <= len(r["cancel"]["long"][1]) < 300
        assert r["cancel"]["only0"][0] == "FINISHED" and len(r["cancel"]["only0"][1]) == 4
        assert r["cancel"]["all_free"]
    assert r0["cancel"] == r1["cancel"]


def test_unseeded_sampling_is_one_stream_for_both_ranks(launched):
    (r0, r1), *_ = launched
    assert r0["unseeded"] == r1["unseeded"]
    assert r0["unseeded"] != r0["greedy_batch"]  # NOTE: it did sample
    assert r0["engine"]["sampled"] == r1["engine"]["sampled"]
    assert r0["engine"]["sampled_logprobs"] == r1["engine"]["sampled_logprobs"]


def test_update_weights_into_the_shards_from_a_state_dict_or_a_tp_model(launched):
    (r0, r1), *_ = launched
    for r in (r0, r1):
        e = r["engine"]
        assert e["after"] == e["after_ref"] != e["first"]
        assert e["again"] == e["after"]  # NOTE: after sleep / wake
        assert e["kv_asleep"] == 0
        assert e["back"] == e["first"] and e["version"] == 2  # NOTE: from another TP model's shards


def test_bad_configurations_are_refused_by_name(launched):
    (r0, r1), *_ = launched
    for r in (r0, r1):
        assert "num_key_value_heads" in r["refusals"]["kv_heads"]
        assert "device_map" in r["refusals"]["device_map"]
        assert "page_size" in r["refusals"]["config"] and "disagree" in r["refusals"]["config"]


def test_a_rank_that_skips_update_weights_makes_rank0_raise(launched):
    (r0, r1), *_ = launched
    assert r0["lagging"] is not None and "did not catch up" in r0["lagging"] and "update_weights" in r0["lagging"]
    assert r1["lagging"] == r0["lagging"]


def test_a_stuck_rank_makes_the_other_raise_within_the_timeout(launched):
    _, stuck, out, _ = launched
    assert stuck["error"] is not None and "cpu_group_timeout=3.0" in stuck["error"]
    assert STUCK_TIMEOUT_S <= stuck["elapsed"] < STUCK_TIMEOUT_S + 10
    # NOTE: torchrun ended the stuck rank: no worker of this launch is left
    left = [p.pid for p in psutil.process_iter(["cmdline"]) if out in " ".join(p.info["cmdline"] or [])]
    assert left == []


def test_grpo_on_a_tp2_policy_trains_like_one_process(launched, tmp_path):
    """3 GRPO steps (SGD, seeded sampling): the trainer's forward and backward on the sharded model, the
    engine on the same shards; rewards and the gathered weights equal an unsharded run's."""
    (r0, r1), _, out, ckpt = launched
    trainer = grpo_trainer(ckpt / "addition", tmp_path)
    history = trainer.train()
    single = full_state(trainer.policy)
    trainer.close()
    assert r0["grpo"] == r1["grpo"] and r0["grpo"]["version"] == 3
    assert r0["grpo"]["rewards"] == [m["reward_mean"] for m in history]
    assert max(r0["grpo"]["mismatch"]) < 1e-4
    sharded = torch.load(Path(out) / "grpo_tp.pt")
    assert sharded.keys() == single.keys()
    moved = max((single[n] - p).abs().max().item() for n, p in _initial(ckpt).items())
    assert moved > 1e-3  # NOTE: training changed the weights
    assert max((sharded[n] - single[n]).abs().max().item() for n in single) < 1e-4


def _initial(ckpt):
    from transformers import AutoModelForCausalLM

    return dict(AutoModelForCausalLM.from_pretrained(ckpt / "addition").named_parameters())


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_rollout_serve_on_two_ranks(tmp_path):
    """`rollout serve --tensor-parallel-size 2` under torchrun: rank 0 serves (greedy = unsharded generate),
    prefix flush and sleep / wake work (rank 1 replays the flushes), a checkpoint load from disk reaches both ranks'
    shards, the tensor-push routes answer 400, SIGINT ends both ranks."""
    import urllib.error
    import urllib.request

    from support.serving import save_tiny
    from transformers import AutoModelForCausalLM

    model_dir = save_tiny(tmp_path / "served")
    port = free_port()
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), CUDA_VISIBLE_DEVICES="")
    proc = subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(free_port()),
         "-m", "rollout", "serve", str(model_dir), "--tensor-parallel-size", "2", "--port", str(port),
         "--page-size", "8", "--num-blocks", "64"],
        cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)

    def post(path: str, body: dict | None = None) -> tuple[int, dict]:
        data = json.dumps(body or {}).encode()
        req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=data,
                                     headers={"content-type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=30) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read())

    try:
        deadline = time.monotonic() + 90
        while True:
            assert proc.poll() is None and time.monotonic() < deadline, "the server did not come up"
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
                break
            except OSError:
                time.sleep(0.5)
        prompt = list(range(5, 30))
        ref = AutoModelForCausalLM.from_pretrained(model_dir)
        expected = ref.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False, eos_token_id=None,
                                pad_token_id=0)[0, len(prompt):].tolist()
        # NOTE: a flush and a sleep on rank 0 are replayed by rank 1 (else the next round would time out)
        for route in ("/v1/completions", "/reset_prefix_cache", "/sleep", "/wake_up", "/v1/completions"):
            if route == "/v1/completions":
                status, body = post(route, {"model": str(model_dir), "prompt": prompt, "max_tokens": 8, "n": 2,
                                            "temperature": 0, "ignore_eos": True, "return_token_ids": True})
                assert status == 200 and [c["token_ids"] for c in body["choices"]] == [expected] * 2
            else:
                assert post(route)[0] == 200, route
        # NOTE: a checkpoint load reaches every rank's shards: greedy = the new model's generate, version 1
        new_dir = save_tiny(tmp_path / "new", seed=1)
        new_ref = AutoModelForCausalLM.from_pretrained(new_dir)
        new_expected = new_ref.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False, eos_token_id=None,
                                        pad_token_id=0)[0, len(prompt):].tolist()
        assert new_expected != expected
        status, body = post("/update_weights_from_disk", {"model_path": str(new_dir)})
        assert status == 200 and body["weight_version"] == 1, body
        status, body = post("/v1/completions", {"model": str(model_dir), "prompt": prompt, "max_tokens": 8, "n": 2,
                                                "temperature": 0, "ignore_eos": True, "return_token_ids": True})
        assert status == 200 and [c["token_ids"] for c in body["choices"]] == [new_expected] * 2
        status, body = post("/update_weights_from_disk", {"model_path": str(tmp_path / "missing")})
        assert status == 404, body  # NOTE: refused before any rank copies anything; the server goes on
        status, body = post("/update_weights", {"names": [], "dtypes": [], "shapes": []})
        assert status == 400 and "tensor-parallel" in body["error"]["message"]
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:  # NOTE: never leave the ranks behind
            os.killpg(proc.pid, signal.SIGKILL)
            raise
    left = [p.pid for p in psutil.process_iter(["cmdline"]) if str(model_dir) in " ".join(p.info["cmdline"] or [])]
    assert left == []
