"""FSDP2 in the trainers on two CPU ranks (gloo), through `accelerate launch` with
recipes/accelerate/2cpu_fsdp.yaml: from the same weights and seeds an FSDP run and a DDP run give the same
losses and parameters for 3 steps (GRPO with a KL reference, PPO with its value head), the parity probe stays at
float error (each sync gathered the current weights), rank 0 holds half the policy, a sync gathers one
decoder layer at a time, and a sharded checkpoint resumes to the same step."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
WORKER = ROOT / "tests" / "support" / "fsdp_worker.py"
CONFIG = ROOT / "recipes" / "accelerate" / "2cpu_fsdp.yaml"
sys.path.insert(0, str(ROOT / "tests"))

from support.serving import free_port  # noqa: E402

from trainers import GRPOConfig  # noqa: E402
from trainers.sharding import fsdp_settings, param_fraction, parameter_buckets  # noqa: E402
from trainers.tasks import build_tiny_model, make_addition_tokenizer  # noqa: E402

PARAM_ATOL = 1e-6  # NOTE: measured 1.2e-7 (GRPO) and 3.3e-8 (PPO) after 3 AdamW steps at lr 1e-3


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("fsdp")
    command = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(CONFIG),
               "--main_process_port", str(free_port()), str(WORKER), "--out", str(out)]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), CUDA_VISIBLE_DEVICES="",
               ROLLOUT_CPU_KERNELS="0")
    proc = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return [torch.load(out / f"rank{r}.pt") for r in (0, 1)]


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


@pytest.mark.timeout(660)
@pytest.mark.parametrize("algorithm", ["grpo", "ppo"])
def test_fsdp_matches_ddp_step_for_step(ranks, algorithm):
    assert ranks[0]["world"] == 2
    ddp, fsdp = ranks[0]["runs"][f"{algorithm}_ddp"], ranks[0]["runs"][f"{algorithm}_fsdp"]
    assert not ddp[0]["sharded"] and fsdp[0]["sharded"]  # "auto" followed the launch config; False did not
    assert max_diff(ddp[0]["params"], fsdp[0]["params"]) == 0.0
    assert [r["step"] for r in fsdp] == [0, 1, 2, 3]
    for a, b in zip(ddp[1:], fsdp[1:], strict=True):
        assert max_diff(a["params"], ddp[0]["params"]) > 5e-4 * a["step"]  # real updates, every step
        assert max_diff(a["params"], b["params"]) < PARAM_ATOL, f"step {a['step']}"
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5, abs=1e-7)
        assert b["mismatch"] <= 1e-4 and a["mismatch"] <= 1e-4  # the engine ran the current weights
        assert b["sync_seconds"] > 0
    # the full policy for evaluation and save_pretrained: the current weights (PPO: without the value head)
    final = {k.removeprefix("policy."): v for k, v in fsdp[-1]["params"].items() if not k.startswith("value_head.")}
    assert max_diff(fsdp[-1]["gathered"], final) == 0.0


@pytest.mark.timeout(660)
def test_each_rank_holds_half_the_policy_and_a_sync_gathers_one_layer_at_a_time(ranks):
    fsdp = [ranks[r]["runs"]["grpo_fsdp"] for r in (0, 1)]
    assert [r["fraction"] for r in ranks[0]["runs"]["grpo_ddp"]] == [1.0] * 4
    assert all(0.45 <= r["fraction"] <= 0.55 for r in fsdp[0])  # metrics.jsonl: the logging rank's own
    assert fsdp[0][1]["fraction"] + fsdp[1][1]["fraction"] == pytest.approx(1.0)
    params = fsdp[0][0]["params"]
    total = sum(t.numel() * t.element_size() for t in params.values())
    layer = sum(t.numel() * t.element_size() for k, t in params.items() if k.startswith("model.layers.0."))
    for record in fsdp[0][1:]:
        # embeddings, layer 0, layer 1, final norm (the head is tied): never the whole model at once
        assert (record["buckets"], record["tensors"]) == (4, len(params))
        assert record["peak_bucket_bytes"] == layer < total / 2


@pytest.mark.timeout(660)
def test_a_sharded_checkpoint_resumes_to_the_same_step(ranks):
    resumed, continued = ranks[0]["runs"]["grpo_resumed"][0], ranks[0]["runs"]["grpo_fsdp"][3]
    assert resumed["step"] == continued["step"] == 3
    assert max_diff(resumed["params"], continued["params"]) < 1e-7
    assert resumed["loss"] == pytest.approx(continued["loss"], abs=1e-9)


def test_buckets_follow_the_decoder_layers_and_an_unsharded_policy_is_whole():
    model = build_tiny_model(make_addition_tokenizer(), hidden_size=32, num_layers=3, num_heads=2, seed=0)
    buckets = [[name for name, _ in bucket] for bucket in parameter_buckets(model)]
    assert buckets[0] == ["model.embed_tokens.weight"] and buckets[-1] == ["model.norm.weight"]
    assert [{n.split(".")[2] for n in b} for b in buckets[1:-1]] == [{"0"}, {"1"}, {"2"}]
    assert sum(map(len, buckets)) == len(list(model.parameters()))
    assert param_fraction(model) == 1.0


def test_fsdp_field_and_launch_settings_are_checked():
    with pytest.raises(ValueError, match="fsdp must be True, False or 'auto'"):
        GRPOConfig(fsdp="yes")
    from accelerate.utils import DistributedType

    single = SimpleNamespace(state=SimpleNamespace(), distributed_type=DistributedType.NO, mixed_precision="no")
    assert fsdp_settings("auto", single) is None  # no FSDP launch: DDP / one process as before
    assert fsdp_settings(False, single) is None
    assert fsdp_settings(True, single).reshard_after_forward
    version_one = SimpleNamespace(state=SimpleNamespace(fsdp_plugin=SimpleNamespace(fsdp_version=1)),
                                  distributed_type=DistributedType.FSDP, mixed_precision="no")
    with pytest.raises(ValueError, match="fsdp_version: 2"):
        fsdp_settings("auto", version_one)
