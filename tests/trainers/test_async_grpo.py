"""Asynchronous GRPO (issue 28): `GRPOConfig(async_rollout=True, max_staleness=K)`.

- K = 0 reproduces the synchronous trainer's updates exactly (same seeds: same rewards, losses, weights);
- K = 1 trains on batches generated one version behind (staleness metrics, importance weights on stale
  tokens), the engine's copy of the weights follows the learner;
- the staleness correction by hand on a small batch.
"""

from __future__ import annotations

import math

import pytest
import torch
from support.training import digit_share, trained_state

from rollout import ContinuousBatchingConfig
from trainers import GRPOConfig, GRPOTrainer
from trainers.async_rollout import stale_correction
from trainers.tasks import addition_reward, build_tiny_model

pytestmark = pytest.mark.timeout(180)


def make_trainer(tokenizer, dataset, tmp_path, **overrides) -> GRPOTrainer:
    settings = dict(
        output_dir=str(tmp_path),
        max_steps=3,
        prompts_per_step=4,
        group_size=4,
        max_new_tokens=8,
        temperature=1.0,
        learning_rate=2e-3,
        num_minibatches=2,
        log_stdout=False,
        progress=False,
        engine_config=ContinuousBatchingConfig(page_size=4, num_blocks=128, max_batch_tokens=256),
    )
    settings.update(overrides)
    model = build_tiny_model(tokenizer, hidden_size=64, num_layers=2, seed=0)
    return GRPOTrainer(model, tokenizer, [addition_reward, digit_share], dataset, GRPOConfig(**settings))


def test_max_staleness_zero_reproduces_the_synchronous_update(tokenizer, dataset, tmp_path):
    with make_trainer(tokenizer, dataset, tmp_path / "sync") as sync:
        sync_history = sync.train()
        sync_state = trained_state(sync)
    with make_trainer(tokenizer, dataset, tmp_path / "async", async_rollout=True, max_staleness=0) as run:
        assert run.engine.model is not run.policy  # the engine generates on its own copy
        history = run.train()
        state = trained_state(run)
        engine_state = run.engine.model.state_dict()
    for want, got in zip(sync_history, history, strict=True):
        for key in ("reward_mean", "loss", "clip_fraction", "response_length", "grad_norm", "policy_version"):
            assert got[key] == want[key], (got["step"], key)
        assert got["staleness_max"] == 0.0 and got["stale_fraction"] == 0.0
    for name, tensor in sync_state.items():
        assert torch.equal(state[name], tensor), name
        assert torch.equal(engine_state[name], tensor), name  # the last sync reached the engine
    assert sync_history[-1]["loss"] != sync_history[0]["loss"]  # it did train


def test_staleness_one_runs_ahead_and_corrects_stale_tokens(tokenizer, dataset, tmp_path):
    with make_trainer(tokenizer, dataset, tmp_path, async_rollout=True, max_staleness=1, max_steps=4) as run:
        history = run.train()
        state = trained_state(run)
        engine_state = run.engine.model.state_dict()
    assert [h["step"] for h in history] == [1, 2, 3, 4]
    assert history[0]["staleness_max"] == 0.0  # step 0's batch comes from the initial weights
    assert max(h["staleness_max"] for h in history) == 1.0  # later ones ran ahead, never more than 1
    assert all(0.0 <= h["staleness_mean"] <= 1.0 and h["stale_masked_fraction"] == 0.0 for h in history)
    stale_steps = [h for h in history if h["stale_fraction"] > 0]
    assert stale_steps and all(h["stale_logprob_gap"] > 0 for h in stale_steps)
    for h in history:
        assert h["time_generate_exposed"] >= 0 and h["time_generate_overlapped"] >= 0
        assert math.isclose(h["time_generate_overlapped"] + h["time_generate_exposed"], h["time_generate"],
                            rel_tol=1e-6) or h["time_generate_overlapped"] == 0.0
    for name, tensor in state.items():
        assert torch.equal(engine_state[name], tensor), name


def test_stale_correction_by_hand():
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]], dtype=torch.bool)
    versions = torch.tensor([[5, 5, 4, 0], [3, 4, 5, 5]])  # learner at 5: staleness 0 0 1 / 2 1 0 0
    rollout = torch.tensor([[-1.0, -2.0, -1.0, 0.0], [-3.0, -0.5, -1.0, -1.0]])
    old = torch.tensor([[-1.1, -2.0, -0.2, 0.0], [-1.0, -0.7, -1.0, -1.0]])
    data = {"loss_mask": mask.clone(), "versions": versions, "rollout_logprobs": rollout, "old_logprobs": old}
    metrics = stale_correction(data, version=5, max_staleness=1, tis_cap=2.0, mask_stale=True)
    w = data["tis_weights"]
    assert w[0, 0] == 1.0 and w[0, 1] == 1.0 and w[1, 2] == 1.0  # fresh tokens: untouched
    assert torch.isclose(w[1, 1], torch.exp(torch.tensor(-0.2)))  # stale: exp(old - rollout)
    assert w[0, 2] == 2.0 and w[1, 0] == 2.0  # capped (exp(0.8), exp(2.0) > 2)
    assert data["loss_mask"].tolist() == [[True, True, True, False], [False, True, True, True]]  # staleness 2 > K
    assert metrics["staleness_max"] == 2.0
    assert math.isclose(metrics["staleness_mean"], 4 / 7, rel_tol=1e-6)
    assert math.isclose(metrics["stale_fraction"], 3 / 7, rel_tol=1e-6)
    assert math.isclose(metrics["stale_logprob_gap"], (0.8 + 2.0 + 0.2) / 3, rel_tol=1e-6)
    assert math.isclose(metrics["stale_masked_fraction"], 1 / 7, rel_tol=1e-6)
    # NOTE: the engine against the behaviour policy: only the tokens version 5 sampled, the largest gap 0.1
    assert math.isclose(metrics["fresh_logprob_mismatch_max"], 0.1, rel_tol=1e-5)
    fresh = {"loss_mask": mask.clone(), "versions": torch.where(mask, 5, 0), "rollout_logprobs": rollout,
             "old_logprobs": old}
    stale_correction(fresh, version=5, max_staleness=0, tis_cap=2.0, mask_stale=True)
    assert "tis_weights" not in fresh and torch.equal(fresh["loss_mask"], mask)  # K = 0: the sync update


def test_async_config_errors():
    with pytest.raises(ValueError, match="max_staleness"):
        GRPOConfig(async_rollout=True, max_staleness=-1)
    with pytest.raises(ValueError, match="stale_tis_cap"):
        GRPOConfig(async_rollout=True, stale_tis_cap=0.0)
    with pytest.raises(ValueError, match="max_resample_rounds"):
        GRPOConfig(async_rollout=True, algorithm="dapo", max_resample_rounds=2)
