"""Trainers on any engine-like rollout, and async from a user's own loop of `step()` (issue 47).

- `GRPOTrainer(..., rollout=engine)` with a `RolloutEngine` the caller built on the model reproduces the trainer
  that builds its own engine, step for step; an object without the engine's API is refused by name;
- `async_rollout=True` driven by `step()` (no `train()`) runs ahead: the producer starts at the first step,
  tokens are stale by at most `max_staleness`, and `close()` stops it; a step past `max_steps` is refused by name.
"""

from __future__ import annotations

import pytest
import torch
from support.training import digit_share, trained_state

from rollout import ContinuousBatchingConfig, RolloutEngine
from trainers import GRPOConfig, GRPOTrainer
from trainers.tasks import addition_reward, build_tiny_model

pytestmark = pytest.mark.timeout(300)

ENGINE = ContinuousBatchingConfig(page_size=4, num_blocks=128, max_batch_tokens=256)


def config(tmp_path, **overrides) -> GRPOConfig:
    settings = dict(output_dir=str(tmp_path), max_steps=3, prompts_per_step=4, group_size=4, max_new_tokens=8,
                    temperature=1.0, learning_rate=2e-3, num_minibatches=2, log_stdout=False, progress=False,
                    engine_config=ENGINE)
    settings.update(overrides)
    return GRPOConfig(**settings)


def test_a_given_engine_reproduces_the_trainers_own(tokenizer, dataset, tmp_path):
    reward = [addition_reward, digit_share]
    model = build_tiny_model(tokenizer, hidden_size=64, num_layers=2, seed=0)
    with GRPOTrainer(model, tokenizer, reward, dataset, config(tmp_path / "own")) as own:
        own_history = own.train()
        own_state = trained_state(own)
    model = build_tiny_model(tokenizer, hidden_size=64, num_layers=2, seed=0)
    engine = RolloutEngine(model, tokenizer=tokenizer, config=ENGINE)
    with GRPOTrainer(model, tokenizer, reward, dataset, config(tmp_path / "given"), rollout=engine) as given:
        assert given.engine is engine
        history = given.train()
        state = trained_state(given)
        assert engine.policy_version == 3  # every step's sync reached it
    for want, got in zip(own_history, history, strict=True):
        for key in ("reward_mean", "loss", "response_length", "grad_norm", "policy_version"):
            assert got[key] == want[key], (got["step"], key)
    for name, tensor in own_state.items():
        assert torch.equal(state[name], tensor), name


def test_a_rollout_without_the_engine_api_is_refused(tokenizer, dataset, tmp_path):
    model = build_tiny_model(tokenizer, hidden_size=64, num_layers=2, seed=0)
    with pytest.raises(ValueError, match=r"rollout must be a rollout.Rollout"):
        GRPOTrainer(model, tokenizer, addition_reward, dataset, config(tmp_path), rollout=object.__new__(_OnlyGenerate))


def test_async_on_an_engine_sharing_the_trainers_weights_is_refused(tokenizer, dataset, tmp_path):
    model = build_tiny_model(tokenizer, hidden_size=64, num_layers=2, seed=0)
    with RolloutEngine(model, tokenizer=tokenizer, config=ENGINE) as engine, \
            pytest.raises(ValueError, match="build it on a copy"):
        GRPOTrainer(model, tokenizer, addition_reward, dataset, config(tmp_path, async_rollout=True), rollout=engine)


class _OnlyGenerate:
    def generate(self, *args, **kwargs):
        raise AssertionError("never called")


def test_async_is_honoured_by_a_loop_of_step(tokenizer, dataset, tmp_path):
    model = build_tiny_model(tokenizer, hidden_size=64, num_layers=2, seed=0)
    cfg = config(tmp_path, async_rollout=True, max_staleness=1, max_steps=4)
    run = GRPOTrainer(model, tokenizer, [addition_reward, digit_share], dataset, cfg)
    try:
        assert run.rollouts is None  # nothing runs before the first step
        history = [run.step() for _ in range(4)]  # NOTE: the user's own loop, no train()
        producer = run.rollouts.thread
        assert run.engine.model is not run.policy  # generation on its own copy, as under train()
        with pytest.raises(ValueError, match="max_steps"):
            run.step()  # past the producer's last step: refused by name, never silently synchronous
    finally:
        run.close()
    assert run.rollouts is None and not producer.is_alive()  # close() stopped the producer
    assert [h["step"] for h in history] == [1, 2, 3, 4]
    assert history[0]["staleness_max"] == 0.0
    assert max(h["staleness_max"] for h in history) == 1.0  # it ran ahead, never more than 1 version
    assert any(h["stale_fraction"] > 0 for h in history)
    assert all("time_generate_exposed" in h for h in history)
    state, engine_state = trained_state(run), run.engine.model.state_dict()
    for name, tensor in state.items():
        assert torch.equal(engine_state[name], tensor), name  # every sync reached the engine's copy


def test_ppo_takes_a_given_engine_too(tokenizer, dataset, tmp_path):
    from trainers import PolicyWithValue, PPOConfig, PPOTrainer

    def value_model() -> PolicyWithValue:
        with torch.random.fork_rng():  # NOTE: the value head's initialisation, the same in both runs
            torch.manual_seed(0)
            return PolicyWithValue(build_tiny_model(tokenizer, hidden_size=64, num_layers=2, seed=0))

    cfg = dict(max_steps=2, prompts_per_step=8, group_size=2, max_new_tokens=6, learning_rate=1e-3, num_minibatches=2,
               value_clip=None, log_stdout=False, progress=False, engine_config=ENGINE)
    with PPOTrainer(
        value_model(), tokenizer, digit_share, dataset, PPOConfig(output_dir=str(tmp_path / "own"), **cfg)
    ) as own:
        own_history = own.train()
    model = value_model()
    engine = RolloutEngine(model.policy, tokenizer=tokenizer, config=ENGINE)
    with PPOTrainer(model, tokenizer, digit_share, dataset, PPOConfig(output_dir=str(tmp_path / "given"), **cfg),
                    rollout=engine) as given:
        assert given.engine is engine
        history = given.train()
        assert engine.policy_version == 2
    for want, got in zip(own_history, history, strict=True):
        for key in ("reward_mean", "loss", "response_length"):
            assert got[key] == want[key], (got["step"], key)
