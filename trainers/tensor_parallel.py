"""Tensor parallelism in the trainers: a policy loaded with `DistributedConfig(tp_size=N)` trained on N ranks that
form ONE data-parallel replica.

The ranks of a TP group hold the shards of one model, so they must see the same prompts, sample the same rollouts
(the engine runs on the same sharded model: `rollout.engine.tp`), and run the same forward and backward; each rank's
gradients are its own shards' (DTensor autograd does the TP collectives). Nothing is averaged across them as if they
were DDP replicas. So, under an `Accelerator` that spans the TP ranks (a `MULTI_CPU` / `MULTI_GPU` launch, what the
recipes build), the trainer:

- does not `accelerator.prepare` the model (DDP would refuse the DTensors, or average the shards' gradients) nor the
  optimizer; `accelerator.backward`, `accumulate` and `clip_grad_norm_` work on the plain module (the grad norm is
  the DTensors' global one); a checkpoint holds both as one DCP checkpoint in `checkpoint-N/tp/` (each rank its
  shards; accelerate's `save_state` the scheduler and RNG), which loads back onto the same `tp_size`;
- reads prompts and rollout seeds for data-parallel rank `process_index // tp_size` of `num_processes // tp_size`
  (`data_rank`, `data_world`), not for its own process index;
- counts each TP group's rows once where it gathers rows (`gather_replicas`: the reward mean / std) and divides the
  summed throughputs by `tp_size` (the group's ranks generate the same tokens).

An `Accelerator` that sees one process (no `cpu=True` on a CPU under torchrun) also works: `data_world` is then 1.

Refused with the reason: `num_processes` not a multiple of `tp_size`, several TP groups (data parallelism over TP
groups is not implemented yet), FSDP, LoRA, `batch_invariant`, `engine_dtype` and `async_rollout`. A KL reference
(`beta > 0`) is an unsharded copy of the initial policy on every rank.
"""

from __future__ import annotations

import torch
from torch import Tensor

from rollout.engine.tp import tp_size_of
from trainers.common import reduce_metrics
from trainers.sharding import fsdp_settings, param_fraction

TP_DIR = "tp"  # NOTE: a TP policy's DCP checkpoint inside checkpoint-N/ (trainers.checkpoints)
# NOTE: RLConfig fields (name -> the value that means "off") that do not run on a TP policy yet, with the reason
UNSUPPORTED = {
    "lora_rank": (None, "LoRA adapters on DTensor-sharded linears are untested"),
    "batch_invariant": (False, "the invariant passes bypass the model's TP forward"),
    "engine_dtype": (None, "the engine runs on the trainer's own shards (a cast copy of a TP model is not built)"),
    "async_rollout": (False, "a producer thread's TP forwards would interleave with the learner's collectives"),
}


def check_tp_trainer(trainer, tp: int) -> None:
    """ValueError naming the setting when the trainer cannot train a policy sharded `tp` ways."""
    acc, cfg = trainer.accelerator, trainer.config
    world = acc.num_processes
    if world > 1 and world % tp:
        raise ValueError(f"the policy is tensor-parallel with tp_size={tp}, which does not divide the "
                         f"{world} processes: launch a multiple of tp_size processes")
    if world > tp:
        # NOTE: transformers lays out world > tp_size only with dp_replicate_size, which fully_shards (HSDP) the model,
        # and the engine's view cannot deep-copy an FSDP module
        raise ValueError(f"tp_size={tp} on {world} processes would make {world // tp} data-parallel groups of TP "
                         f"ranks, which is not implemented yet: launch --nproc-per-node {tp} (one TP group)")
    if fsdp_settings(cfg.fsdp, acc) is not None:
        raise ValueError(f"tensor parallelism (tp_size={tp}) and FSDP do not combine here: the policy is already "
                         "sharded by transformers; launch without the FSDP config (or fsdp=False)")
    for name, (off, why) in UNSUPPORTED.items():
        value = getattr(cfg, name, off)
        if value != off and value:
            raise ValueError(f"{name}={value!r} does not run on a tensor-parallel policy (tp_size={tp}) yet: {why}")


