"""`recipes/grpo.py --tp_size 2` (issue 41 item 5): the embedded demo's GRPO on a policy sharded over 2 CPU ranks
(torchrun, gloo), which form one data-parallel replica. Both ranks see the same prompts, rollouts, rewards and
local losses; the parity probe is at float error; reward and loss match a one-process tp_size 1 run of the same
seed. Plus the refusals of combinations that cannot run."""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[2]
RECIPES = ROOT / "recipes"
WORKER = ROOT / "tests" / "support" / "tp_recipe_worker.py"
sys.path.insert(0, str(RECIPES))  # NOTE: recipes import their sibling `_common`, as they do when launched

from support.serving import free_port  # noqa: E402

pytestmark = pytest.mark.timeout(240)
ARGS = ["--steps", "3", "--prompts_per_step", "4", "--group_size", "4", "--sft_steps", "3", "--seed", "0"]
LAUNCH_TIMEOUT_S = 150


def load_recipe(name: str):
    spec = importlib.util.spec_from_file_location(f"recipe_{name}_tp", RECIPES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def records(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def launch_tp2(out: Path, record: Path, extra: list[str]) -> subprocess.CompletedProcess:
    """torchrun of the worker in its own process group; past the timeout the whole group is killed."""
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
               str(free_port()), str(WORKER), "--record_dir", str(record), "--", *ARGS, *extra, "--tp_size", "2",
               "--output_dir", str(out)]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=f"{ROOT}{os.pathsep}{ROOT / 'tests'}",
               CUDA_VISIBLE_DEVICES="")
    proc = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=LAUNCH_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        pytest.fail(f"the torchrun launch ran past {LAUNCH_TIMEOUT_S} s:\n{stdout[-3000:]}\n{stderr[-6000:]}")
    return subprocess.CompletedProcess(command, proc.returncode, stdout, stderr)


@pytest.mark.skipif(not (dist.is_available() and dist.is_gloo_available()), reason="needs torch.distributed with gloo")
@pytest.mark.parametrize("beta", [0.0, 0.04], ids=["no_kl", "kl"])  # NOTE: kl: the reference is an unsharded copy
def test_grpo_recipe_tp2_on_two_cpu_ranks_matches_tp1(tmp_path, keep_rng, beta):
    extra = ["--beta", str(beta)]
    proc = launch_tp2(tmp_path / "tp2", tmp_path / "ranks", extra)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    r0, r1 = (json.loads((tmp_path / "ranks" / f"rank{r}.json").read_text()) for r in (0, 1))
    # both TP ranks are one data-parallel replica: the same prompts, the same rollouts, the same local losses
    assert len(r0["steps"]) == len(r1["steps"]) == 3
    for a, b in zip(r0["steps"], r1["steps"], strict=True):
        assert a["prompts"] == b["prompts"] and len(a["prompts"]) == 4
        assert a["data"] == b["data"] == [0, 1]  # data-parallel rank 0 of 1
        assert a["completion_ids"] == b["completion_ids"] and a["rewards"] == b["rewards"]
        assert a["local"]["loss"] == pytest.approx(b["local"]["loss"], abs=1e-6)
        assert a["local"]["grad_norm"] == pytest.approx(b["local"]["grad_norm"], rel=1e-5)
    tp2 = records(tmp_path / "tp2")
    assert [r["step"] for r in tp2] == [1, 2, 3]
    assert max(r["logprob_mismatch_max"] for r in tp2) < 1e-5  # the parity probe: engine vs trainer, float error
    assert all(r["trainer_param_fraction"] < 0.75 for r in tp2)  # each rank holds about half the parameters
    assert all(r["policy_version"] == i for i, r in enumerate(tp2))  # a weight sync after every step
    summary = json.loads((tmp_path / "tp2" / "summary.json").read_text())
    assert summary["tp_size"] == 2 and summary["num_processes"] == 2 and summary["steps"] == 3
    final = json.loads((tmp_path / "tp2" / "final" / "config.json").read_text())
    assert not final.get("distributed_config")  # the gathered copy loads back as a plain model

    # the same seed in one process, tp_size 1: the same rollouts, so the same rewards; the loss to float error
    grpo = load_recipe("grpo")
    grpo.main([*ARGS, *extra, "--output_dir", str(tmp_path / "tp1")])
    tp1 = records(tmp_path / "tp1")
    for a, b in zip(tp1, tp2, strict=True):
        print(f"beta {beta} step {a['step']}: reward tp1 {a['reward_mean']:.6f} tp2 {b['reward_mean']:.6f}; loss tp1 "
              f"{a['loss']:.8f} tp2 {b['loss']:.8f}; grad_norm tp1 {a['grad_norm']:.6f} tp2 {b['grad_norm']:.6f}; "
              f"mismatch tp2 {b['logprob_mismatch_max']:.2e}")
        assert b["reward_mean"] == pytest.approx(a["reward_mean"], abs=1e-4)
        assert b["reward_std"] == pytest.approx(a["reward_std"], abs=1e-4)
        assert b["loss"] == pytest.approx(a["loss"], abs=1e-4)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-3)
        assert ("kl" in b) == (beta > 0) and b.get("kl", 0.0) == pytest.approx(a.get("kl", 0.0), abs=1e-5)


