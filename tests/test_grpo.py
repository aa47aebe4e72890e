"""GRPO trainer on a tiny addition model: weight sync, parity probe, metrics, DAPO, checkpoints."""

from __future__ import annotations

import json

import pytest
import torch

from rollout import ContinuousBatchingConfig
from trainers import GRPOConfig, GRPOTrainer, score_completions
from trainers.tasks import AdditionTask, addition_reward, build_tiny_model, make_addition_tokenizer

STEP_FIELDS = (
    "step",
    "reward_mean",
    "reward_std",
    "loss",
    "clip_fraction",
    "kl",
    "entropy",
    "response_length",
    "rollout_tokens_per_s",
    "time_generate",
    "time_train",
    "time_sync",
    "logprob_mismatch_max",
    "logprob_mismatch_mean",
    "policy_version",
    "lr",
)
FIXED_PROMPT = "123+456="


def digit_share(prompts, completions, **columns):
    """Dense toy reward: the share of digit characters (varies inside a group from the start)."""
    return [sum(ch.isdigit() for ch in c) / max(len(c), 1) for c in completions]


@pytest.fixture(scope="module")
def tokenizer():
    return make_addition_tokenizer()


@pytest.fixture(scope="module")
def dataset():
    return AdditionTask(num_digits=3, seed=0).to_dataset(64)


def make_trainer(tokenizer, dataset, tmp_path, **overrides) -> GRPOTrainer:
    settings = dict(
        output_dir=str(tmp_path),
        max_steps=3,
        prompts_per_step=4,
        group_size=4,
        max_new_tokens=6,
        temperature=(1.0, 1.0, 0.7, 1.3),
        learning_rate=2e-3,
        num_minibatches=2,
        gradient_accumulation_steps=2,
        reward_weights=(1.0, 0.5),
        log_stdout=False,
        progress=False,
        engine_config=ContinuousBatchingConfig(page_size=4, num_blocks=128, max_batch_tokens=256),
    )
    settings.update(overrides)
    model = build_tiny_model(tokenizer, hidden_size=64, num_layers=2, seed=0)
    return GRPOTrainer(model, tokenizer, [addition_reward, digit_share], dataset, GRPOConfig(**settings))


def engine_vs_trainer(trainer: GRPOTrainer, tokenizer) -> float:
    """Greedy rollout of the fixed prompt: max |engine raw logprob - trainer log_softmax|."""
    batch = trainer.engine.generate([tokenizer(FIXED_PROMPT).input_ids], temps=0.0, max_new_tokens=6)
    with torch.no_grad():
        logits = trainer.policy(input_ids=batch.input_ids).logits.float()  # [1, P+T, V]
    logits = logits[:, batch.prompt_ids.shape[1] - 1 : -1]  # [1, T, V]
    mine = torch.log_softmax(logits, -1).gather(-1, batch.completion_ids[..., None]).squeeze(-1)
    return (mine - batch.logprobs)[batch.completion_mask.bool()].abs().max().item()


def snapshot(trainer) -> dict[str, torch.Tensor]:
    return {
        k: v.detach().clone() for k, v in trainer.accelerator.unwrap_model(trainer.model).state_dict().items()
    }


def max_change(a: dict, b: dict) -> float:
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


def test_grpo_smoke_updates_syncs_and_logs(tokenizer, dataset, tmp_path):
    trainer = make_trainer(tokenizer, dataset, tmp_path, beta=0.05, tis_cap=2.0)
    # NOTE: the fixed prompt's full pages are now in the prefix cache; a missed flush would reuse them.
    assert engine_vs_trainer(trainer, tokenizer) < 1e-5
    before = snapshot(trainer)
    for step in range(1, 4):
        metrics = trainer.step()
        after = snapshot(trainer)
        assert max_change(before, after) > 0, f"step {step} left the parameters unchanged"
        assert trainer.engine.policy_version == step
        assert engine_vs_trainer(trainer, tokenizer) < 1e-5, f"engine weights stale after step {step}"
        assert metrics["step"] == step and metrics["policy_version"] == step - 1
        assert 0.0 <= metrics["logprob_mismatch_max"] <= 1e-4
        assert metrics["logprob_mismatch_mean"] <= metrics["logprob_mismatch_max"]
        before = after
    trainer.close()

    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines] == [1, 2, 3]
    for line in lines:
        missing = [f for f in STEP_FIELDS if f not in line]
        assert not missing, f"metrics.jsonl lacks {missing}"
        assert line["kl"] >= 0 and line["entropy"] > 0 and line["rollout_tokens_per_s"] > 0
    assert lines[0]["kl"] == pytest.approx(0.0, abs=1e-6)  # the policy starts as its reference
    assert lines[-1]["kl"] > 0


