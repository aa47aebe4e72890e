"""The trainer side of the batch-invariant mode (`RLConfig.batch_invariant`).

With it on, the engine runs `ContinuousBatchingConfig(batch_invariant=True)` and every teacher-forced pass
of the trainer (the old-logprob recomputation, the loss's pass with gradients) runs through
`rollout.invariant.forward.InvariantForward`: the engine's invariant ops on the trainer's padded batch, on
the engine's dtype. For the same weights and tokens the trainer's logprobs are then the engine's bits, so
the parity probe `logprob_mismatch_max` is exactly 0.0 and the first on-policy ratio exactly 1. The frozen
reference is scored by its own engine built with the same config (`trainers.reference`), so the KL at
step 0 is exactly 0 too (with top-k / top-p on, that reference pass falls back to a plain forward).

Gradients come from the ordinary backward of each op (the attention's by recomputing it with torch ops):
correct to float rounding, not bitwise. The passes bypass DDP's forward, so DDP's own gradient all-reduce
does not run: with several processes `all_reduced` averages the gradients itself before each optimizer step
(every rank steps the same number of times, so the collectives match).
"""

from __future__ import annotations

import functools

import torch

from rollout.invariant.forward import InvariantForward


class BatchInvariantMixin:
    """For `RLTrainer`: `compute_model(model)` is the module its teacher-forced passes run."""

    def compute_model(self, model: torch.nn.Module):
        """`model` itself, or under `batch_invariant` the invariant forward over the same parameters."""
        return self.invariant_model if self.config.batch_invariant else model

    def all_reduced(self, params: list[torch.nn.Parameter]) -> list[torch.nn.Parameter]:
        """`params`, their gradients averaged over the processes when the mode's passes bypassed DDP."""
        if not self.config.batch_invariant or self.accelerator.num_processes == 1:
            return params
        world = self.accelerator.num_processes
        for p in params:  # NOTE: a missing gradient counts as zeros, so every rank joins every collective
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            torch.distributed.all_reduce(p.grad)
            p.grad.div_(world)
        return params

    @functools.cached_property
    def invariant_model(self) -> InvariantForward:
        cfg, acc = self.config, self.accelerator
        dtype = getattr(torch, cfg.engine_dtype) if cfg.engine_dtype else None
        return InvariantForward(acc.unwrap_model(self.model), cfg.engine_config.page_size, dtype)
