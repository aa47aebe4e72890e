"""The trainers are composed of parts (`trainers.parts`), not a stack of mixins (issue 56 item 5).

- GRPO / PPO inherit from `RLTrainer` and `object` only; `RLTrainer` from nothing but `object`;
- each part is the one its config asks for (LoRA, FSDP, batch invariance, routing replay, the KL reference, async);
- a part replaced on an instance is the one the trainer calls: a pass-through passes / feed part leaves a step's
  numbers exactly as they are, and sees every teacher-forced pass, optimizer step, generation and sync.
"""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch
from support.training import digit_share, trained_state

from rollout import ContinuousBatchingConfig
from trainers import GRPOConfig, GRPOTrainer, PPOConfig, PPOTrainer
from trainers.agent_grpo import AgentGRPOTrainer
from trainers.async_rollout import AsyncFeed, SyncFeed
from trainers.base import RLTrainer
from trainers.disagg import DisaggGRPOTrainer
from trainers.invariant import InvariantPasses, PlainPasses
from trainers.lora import FullWeights, LoraAdapter
from trainers.parts import choose_adapter, choose_feed, choose_layout, choose_passes
from trainers.reference import EngineReference
from trainers.sharding import FullyShardedLayout, Replicated
from trainers.tasks import addition_reward, build_tiny_model

pytestmark = pytest.mark.timeout(300)

ENGINE = ContinuousBatchingConfig(page_size=4, num_blocks=128, max_batch_tokens=256)


@pytest.mark.parametrize("cls", [GRPOTrainer, PPOTrainer])
def test_a_trainer_is_itself_its_base_and_object(cls):
    assert cls.__mro__ == (cls, RLTrainer, object)
    assert RLTrainer.__mro__ == (RLTrainer, object)
    # NOTE: the GRPO variants add their own class only
    assert AgentGRPOTrainer.__mro__[1:] == DisaggGRPOTrainer.__mro__[1:] == GRPOTrainer.__mro__


def test_each_part_is_the_one_the_config_asks_for():
    plain = SimpleNamespace(lora_rank=None, batch_invariant=False, fsdp=False, async_rollout=False)
    acc = SimpleNamespace(process_index=0, num_processes=1, unwrap_model=lambda m: m)
    policy = torch.nn.Linear(2, 2)
    assert type(choose_adapter(plain)) is FullWeights
    assert type(choose_adapter(SimpleNamespace(lora_rank=4))) is LoraAdapter
    assert type(choose_passes(plain, acc, policy)) is PlainPasses
    invariant = SimpleNamespace(batch_invariant=True, engine_dtype=None, engine_config=ENGINE)
    passes = choose_passes(invariant, acc, policy)
    assert type(passes) is InvariantPasses and passes.policy is policy and passes.page_size == ENGINE.page_size
    assert passes.invariant_model.kernels == "cpu"  # NOTE: the engine's mode on a CPU with its default backend
    beside_triton = SimpleNamespace(**invariant.__dict__ | {"engine_config": replace(ENGINE, attn_backend="triton")})
    assert choose_passes(beside_triton, acc, policy).invariant_model.kernels == "triton"  # NOTE: as the engine's
    assert type(choose_feed(plain)) is SyncFeed and type(choose_feed(SimpleNamespace())) is SyncFeed
    assert type(choose_feed(SimpleNamespace(async_rollout=True))) is AsyncFeed
    assert type(choose_layout(SimpleNamespace(accelerator=acc, config=plain), policy)) is Replicated
    one = SimpleNamespace(process_index=0, num_processes=1, mixed_precision="no", distributed_type="NO",
                          state=SimpleNamespace())
    sharded = SimpleNamespace(accelerator=one, config=SimpleNamespace(**plain.__dict__ | {"fsdp": True}))
    layout = choose_layout(sharded, policy)
    assert type(layout) is FullyShardedLayout and layout.fsdp is not None
    with pytest.raises(ValueError, match="batch_invariant does not run on FSDP"):
        sharded.config.batch_invariant = True
        choose_layout(sharded, policy)


def make(cls, tokenizer, dataset, tmp_path, **overrides):
    config_cls = PPOConfig if cls is PPOTrainer else GRPOConfig
    settings = dict(output_dir=str(tmp_path), max_steps=2, prompts_per_step=2, group_size=4, max_new_tokens=6,
                    temperature=1.0, learning_rate=2e-3, num_minibatches=2, log_stdout=False, progress=False,
                    engine_config=ENGINE)
    settings.update(overrides)
    model = build_tiny_model(tokenizer, hidden_size=32, num_layers=1, seed=0)
    torch.manual_seed(0)  # NOTE: PPO's value head draws its initial weights
    return cls(model, tokenizer, [addition_reward, digit_share], dataset, config_cls(**settings))


def test_a_trainer_holds_the_parts_of_its_config(tokenizer, dataset, tmp_path):
    with make(GRPOTrainer, tokenizer, dataset, tmp_path / "a", beta=0.1, async_rollout=True) as trainer:
        assert type(trainer.adapter) is FullWeights and type(trainer.layout) is Replicated
        assert type(trainer.passes) is PlainPasses and not trainer.routing.enabled
        assert type(trainer.feed) is AsyncFeed and trainer.sleeps is False and trainer.rollouts is None
        assert type(trainer.reference) is EngineReference and trainer.reference.model is trainer.ref_model
        assert trainer.engine.model is not trainer.policy  # NOTE: async: the engine on its own copy
    with make(PPOTrainer, tokenizer, dataset, tmp_path / "b") as trainer:
        assert type(trainer.feed) is SyncFeed and trainer.reference is None and trainer.ref_model is None
        assert trainer.engine.model is trainer.policy and trainer.sleeps is False  # NOTE: zero-copy, on a CPU


class CountingPasses(PlainPasses):
    def __init__(self) -> None:
        self.passes, self.reduced = 0, 0

    def model(self, model):
        self.passes += 1
        return super().model(model)

    def all_reduced(self, params):
        self.reduced += 1
        return super().all_reduced(params)


class CountingFeed(SyncFeed):
    def __init__(self) -> None:
        self.calls: list[str] = []

    def generate(self, trainer, rows):
        self.calls.append("generate")
        return super().generate(trainer, rows)

    def sync(self, trainer):
        self.calls.append("sync")
        return super().sync(trainer)


@pytest.mark.parametrize("cls", [GRPOTrainer, PPOTrainer])
def test_a_part_swapped_on_an_instance_is_the_one_called(cls, tokenizer, dataset, tmp_path):
    with make(cls, tokenizer, dataset, tmp_path / "own") as own:
        want = own.step()
        want_state = trained_state(own)
    with make(cls, tokenizer, dataset, tmp_path / "swapped") as trainer:
        trainer.passes, trainer.feed = CountingPasses(), CountingFeed()
        got = trainer.step()
        state = trained_state(trainer)
    # 2 micro-batches recomputed, then 2 minibatches (1 micro-batch each) of num_iterations=1 with gradients
    assert (trainer.passes.passes, trainer.passes.reduced) == (4, 2)
    assert trainer.feed.calls == ["generate", "sync"]
    for key in ("loss", "reward_mean", "grad_norm", "logprob_mismatch_max", "policy_version"):
        assert got[key] == want[key], key
    for name, tensor in want_state.items():
        assert torch.equal(state[name], tensor), name
