"""`EngineLoras`: an engine's LoRA adapters on its view, unmerged, many per step.

Owns the adapter table (`rollout.weights.lora_table`), routes each base linear of the engine view that an
adapter targets through its stack (`rollout.kernels.lora_linear`) when the first such adapter arrives, and
turns each step's scheduled rows into the plan those linears read (`begin` / `end`, called by the runner
around its forward). A request runs under `Request.lora_slot` (None: the base model).
"""

from __future__ import annotations

import torch

from rollout.kernels.lora_linear import LoraContext, plan_step, route_through_stack
from rollout.scheduling.stages import SchedulerOutput
from rollout.weights.lora_table import LoraStack, LoraTable


class EngineLoras:
    """Args: view: the engine view; max_loras, max_rank: the table's slots and largest rank; device: where the
    step's index tensors go."""

    def __init__(self, view: torch.nn.Module, max_loras: int, max_rank: int, device: torch.device) -> None:
        self.ctx = LoraContext()
        self.device = device
        self.table = LoraTable(dict(view.named_modules()), max_loras, max_rank, on_new_stack=self._route)

    def _route(self, name: str, stack: LoraStack) -> None:
        route_through_stack(self.table.modules[name], stack, self.ctx, name)

    def begin(self, out: SchedulerOutput) -> None:
        """The step's plan from its rows' adapters (none when every row runs the base model)."""
        slots = [s.request.lora_slot for s in out.scheduled]
        if all(slot is None for slot in slots):
            self.ctx.plan = None
            return
        self.ctx.plan = plan_step(slots, [s.num_new_tokens for s in out.scheduled], self.device)

    def end(self) -> None:
        self.ctx.plan = None

    @property
    def routed(self) -> dict[str, torch.nn.Module]:
        """The view's linears that run through a stack, by name."""
        return self.ctx.modules
