"""PPO trainer with a value head on a tiny addition model."""

from __future__ import annotations

import pytest
import torch
from support.training import digit_share

from rollout import ContinuousBatchingConfig
from trainers import PolicyWithValue, PPOConfig, PPOTrainer
from trainers.ppo import whiten
from trainers.tasks import AdditionTask, build_tiny_model


def seeded_value_model(tokenizer, seed: int = 0) -> PolicyWithValue:
    """The policy and a value head whose initialisation does not depend on the global RNG."""
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return PolicyWithValue(build_tiny_model(tokenizer, hidden_size=64, num_layers=2, seed=0))


def make_trainer(tokenizer, tmp_path, model=None, **overrides) -> PPOTrainer:
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
    model = model if model is not None else build_tiny_model(tokenizer, hidden_size=64, num_layers=2, seed=0)
    dataset = AdditionTask(num_digits=3, seed=0).to_dataset(64)
    return PPOTrainer(model, tokenizer, digit_share, dataset, PPOConfig(**settings))


def policy_params(trainer) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in trainer.policy.state_dict().items()}


def test_value_loss_falls_on_a_fixed_batch(tokenizer, tmp_path):
    trainer = make_trainer(tokenizer, tmp_path, num_minibatches=1)
    assert isinstance(trainer.value_model, PolicyWithValue)
    assert trainer.engine.model is trainer.policy  # the engine runs the LM inside the value model
    data, metrics = trainer.collect()
    assert metrics["logprob_mismatch_max"] <= 1e-4
    assert data["returns"].shape == data["old_values"].shape == data["completion_ids"].shape
    losses = [trainer.optimize(data)["value_loss"] for _ in range(12)]
    assert losses[-1] < 0.5 * losses[0], losses
    assert sum(b < a for a, b in zip(losses, losses[1:], strict=False)) >= 8, losses
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


def test_ppo_resume_restores_the_value_head_and_reproduces_the_next_step(tokenizer, tmp_path):
    def state(trainer):
        return {k: v.detach().clone() for k, v in trainer.value_model.state_dict().items()}

    straight = make_trainer(tokenizer, tmp_path / "a", model=seeded_value_model(tokenizer), max_steps=3)
    expected = [straight.step() for _ in range(3)]
    final = state(straight)
    straight.close()

    first = make_trainer(tokenizer, tmp_path / "b", model=seeded_value_model(tokenizer), max_steps=3)
    first.step(), first.step()
    saved_head = {k: v.clone() for k, v in first.value_model.value_head.state_dict().items()}
    path = first.save_checkpoint()
    first.close()

    resumed = make_trainer(tokenizer, tmp_path / "c", model=seeded_value_model(tokenizer, seed=1), max_steps=3)
    head = resumed.value_model.value_head.state_dict()
    assert not torch.equal(head["weight"], saved_head["weight"])  # a different head before loading
    resumed.load_checkpoint(path)
    for key, value in resumed.value_model.value_head.state_dict().items():
        assert torch.equal(value, saved_head[key]), key
    metrics = resumed.step()
    resumed.close()
    assert max((final[k] - v).abs().max().item() for k, v in state(resumed).items()) < 1e-6
    for key in ("reward_mean", "loss", "value_loss", "policy_version"):
        assert metrics[key] == pytest.approx(expected[2][key], rel=1e-5, abs=1e-6), key
