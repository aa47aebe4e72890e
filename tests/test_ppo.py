"""PPO trainer with a value head on a tiny addition model."""

from __future__ import annotations

import pytest
import torch

from rollout import ContinuousBatchingConfig
from trainers import PolicyWithValue, PPOConfig, PPOTrainer
from trainers.ppo import whiten
from trainers.tasks import AdditionTask, build_tiny_model, make_addition_tokenizer


def digit_share(prompts, completions, **columns):
    return [sum(ch.isdigit() for ch in c) / max(len(c), 1) for c in completions]


@pytest.fixture(scope="module")
def tokenizer():
    return make_addition_tokenizer()


def make_trainer(tokenizer, tmp_path, **overrides) -> PPOTrainer:
    settings = dict(
        output_dir=str(tmp_path),
        max_steps=2,
        prompts_per_step=8,
        group_size=2,
        max_new_tokens=6,
        learning_rate=1e-3,
        num_minibatches=2,
        value_clip=None,
        log_stdout=False,
        progress=False,
        engine_config=ContinuousBatchingConfig(page_size=4, num_blocks=128, max_batch_tokens=256),
    )
    settings.update(overrides)
    model = build_tiny_model(tokenizer, hidden_size=64, num_layers=2, seed=0)
    dataset = AdditionTask(num_digits=3, seed=0).to_dataset(64)
    return PPOTrainer(model, tokenizer, digit_share, dataset, PPOConfig(**settings))


def policy_params(trainer) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in trainer.policy.state_dict().items()}


def test_value_loss_falls_on_a_fixed_batch_and_the_policy_moves(tokenizer, tmp_path):
    trainer = make_trainer(tokenizer, tmp_path, num_minibatches=1)
    assert isinstance(trainer.value_model, PolicyWithValue)
    assert trainer.engine.model is trainer.policy  # the engine runs the LM inside the value model
    before = policy_params(trainer)
    data, metrics = trainer.collect()
    assert metrics["logprob_mismatch_max"] <= 1e-4
    assert data["returns"].shape == data["old_values"].shape == data["completion_ids"].shape
    losses = [trainer.optimize(data)["value_loss"] for _ in range(12)]
    assert losses[-1] < 0.5 * losses[0], losses
    assert sum(b < a for a, b in zip(losses, losses[1:], strict=False)) >= 8, losses
    moved = max((before[k] - v).abs().max().item() for k, v in trainer.policy.state_dict().items())
    assert moved > 0
    trainer.close()


def test_ppo_steps_with_kl_penalty_log_and_sync(tokenizer, tmp_path):
    trainer = make_trainer(tokenizer, tmp_path, kl_coef=0.1, value_clip=0.2, gradient_accumulation_steps=2)
    history = trainer.train()
    assert [m["step"] for m in history] == [1, 2]
    for m in history:
        for key in ("value_loss", "policy_loss", "kl", "clip_fraction", "entropy", "logprob_mismatch_max"):
            assert key in m, key
        assert m["logprob_mismatch_max"] <= 1e-4
    assert history[0]["kl"] == pytest.approx(0.0, abs=1e-6) and history[1]["kl"] > 0
    assert trainer.engine.policy_version == 2
    assert (tmp_path / "metrics.jsonl").read_text().count("\n") == 2
    trainer.close()


def test_whiten_uses_only_masked_entries():
    x = torch.tensor([[1.0, 3.0, 100.0], [5.0, 7.0, -100.0]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 0]]).bool()
    out = whiten(x, mask)
    assert out[:, 2].tolist() == [0.0, 0.0]
    assert out[mask].mean().item() == pytest.approx(0.0, abs=1e-6)
    assert out[mask].var(unbiased=False).item() == pytest.approx(1.0, abs=1e-5)
