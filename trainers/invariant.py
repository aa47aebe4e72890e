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
from rollout.invariant.mode import kernels_for


class PlainPasses:
    """The passes part of a trainer without `batch_invariant`: its teacher-forced passes run the model itself and
    DDP averages the gradients. `InvariantPasses` is the other choice."""

    def model(self, model: torch.nn.Module):
        """The module a teacher-forced pass of `model` runs: `model`."""
        return model

    def all_reduced(self, params: list[torch.nn.Parameter]) -> list[torch.nn.Parameter]:
        """`params`, their gradients as the backward left them (DDP's all-reduce ran)."""
        return params


class InvariantPasses(PlainPasses):
    """The passes part under `batch_invariant` (module docstring): every teacher-forced pass runs the invariant
    forward over the policy's parameters (built on first use), gradients averaged here over the processes.

    Args:
        policy: the unwrapped trainable module (PPO's with its value head).
        page_size: the engine's page size.
        dtype: the engine's dtype (`engine_dtype`), None = the policy's.
        world: the number of processes.
        attn_backend: the engine's `attn_backend`: the passes run the kernels the engine's mode runs
            (`rollout.invariant.mode.kernels_for`: Triton on CUDA, or on a CPU when the engine's backend is
            'triton'), else a trainer beside a 'triton' engine on a CPU would not match it bit for bit.
    """

    def __init__(self, policy: torch.nn.Module, page_size: int, dtype: torch.dtype | None, world: int,
                 attn_backend: str = "auto") -> None:
        self.policy, self.page_size, self.dtype, self.world = policy, page_size, dtype, world
        self.attn_backend = attn_backend

    def model(self, model: torch.nn.Module):
        return self.invariant_model

    def all_reduced(self, params: list[torch.nn.Parameter]) -> list[torch.nn.Parameter]:
        """`params`, their gradients averaged over the processes (the passes bypassed DDP)."""
        if self.world == 1:
            return params
        for p in params:  # NOTE: a missing gradient counts as zeros, so every rank joins every collective
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            torch.distributed.all_reduce(p.grad)
            p.grad.div_(self.world)
        return params

    @functools.cached_property
    def invariant_model(self) -> InvariantForward:
        device = next(self.policy.parameters()).device
        return InvariantForward(self.policy, self.page_size, self.dtype, kernels_for(device, self.attn_backend))

