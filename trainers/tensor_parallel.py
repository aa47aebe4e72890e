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

from trainers.sharding import Replicated, fsdp_settings, param_fraction

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


class TensorParallelLayout(Replicated):
    """The layout of a policy loaded with `tp_size > 1` (module docstring): one data-parallel replica over the TP
    ranks. With one process (an `Accelerator` that sees one) the module is prepared as before.

    Args:
        accelerator: the trainer's.
        tp: the policy's tensor-parallel size.
    """

    def __init__(self, accelerator, tp: int) -> None:
        super().__init__(accelerator)
        self.tp_size = tp
        self.data_rank, self.data_world = accelerator.process_index // tp, max(1, accelerator.num_processes // tp)
        self.spans_ranks = accelerator.num_processes > 1  # NOTE: one process per TP group: as `Replicated`

    def prepare(self, module: torch.nn.Module, optimizer: torch.optim.Optimizer, policy: torch.nn.Module):
        if not self.spans_ranks:
            return super().prepare(module, optimizer, policy)
        self.param_fraction = param_fraction(policy)
        # NOTE: not prepared: the model would be DDP-wrapped over the TP ranks; checkpoints save both as DCP
        return module, optimizer

    def save_shards(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, path: str) -> None:
        """The model's and the optimizer's shards as one DCP checkpoint in `path/tp` (each rank its own)."""
        if self.spans_ranks:
            from trainers.checkpoints import save_sharded

            save_sharded(model, optimizer, path, folder=TP_DIR)

    def load_shards(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, path: str) -> None:
        if self.spans_ranks:
            from trainers.checkpoints import load_sharded

            load_sharded(model, optimizer, path, folder=TP_DIR)

    def reference_copy(self, policy: torch.nn.Module) -> torch.nn.Module:
        """An unsharded copy on every rank (a TP model does not deep-copy; the reference scores the same rows on
        every rank through its own engine)."""
        return unsharded_copy(policy)

    def gather_policy(self, policy: torch.nn.Module) -> torch.nn.Module:
        """An unsharded copy of the policy with its current weights (collective: every rank calls it), for
        evaluation or `save_pretrained` on one rank (its config without the `distributed_config`, so it loads
        back as a plain model)."""
        return unsharded_copy(policy)

    def gather_replicas(self, rows: Tensor) -> Tensor:
        """`accelerator.gather(rows)` with each TP group's rows once (its rank 0's): `[n x data_world]`."""
        everyone = self.accelerator.gather(rows)
        if not self.spans_ranks:
            return everyone
        return everyone.view(self.accelerator.num_processes, *rows.shape)[:: self.tp_size].flatten(0, 1)

    def reduce_metrics(self, metrics: dict[str, float]) -> dict[str, float]:
        """`trainers.common.reduce_metrics`, with the summed throughputs of a TP group counted once."""
        out = super().reduce_metrics(metrics)
        if self.spans_ranks:
            out = {k: v / self.tp_size if k.endswith("_per_s") else v for k, v in out.items()}
        return out


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
