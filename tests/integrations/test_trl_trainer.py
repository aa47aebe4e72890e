"""`make_rollout_func` inside TRL's real `GRPOTrainer` (skipped without trl): rows and counts as TRL
consumes them, its logprobs equal to TRL's own recomputation, the version bump per optimizer step, the
engine sharing the trainer's parameters, and eval with `num_generations_eval`."""

from __future__ import annotations

import os

import pytest
import torch

trl = pytest.importorskip("trl", reason="the TRL integration tests need trl (pip install -e '.[trl]')")

from rollout import ContinuousBatchingConfig  # noqa: E402
from rollout.integrations.trl import GAP_MAX, GAP_MEAN, make_rollout_func  # noqa: E402
from trainers.tasks import AdditionTask, addition_reward, build_tiny_model, make_addition_tokenizer  # noqa: E402

ENGINE = ContinuousBatchingConfig(page_size=4, num_blocks=128, max_batch_tokens=256)


class Recorder:
    """Passes TRL's calls through to the rollout function and keeps what went in and out."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.calls: list[tuple[str, list, dict]] = []

    def __call__(self, prompts, trainer):
        out = self.inner(prompts, trainer)
        self.calls.append(("train" if trainer.model.training else "eval", list(prompts), out))
        return out


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """Two GRPO steps of 4 prompts x 4 samples, then one evaluation with num_generations_eval=2."""
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    tokenizer = make_addition_tokenizer()
    model = build_tiny_model(tokenizer, hidden_size=32, num_layers=2, num_heads=2, seed=0)
    task = AdditionTask(num_digits=2, seed=0)
    args = trl.GRPOConfig(
        output_dir=str(tmp_path_factory.mktemp("trl")),
        per_device_train_batch_size=16,
        num_generations=4,
        num_generations_eval=2,
        per_device_eval_batch_size=4,
        max_completion_length=4,
        max_steps=2,
        learning_rate=1e-2,
        logging_steps=1,
        bf16=False,  # NOTE: TRL's default bf16 autocast would put its own rounding (~1e-3) into the gap
        use_cpu=True,
        report_to=[],
        save_strategy="no",
        disable_tqdm=True,
        seed=0,
    )
    rollout = Recorder(make_rollout_func(ENGINE, logprob_probe=True))
    trainer = trl.GRPOTrainer(
        model=model, reward_funcs=addition_reward, args=args, processing_class=tokenizer, rollout_func=rollout,
        train_dataset=task.to_dataset(32, seed=1), eval_dataset=task.to_dataset(2, seed=2),
    )
    before = [p.detach().clone() for p in model.parameters()]
    trainer.train()
    eval_metrics = trainer.evaluate()
    yield trainer, rollout, before, eval_metrics
    rollout.inner.close()


def test_rows_reach_trl_in_its_order(run):
    trainer, rollout, _, _ = run
    train_calls = [c for c in rollout.calls if c[0] == "train"]
    assert len(train_calls) == 2
    for _, prompts, out in train_calls:
        assert len(prompts) == 16 and len(set(prompts)) == 4
        assert all(prompts[i] == prompts[i - i % 4] for i in range(16))  # TRL repeats each prompt 4x, adjacent
        assert all(len(out[k]) == 16 for k in ("prompt_ids", "completion_ids", "logprobs", "finish_reasons"))
        tok = trainer.processing_class
        assert out["prompt_ids"] == [tok(p)["input_ids"] for p in prompts]
    rewards = [h for h in trainer.state.log_history if "reward" in h]
    assert len(rewards) == 2 and all(0.0 <= h["reward"] <= 1.0 for h in rewards)


def test_logprobs_equal_trls_recomputation(run):
    """The probe logs, under TRL's own names, |rollout logprob - TRL's recomputation| over every token.
    (Before the engine ran the model class's forward, TRL's replaced forward made this ~0.1.)"""
    trainer, _, _, _ = run
    logs = [h for h in trainer.state.log_history if GAP_MEAN in h]
    assert len(logs) == 2
    assert all(h[GAP_MAX] < 1e-4 and h[GAP_MEAN] < 1e-5 for h in logs), logs


def test_policy_version_follows_the_optimizer_steps(run):
    trainer, rollout, before, _ = run
    versions = [h["rollout/policy_version"] for h in trainer.state.log_history if "rollout/policy_version" in h]
    assert versions == [0.0, 1.0]
    model = trainer.accelerator.unwrap_model(trainer.model)
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))  # it trained
    view = rollout.inner.engine.manager.core.view  # NOTE: the engine runs the trainer's own tensors
    for a, b in zip(model.parameters(), view.parameters(), strict=True):
        assert a.data_ptr() == b.data_ptr()


def test_eval_generates_num_generations_eval_per_prompt(run):
    _, rollout, _, eval_metrics = run
    eval_calls = [c for c in rollout.calls if c[0] == "eval"]
    assert eval_calls
    prompts = [p for _, ps, _ in eval_calls for p in ps]
    assert len(prompts) == 4 and len(set(prompts)) == 2  # 2 prompts x num_generations_eval=2
    assert sum(len(out["completion_ids"]) for _, _, out in eval_calls) == 4
    assert "eval_reward" in eval_metrics and "eval_rollout/generate_s" in eval_metrics
