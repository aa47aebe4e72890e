"""The parts a trainer (`trainers.base.RLTrainer`) is composed of, each chosen here from its config and model.

- `adapter`, what trains: `FullWeights` or a `LoraAdapter` (`trainers.lora`);
- `layout`, the policy over the processes (prepare, full tensors for the engine, shards in checkpoints, replica
  ranks): `Replicated` (one process, DDP) or `FullyShardedLayout` (FSDP2, `trainers.sharding`), or
  `TensorParallelLayout` (`trainers.tensor_parallel`);
- `passes`, the module the teacher-forced passes run and the gradient all-reduce: `PlainPasses` or
  `InvariantPasses` (`trainers.invariant`);
- `routing`, recorded MoE routes forced in those passes: a `RoutingReplay`, on or off (`trainers.routing_replay`);
- `engine`, the run's `Rollout`: `trainers.engine_builder.build_rollout`;
- `ref_model` and `reference`, the frozen KL reference and what scores it: None, an `EngineReference` or an
  `AdapterDisabledReference` (`trainers.reference`);
- `feed`, how a step's rollouts arrive and the update reaches the engine: `SyncFeed` or `AsyncFeed`
  (`trainers.async_rollout`).

A part is a plain object the trainer holds and calls; nothing reaches the trainer through inheritance, so
replacing one part on an instance changes that role alone.
"""

from __future__ import annotations

import torch

from rollout.engine.tp import tp_size_of
from trainers.async_rollout import AsyncFeed, SyncFeed
from trainers.common import disable_dropout
from trainers.engine_builder import colocated_engine_config
from trainers.invariant import InvariantPasses, PlainPasses
from trainers.lora import FullWeights, LoraAdapter
from trainers.reference import AdapterDisabledReference, EngineReference
from trainers.sharding import FullyShardedLayout, Replicated, check_fsdp_trainer, fsdp_settings
from trainers.tensor_parallel import TensorParallelLayout, check_tp_trainer


def choose_adapter(config) -> FullWeights:
    """`LoraAdapter` when `config.lora_rank` is set, else `FullWeights`."""
    return FullWeights() if config.lora_rank is None else LoraAdapter(config)


def choose_layout(trainer, policy: torch.nn.Module) -> Replicated:
    """The layout of `policy` (the causal LM inside the module to train): tensor-parallel when it was loaded with
    `tp_size > 1`, FSDP2 when `config.fsdp` says so (`trainers.sharding.fsdp_settings`), else replicated.
    ValueError naming a setting the layout cannot run with."""
    tp = tp_size_of(policy)
    if tp > 1:
        check_tp_trainer(trainer, tp)
        return TensorParallelLayout(trainer.accelerator, tp)
    settings = fsdp_settings(trainer.config.fsdp, trainer.accelerator)
    if settings is None:
        return Replicated(trainer.accelerator)
    check_fsdp_trainer(trainer.config)
    return FullyShardedLayout(trainer.accelerator, settings)


def choose_passes(config, accelerator, model: torch.nn.Module) -> PlainPasses:
    """`InvariantPasses` over the prepared `model` when `config.batch_invariant`, else `PlainPasses`."""
    if not config.batch_invariant:
        return PlainPasses()
    dtype = getattr(torch, config.engine_dtype) if config.engine_dtype else None
    return InvariantPasses(accelerator.unwrap_model(model), config.engine_config.page_size, dtype,
                           accelerator.num_processes, config.engine_config.attn_backend)


def choose_feed(config) -> SyncFeed:
    """`AsyncFeed` when `config.async_rollout` (GRPO's), else `SyncFeed`."""
    return AsyncFeed() if getattr(config, "async_rollout", False) else SyncFeed()


def reference_model(trainer, ref_model: torch.nn.Module | None) -> torch.nn.Module | None:
    """The frozen reference for KL (None when the trainer uses none): the one given, else a copy of the initial
    policy; for LoRA without one given, the policy itself (its adapter disabled in the reference's pass)."""
    if not trainer.uses_reference:
        return None
    if ref_model is None and trainer.adapter.enabled:  # NOTE: the base, the adapter disabled: no second copy
        return trainer.policy
    ref = ref_model if ref_model is not None else trainer.layout.reference_copy(trainer.policy)
    if trainer.config.disable_dropout:
        disable_dropout(ref)
    ref = ref.to(trainer.accelerator.device).eval()
    ref.requires_grad_(False)
    return ref


def choose_reference(trainer) -> EngineReference | AdapterDisabledReference | None:
    """What scores `trainer.ref_model`: None without one, `AdapterDisabledReference` when it is the LoRA policy
    itself, else an `EngineReference` with the trainer's engine configuration (its engine built on first use)."""
    cfg, ref = trainer.config, trainer.ref_model
    if ref is None:
        return None
    if ref is trainer.policy:
        return AdapterDisabledReference(trainer.policy)
    config = colocated_engine_config(cfg.engine_config, cfg.engine_memory_fraction, next(ref.parameters()).device)
    return EngineReference(ref, config, cfg.reference_engine)
