"""GRPO on a Ray fleet (issue 47): `GRPOTrainer(..., rollout=fleet)`, synchronous and with `async_rollout=True`.

- synchronous on a one-engine fleet: the same steps as the trainer's own in-process engine (same seeds, both
  batch-invariant): rewards, losses, trained weights;
- async (staleness 1) on the fleet: the fleet generates step k+1 in its actor while the learner trains on step k;
  tokens are stale by at most one version, every update reaches the engine (its version follows the learner's).
One local Ray cluster (2 CPUs, 127.0.0.1), closed by the fixture.
"""

from __future__ import annotations

import pytest
import torch
from support.training import digit_share, trained_state

from rollout import ContinuousBatchingConfig
from trainers import GRPOConfig, GRPOTrainer
from trainers.tasks import AdditionTask, addition_reward, build_tiny_model, make_addition_tokenizer

pytestmark = pytest.mark.timeout(600)

ENGINE = ContinuousBatchingConfig(page_size=4, num_blocks=128, max_batch_tokens=256, batch_invariant=True)
REWARDS = [addition_reward, digit_share]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    ray = pytest.importorskip("ray", reason="Ray fleet tests need ray (pip install -e '.[ray]')")
    if ray.is_initialized():
        pytest.skip("a Ray cluster is already connected in this process; the test starts and stops its own")
    from rollout.fleet import RolloutFleet

    tokenizer = make_addition_tokenizer()
    model_dir = tmp_path_factory.mktemp("addition") / "model"
    build_tiny_model(tokenizer, hidden_size=64, num_layers=2, seed=0).save_pretrained(model_dir)
    fleet = RolloutFleet(str(model_dir), num_engines=1, engine_config=ENGINE, tokenizer=tokenizer, num_cpus=2)
    yield fleet, tokenizer, AdditionTask(num_digits=3, seed=0).to_dataset(64)
    fleet.close()
    assert not ray.is_initialized()


def config(tmp_path, **overrides) -> GRPOConfig:
    settings = dict(output_dir=str(tmp_path), max_steps=3, prompts_per_step=4, group_size=4, max_new_tokens=8,
                    temperature=1.0, learning_rate=2e-3, num_minibatches=2, log_stdout=False, progress=False,
                    engine_config=ENGINE)
    settings.update(overrides)
    return GRPOConfig(**settings)


class _KeepOpen:
    """The fleet as a trainer's rollout, left open when the trainer closes (the module reuses it)."""

    def __init__(self, fleet) -> None:
        self.fleet = fleet

    def __getattr__(self, name):
        return getattr(self.fleet, name)

    def close(self) -> None:
        pass


def test_grpo_on_a_fleet_steps_like_the_in_process_engine(setup, tmp_path):
    fleet, tokenizer, dataset = setup
    with GRPOTrainer(build_tiny_model(tokenizer, hidden_size=64, num_layers=2, seed=0), tokenizer, REWARDS, dataset,
                     config(tmp_path / "own")) as own:
        own_history = own.train()
        own_state = trained_state(own)
    model = build_tiny_model(tokenizer, hidden_size=64, num_layers=2, seed=0)
    start = fleet.policy_version
    with GRPOTrainer(model, tokenizer, REWARDS, dataset, config(tmp_path / "fleet"), rollout=_KeepOpen(fleet)) as run:
        history = run.train()
        state = trained_state(run)
    assert fleet.policy_version == start + 3 and fleet.engine_versions() == [start + 3]
    for want, got in zip(own_history, history, strict=True):
        for key in ("reward_mean", "loss", "response_length", "grad_norm"):
            assert got[key] == want[key], (got["step"], key)
        assert got["logprob_mismatch_max"] < 1e-4  # the fleet's logprobs are the learner's own
    for name, tensor in own_state.items():
        assert torch.equal(state[name], tensor), name


def test_async_grpo_on_a_fleet_runs_ahead_by_one_version(setup, tmp_path):
    fleet, tokenizer, dataset = setup
    model = build_tiny_model(tokenizer, hidden_size=64, num_layers=2, seed=0)
    fleet.update_weights(model)  # NOTE: the module's earlier test trained the fleet's weights
    start = fleet.policy_version
    cfg = config(tmp_path, async_rollout=True, max_staleness=1, max_steps=4)
    with GRPOTrainer(model, tokenizer, REWARDS, dataset, cfg, rollout=_KeepOpen(fleet)) as run:
        assert run.engine.fleet is fleet
        history = [run.step() for _ in range(4)]  # NOTE: a user's loop of step(): async all the same
    assert fleet.policy_version == start + 4
    assert fleet.last_update_path == "collective"  # the default ("auto"): broadcast, in flight ("keep")
    assert history[0]["staleness_max"] == 0.0
    assert max(h["staleness_max"] for h in history) == 1.0
    assert any(h["stale_fraction"] > 0 for h in history)
    assert all(h["policy_version"] >= h["step"] - 2 for h in history)  # versions in RL steps, at most 1 behind