def test_cast_copy_engine_is_stale_until_synced(tokenizer, dataset, tmp_path):
    trainer = make_trainer(tokenizer, dataset, tmp_path, engine_dtype="float32")
    assert trainer.engine.model is not trainer.policy
    data, metrics = trainer.collect()
    assert metrics["logprob_mismatch_max"] <= 1e-4
    trainer.optimize(data)
    # NOTE: the copy still holds the old weights: the probe must see it, then the sync must fix it.
    assert engine_vs_trainer(trainer, tokenizer) > 1e-4
    trainer.sync_weights()
    assert engine_vs_trainer(trainer, tokenizer) < 1e-5
    trainer.close()


def test_dapo_drops_constant_groups(tokenizer, dataset, tmp_path):
    def constant(prompts, completions, **columns):
        return [1.0] * len(completions)

    model = build_tiny_model(tokenizer, hidden_size=64, num_layers=2, seed=0)
    config = GRPOConfig(
        output_dir=str(tmp_path),
        algorithm="dapo",
        prompts_per_step=2,
        group_size=4,
        max_new_tokens=4,
        learning_rate=1e-2,
        log_stdout=False,
        progress=False,
        engine_config=ContinuousBatchingConfig(page_size=4, num_blocks=64),
    )
    trainer = GRPOTrainer(model, tokenizer, constant, dataset, config)
    before = snapshot(trainer)
    metrics = trainer.step()
    assert metrics["kept_fraction"] == 0.0
    assert max_change(before, snapshot(trainer)) == 0.0  # no group carried any signal
    trainer.close()


@pytest.mark.parametrize("algorithm", ["grpo", "dr_grpo", "dapo"])
def test_gradient_accumulation_equals_one_big_batch(tokenizer, dataset, tmp_path, algorithm):
    """SGD at lr 1 makes the update the gradient itself: 4 accumulated micro-batches must give
    the gradient of the whole batch under each variant's aggregation."""
    deltas, data = [], None
    for accumulation in (1, 4):
        model = build_tiny_model(tokenizer, hidden_size=64, num_layers=2, seed=0)
        config = GRPOConfig(
            output_dir=str(tmp_path),
            algorithm=algorithm,
            prompts_per_step=4,
            group_size=4,
            max_new_tokens=6,
            gradient_accumulation_steps=accumulation,
            max_grad_norm=None,
            log_stdout=False,
            progress=False,
            engine_config=ContinuousBatchingConfig(page_size=4, num_blocks=128, max_batch_tokens=256),
        )
        optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
        trainer = GRPOTrainer(
            model, tokenizer, [addition_reward, digit_share], dataset, config, optimizer=optimizer
        )
        if data is None:
            data, _ = trainer.collect()
        before = snapshot(trainer)
        trainer.optimize(data)
        after = snapshot(trainer)
        deltas.append({k: after[k] - before[k] for k in before})
        trainer.close()
    assert max(d.abs().max().item() for d in deltas[0].values()) > 1e-4  # a real update happened
    assert max_change(*deltas) < 1e-6


def test_checkpoint_resume_reproduces_the_next_step(tokenizer, dataset, tmp_path):
    schedule = dict(lr_schedule="linear", warmup_steps=1, num_iterations=2)
    straight = make_trainer(tokenizer, dataset, tmp_path / "a", **schedule)
    expected = [straight.step() for _ in range(3)]
    final = snapshot(straight)
    straight.close()

    first = make_trainer(tokenizer, dataset, tmp_path / "b", **schedule)
    first.step(), first.step()
    path = first.save_checkpoint()
    first.close()

    resumed = make_trainer(tokenizer, dataset, tmp_path / "c", **schedule)
    resumed.load_checkpoint(path)
    assert resumed.step_count == 2
    metrics = resumed.step()
    resumed.close()
    assert max_change(final, snapshot(resumed)) < 1e-6  # measured: bitwise equal on CPU
    for key in ("step", "reward_mean", "loss", "lr", "policy_version", "response_length"):
        assert metrics[key] == pytest.approx(expected[2][key], rel=1e-5, abs=1e-6), key


def test_rewards_combine_with_weights_and_see_dataset_columns():
    rows = [{"prompt": "1+1=", "answer": "2"}, {"prompt": "2+2=", "answer": "4"}]
    completions = ["2", "3", "4", "x4"]
    rewards, metrics = score_completions(
        [addition_reward, digit_share], rows, completions, group_size=2, weights=[1.0, 0.5]
    )
    assert rewards.tolist() == pytest.approx([1.5, 0.5, 1.5, 0.25])  # the answer column reached the verifier
    assert metrics == pytest.approx({"reward/addition_reward": 0.5, "reward/digit_share": 0.875})


def test_config_refuses_uneven_micro_batches():
    with pytest.raises(ValueError, match="micro-batches"):
        GRPOConfig(prompts_per_step=3, group_size=2, num_minibatches=4)
    with pytest.raises(ValueError, match="PPOTrainer"):
        GRPOConfig(algorithm="ppo")
    with pytest.raises(ValueError, match="temperature"):
        GRPOConfig(prompts_per_step=2, temperature=(1.0, 0.5, 0.2))