@pytest.mark.skipif(not (dist.is_available() and dist.is_gloo_available()), reason="needs torch.distributed with gloo")
def test_grpo_recipe_tp2_checkpoint_resumes(tmp_path, keep_rng):
    """2 steps saved at step 2 (each rank's model and AdamW shards in checkpoint-2/tp/, DCP), then resumed to step 3:
    step 3 is the one of an uninterrupted run (here: one process, tp_size 1, same seed)."""
    out = tmp_path / "tp2"
    first = launch_tp2(out, tmp_path / "ranks_a", ["--steps", "2", "--save_steps", "2"])
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-6000:]
    assert sorted(p.name for p in (out / "checkpoint-2" / "tp").iterdir() if p.suffix == ".distcp") == [
        "__0_0.distcp", "__1_0.distcp"]
    second = launch_tp2(out, tmp_path / "ranks_b", ["--resume_from_checkpoint", "latest"])
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-6000:]
    resumed = records(out)
    assert [r["step"] for r in resumed] == [1, 2, 3] and resumed[2]["policy_version"] == 2
    grpo = load_recipe("grpo")
    grpo.main([*ARGS, "--output_dir", str(tmp_path / "tp1")])
    a, b = records(tmp_path / "tp1")[2], resumed[2]
    print(f"step 3 after resume: reward tp1 {a['reward_mean']:.6f} tp2 {b['reward_mean']:.6f}; loss tp1 "
          f"{a['loss']:.8f} tp2 {b['loss']:.8f}; grad_norm tp1 {a['grad_norm']:.6f} tp2 {b['grad_norm']:.6f}")
    assert b["reward_mean"] == pytest.approx(a["reward_mean"], abs=1e-4)
    assert b["loss"] == pytest.approx(a["loss"], abs=1e-5)
    assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-4)
    assert b["logprob_mismatch_max"] < 1e-5  # the engine runs on the restored shards


# ---------------------------------------------------------------------------------------------- refusals


def _args(**overrides) -> SimpleNamespace:
    base = dict(tp_size=2, lora_rank=None, async_rollout=False, rollout_engines=0, engine_dtype=None,
                batch_invariant=False, save_steps=0, resume_from_checkpoint=None, beta=0.04)
    return SimpleNamespace(**{**base, **overrides})


@pytest.mark.parametrize(("overrides", "world", "message"), [
    ({"tp_size": 3}, 2, "--tp_size 3 does not divide the world size 2"),
    ({}, 1, "--tp_size 2 does not divide the world size 1"),
    ({}, 4, "data parallelism over several TP groups is not implemented"),
    ({"tp_size": 0}, 2, "--tp_size must be >= 1"),
    ({"lora_rank": 8}, 2, "--lora_rank 8 is not supported"),
    ({"async_rollout": True}, 2, "--async_rollout True is not supported"),
])
def test_check_tp_args_names_the_problem(overrides, world, message):
    tp = load_recipe("_tp")
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        tp.check_tp_args(_args(**overrides), SimpleNamespace(num_processes=world))


def test_tp_with_fsdp_is_refused(monkeypatch):
    tp = load_recipe("_tp")
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    with pytest.raises(ValueError, match="--tp_size 2 with FSDP"):
        tp.check_tp_args(_args(), SimpleNamespace(num_processes=2))


def test_tp_size_must_divide_the_heads(tmp_path):
    from transformers import Qwen3Config

    tp = load_recipe("_tp")
    Qwen3Config(hidden_size=48, num_attention_heads=6, num_key_value_heads=3, head_dim=8).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"does not divide .*'s num_key_value_heads \(3\)"):
        tp.tp_load_kwargs(_args(), str(tmp_path))
    with pytest.raises(ValueError, match=r"num_attention_heads \(6\)"):
        tp.tp_load_kwargs(_args(tp_size=4), str(tmp_path))
    assert tp.tp_load_kwargs(_args(tp_size=1), str(tmp_path)) == {}


def test_the_embedded_model_divides_by_two():
    """The demo's warm start (trainers.tasks.build_tiny_model: 4 attention heads, 4 KV heads) shards 2 (or 4) ways."""
    from trainers.tasks import build_tiny_model, make_addition_tokenizer

    config = build_tiny_model(make_addition_tokenizer()).config
    assert config.num_attention_heads % 2 == 0 and config.num_key_value_heads % 2 == 0


def test_the_trainer_refuses_what_tp_cannot_run():
    from trainers.tensor_parallel import check_tp_trainer

    def trainer(world=2, **config):
        cfg = SimpleNamespace(fsdp=False, **config)
        return SimpleNamespace(accelerator=SimpleNamespace(num_processes=world), config=cfg, uses_reference=False)

    with pytest.raises(ValueError, match="tp_size=2, which does not divide the 3 processes"):
        check_tp_trainer(trainer(world=3), 2)
    with pytest.raises(ValueError, match="2 data-parallel groups of TP ranks"):
        check_tp_trainer(trainer(world=4), 2)
    with pytest.raises(ValueError, match="batch_invariant=True does not run on a tensor-parallel policy"):
        check_tp_trainer(trainer(batch_invariant=True), 2)
    check_tp_trainer(trainer(), 2)  # one TP group, nothing else on: fine