class TensorParallelMixin:
    """For `RLTrainer`: the TP layout (module docstring); with tp_size 1 everything is as before."""

    tp_size: int = 1
    data_rank: int = 0
    data_world: int = 1

    def prepare_model(self, module: torch.nn.Module, optimizer: torch.optim.Optimizer):
        acc = self.accelerator
        self.tp_size = tp = tp_size_of(self.policy_module(module))
        self.data_rank, self.data_world = acc.process_index // tp, max(1, acc.num_processes // tp)
        if tp > 1:
            check_tp_trainer(self, tp)
        if tp == 1 or acc.num_processes == 1:  # NOTE: one process per TP group: prepare is a pass-through
            return super().prepare_model(module, optimizer)
        self.param_fraction = param_fraction(self.policy_module(module))
        # NOTE: not prepared: the model would be DDP-wrapped over the TP ranks; checkpoints save both as DCP
        return module, optimizer

    def save_shards(self, path: str) -> None:
        """Under TP: the model's and the optimizer's shards as one DCP checkpoint in `path/tp` (each rank its own)."""
        if self.tp_size > 1 and self.accelerator.num_processes > 1:
            from trainers.checkpoints import save_sharded

            return save_sharded(self.model, self.optimizer, path, folder=TP_DIR)
        return super().save_shards(path)

    def load_shards(self, path: str) -> None:
        if self.tp_size > 1 and self.accelerator.num_processes > 1:
            from trainers.checkpoints import load_sharded

            return load_sharded(self.model, self.optimizer, path, folder=TP_DIR)
        return super().load_shards(path)

    def reference_copy(self) -> torch.nn.Module:
        """The KL reference's initial weights: a deep copy of the policy, or under TP an unsharded copy on every rank
        (a TP model does not deep-copy; the reference scores the same rows on every rank through its own engine)."""
        if self.tp_size > 1:
            return unsharded_copy(self.policy)
        import copy

        return copy.deepcopy(self.unsharded_policy())

    def gather_replicas(self, rows: Tensor) -> Tensor:
        """`accelerator.gather(rows)` with each TP group's rows once (its rank 0's): `[n x data_world]`."""
        everyone = self.accelerator.gather(rows)
        if self.tp_size == 1 or self.accelerator.num_processes == 1:
            return everyone
        return everyone.view(self.accelerator.num_processes, *rows.shape)[:: self.tp_size].flatten(0, 1)

    def reduce_rank_metrics(self, metrics: dict[str, float]) -> dict[str, float]:
        """`trainers.common.reduce_metrics`, with the summed throughputs of a TP group counted once."""
        out = reduce_metrics(self.accelerator, metrics)
        if self.tp_size > 1 and self.accelerator.num_processes > 1:
            out = {k: v / self.tp_size if k.endswith("_per_s") else v for k, v in out.items()}
        return out

    def gather_policy(self) -> torch.nn.Module:
        """Under TP (collective: every rank calls it): an unsharded copy of the policy with its current weights,
        for evaluation or `save_pretrained` on one rank (its config without the `distributed_config`, so it loads
        back as a plain model); else as before."""
        if self.tp_size == 1:
            return super().gather_policy()
        return unsharded_copy(self.policy)


def unsharded_copy(model: torch.nn.Module) -> torch.nn.Module:
    """A plain (unsharded) model of `model`'s class and config with its parameters' full tensors (collective)."""
    import copy

    from torch.distributed.tensor import DTensor

    config = copy.deepcopy(model.config)
    if getattr(config, "distributed_config", None) is not None:
        config.distributed_config = None  # NOTE: else final/config.json would load back sharded
    with torch.no_grad():
        state = {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
                 for n, p in model.named_parameters()}
        full = type(model)(config).to(dtype=next(iter(state.values())).dtype)
        missing, unexpected = full.load_state_dict(state, strict=False)
    tied = (
        {k for k in missing if k.endswith("lm_head.weight")} if getattr(config, "tie_word_embeddings", False) else set()
    )
    if unexpected or set(missing) - tied:
        raise RuntimeError(f"unsharded copy: missing {sorted(set(missing) - tied)}, unexpected {sorted(unexpected)}")
    return full.eval()
