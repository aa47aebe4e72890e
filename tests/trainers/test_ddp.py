"""Data parallelism on two CPU ranks (gloo) through `accelerate launch`: an update on two ranks
equals one process's update on the combined batch (GRPO, DAPO, PPO); real runs keep the ranks
(value head included) identical while they roll out different prompts; eval_sweep splits prompts."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from accelerate import Accelerator
from accelerate.state import AcceleratorState

ROOT = Path(__file__).resolve().parents[2]
WORKER = ROOT / "tests" / "support" / "ddp_worker.py"
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "recipes"))

from support import ddp_worker  # noqa: E402
from support.serving import free_port  # noqa: E402
from support.training import save_tiny_addition_checkpoint  # noqa: E402


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory):
    return save_tiny_addition_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny")


@pytest.fixture(scope="module")
def launched(tmp_path_factory, tiny_checkpoint):
    """The single-process references, then one two-rank launch of the worker."""
    out = tmp_path_factory.mktemp("ddp")
    # NOTE: accelerate's state is process-wide; an earlier test's (TRL: bf16) must not leak in here
    AcceleratorState._reset_state(reset_partial_state=True)
    accelerator = Accelerator(cpu=True)
    references = {}
    for algorithm in ddp_worker.ALGORITHMS:
        trainer = ddp_worker.build(algorithm, accelerator, str(out / "single"), prompts_per_step=4)
        init = ddp_worker.trained_state(trainer)
        data, metrics = trainer.collect()
        torch.save({"data": data, "init": init}, out / f"{algorithm}.pt")
        trainer.optimize(data)
        references[algorithm] = (init, ddp_worker.trained_state(trainer), data)
        trainer.close()
    sweep_args = ["--checkpoints", tiny_checkpoint, "--num_prompts", "6", "--temperatures", "0", "1.0",
                  "--samples", "2", "--ks", "1", "2", "--max_new_tokens", "3"]
    command = [
        sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
        "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
        "--main_process_port", str(free_port()), str(WORKER), "--out", str(out),
        "--sweep", *sweep_args, "--output_dir", str(out / "sweep"),
    ]
    # NOTE: the C++ decode kernels are not what this checks; SDPA spares each rank their load.
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), CUDA_VISIBLE_DEVICES="",
               ROLLOUT_CPU_KERNELS="0")
    proc = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return out, references, sweep_args


@pytest.mark.parametrize("algorithm", ddp_worker.ALGORITHMS)
def test_two_ranks_update_like_one_process_on_the_combined_batch(launched, algorithm):
    out, references, _ = launched
    init, single, data = references[algorithm]
    ddp = torch.load(out / f"{algorithm}_ddp.pt")
    assert max((single[k] - init[k]).abs().max().item() for k in init) > 1e-4  # a real update
    assert max((ddp[k] - single[k]).abs().max().item() for k in single) < 1e-6
    if algorithm == "dapo":
        # rank 1's half holds only constant groups: its token count is 0, rank 0's is not, so a
        # rank-local token mean would have doubled rank 0's share of the step.
        n = data["loss_mask"].shape[0] // 2
        assert data["loss_mask"][:n].sum() > 0 and data["loss_mask"][n:].sum() == 0


def test_real_runs_keep_ranks_identical_while_rolling_out_different_prompts(launched):
    out, _, _ = launched
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert [r["world"] for r in ranks] == [2, 2]
    for algorithm in ("grpo", "ppo"):
        zero = [r for r in ranks[0]["records"] if r["algorithm"] == algorithm]
        one = [r for r in ranks[1]["records"] if r["algorithm"] == algorithm]
        assert [r["step"] for r in zero] == [r["step"] for r in one] == [0, 1, 2]
        for a, b in zip(zero[1:], one[1:], strict=True):
            assert set(a["prompts"]).isdisjoint(b["prompts"]), "both ranks rolled out the same prompts"
            # all-reduced gradients keep every trained tensor equal (PPO: the value head too)
            assert a["hash"] == b["hash"], f"{algorithm}: ranks differ after step {a['step']}"
            assert a["mismatch"] <= 1e-4
        lines = (out / algorithm / "metrics.jsonl").read_text().splitlines()
        assert [json.loads(line)["step"] for line in lines] == [1, 2]  # the main process logs once
        # a reward metric only rank 0 logs (rank 1's prompts never vary) is gathered, not lost or NaN
        assert [a["varying_rows"] for a in zero[1:]] == [b["varying_rows"] for b in one[1:]] == [8.0, 8.0]
        assert [json.loads(line)["varying_rows"] for line in lines] == [8.0, 8.0]


def test_ppo_whitening_uses_statistics_over_all_ranks(launched):
    from trainers.ppo import whiten

    out, _, _ = launched
    halves = [next(r for r in json.loads((out / f"rank{k}.json").read_text())["records"] if r["algorithm"] == "whiten")
              for k in (0, 1)]
    x, mask = ddp_worker.whiten_inputs()
    got = torch.tensor(halves[0]["values"] + halves[1]["values"])
    assert torch.allclose(got, whiten(x, mask), atol=1e-5)  # the combined batch's statistics
    local = torch.cat([whiten(x[:4], mask[:4]), whiten(x[4:], mask[4:])])
    assert not torch.allclose(got, local, atol=1e-2)  # rank-local statistics would differ


def test_the_logged_reward_covers_every_rank(launched):
    """metrics.jsonl (written by rank 0 only) logs the mean and std of both ranks' rewards, not rank 0's."""
    out, _, _ = launched
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]
    differ = 0
    for algorithm in ("grpo", "ppo"):
        logged = [json.loads(line) for line in (out / algorithm / "metrics.jsonl").read_text().splitlines()]
        per_rank = [[r["rewards"] for r in rank["records"] if r["algorithm"] == algorithm and r["step"]]
                    for rank in ranks]
        for line, zero, one in zip(logged, *per_rank, strict=True):
            assert len(zero) == len(one) == 8  # 2 prompts x group of 4 on each rank
            both = torch.tensor(zero + one, dtype=torch.float64)
            assert line["reward_mean"] == pytest.approx(both.mean().item(), abs=1e-6), algorithm
            assert line["reward_std"] == pytest.approx(both.std().item(), abs=1e-6), algorithm
            differ += abs(sum(zero) / 8 - both.mean().item()) > 1e-3
    # NOTE: rank 1 holds the constant-1 prompts: rank 0's own mean is a different number
    assert differ == 4


def test_eval_sweep_splits_prompts_across_ranks_into_one_csv(launched, tmp_path):
    import eval_sweep

    out, _, sweep_args = launched
    with open(out / "sweep" / "sweep.csv", newline="") as f:
        two = list(csv.DictReader(f))
    assert [(r["temperature"], r["n"], r["prompts"]) for r in two] == [("0.0", "2", "6"), ("1.0", "2", "6")]
    one = eval_sweep.main([*sweep_args, "--output_dir", str(tmp_path)])
    # greedy: the same completions whichever rank generates them
    for key in ("reward_mean", "response_length", "pass@1", "pass@2"):
        assert float(two[0][key]) == pytest.approx(float(one[0][key])), key
