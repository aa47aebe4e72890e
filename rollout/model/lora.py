"""`EngineLoras`: an engine's LoRA adapters on its view, unmerged, many per step.

Owns the adapter table (`rollout.weights.lora_table`), routes each base linear of the engine view that an
adapter targets through its stack (`rollout.kernels.lora_linear`) when the first such adapter arrives, and
turns each step's scheduled rows into the plan those linears read (`begin` / `end`, called by the runner
around its forward). A request runs under `Request.lora_slot` (None: the base model).

A PEFT policy (`RolloutEngine(peft_model)`) runs the same way: its view's PEFT layers give way to their base
linears (`strip_peft_layers`: one base copy, the user's, shared), its adapter takes a slot (`adopt_policy`), and
an in-place change of the PeftModel's LoRA tensors (an optimizer step) is copied in before the next step
(their version counters, as the engine watches its weights).
"""

from __future__ import annotations

import torch

from rollout.kernels.linear import use_onednn_linears
from rollout.kernels.lora_linear import LoraContext, plan_step, route_through_stack
from rollout.scheduling.stages import SchedulerOutput
from rollout.weights.in_place import weights_version
from rollout.weights.lora_adapters import PEFT_PREFIX, LoraWeights, is_peft_model
from rollout.weights.lora_table import LoraStack, LoraTable


class EngineLoras:
    """Args: view: the engine view; max_loras, max_rank: the table's slots and largest rank; device: where the
    step's index tensors go."""

    def __init__(self, view: torch.nn.Module, max_loras: int, max_rank: int, device: torch.device) -> None:
        self.ctx = LoraContext()
        self.device = device
        # NOTE: adapters name the base model's modules; a PEFT policy's view holds them under `base_model.model.`
        prefix = PEFT_PREFIX if is_peft_model(view) else ""
        modules = {name.removeprefix(prefix): m for name, m in view.named_modules() if name.startswith(prefix)}
        self.table = LoraTable(modules, max_loras, max_rank, on_new_stack=self._route)
        self.policy: tuple[str, LoraWeights] | None = None  # NOTE: a PEFT policy's adapter (live tensors)
        self.policy_seen = 0

    def _route(self, name: str, stack: LoraStack) -> None:
        route_through_stack(self.table.modules[name], stack, self.ctx, name)

    def adopt_policy(self, name: str, weights: LoraWeights) -> None:
        """Serve a PEFT policy's adapter `name` (its live tensors) in a slot, followed in place from now on."""
        self.table.add(name, weights)
        self.policy = (name, weights)
        self.policy_seen = self.policy_version()

    def load_policy(self, source: LoraWeights) -> int:
        """Copy `source`'s adapter into the policy's own LoRA tensors (the user's PeftModel, as `update_weights`
        copies into the user's model) and from there into its slot; returns how many tensors were copied (0: the
        same tensors). ValueError, before any copy, when its modules or shapes differ."""
        name, own = self.policy
        if set(source.modules) != set(own.modules):
            extra, missing = (
                sorted(set(source.modules) - set(own.modules)),
                sorted(set(own.modules) - set(source.modules)),
            )
            raise ValueError(f"update_weights: the adapter adapts other modules than the policy's (extra {extra[:3]}, "
                             f"missing {missing[:3]})")
        pairs = [
            (t, s)
            for m, src in source.modules.items()
            for t, s in ((own.modules[m].a, src.a), (own.modules[m].b, src.b))
        ]
        for (t, s), m in zip(pairs, [m for m in source.modules for _ in (0, 1)], strict=True):
            if t.shape != s.shape:
                raise ValueError(f"update_weights: {m} has a LoRA tensor of shape {tuple(s.shape)}, the policy's is "
                                 f"{tuple(t.shape)}")
        copied = 0
        with torch.no_grad():
            for t, s in pairs:
                if t.data_ptr() != s.data_ptr():
                    t.copy_(s)
                    copied += 1
        self.table.update(name, own)
        self.policy_seen = self.policy_version()
        return copied

    def policy_version(self) -> int:
        return 0 if self.policy is None else weights_version(
            [t for m in self.policy[1].modules.values() for t in (m.a, m.b)])

    def follow_policy(self) -> bool:
        """Copy the policy's LoRA tensors in again if they changed in place since the last copy; whether they did."""
        if self.policy is None or self.policy_version() == self.policy_seen:
            return False
        self.table.update(*self.policy)
        self.policy_seen = self.policy_version()
        return True

    def begin(self, out: SchedulerOutput, drafts: list[list[int]] | None = None) -> None:
        """The step's plan from its rows' adapters (none when every row runs the base model). With rows of
        several adapters, the step's rows are first ordered by adapter (stable: a group's rows stay in order), so
        each adapter's tokens are one contiguous run: a slice, no gather or scatter. A speculative step (`drafts`:
        row i runs 1 + len(drafts[i]) tokens) keeps its order, which its drafts follow (index segments then)."""
        self.follow_policy()
        slots = [s.request.lora_slot for s in out.scheduled]
        if all(slot is None for slot in slots):
            self.ctx.plan = None
            return
        if drafts is not None:
            self.ctx.plan = plan_step(slots, [1 + len(d) for d in drafts], self.device)
            return
        if len(set(slots)) > 1:
            out.scheduled.sort(key=lambda s: -1 if s.request.lora_slot is None else s.request.lora_slot)
            slots = [s.request.lora_slot for s in out.scheduled]
        self.ctx.plan = plan_step(slots, [s.num_new_tokens for s in out.scheduled], self.device)

    def end(self) -> None:
        self.ctx.plan = None

    @property
    def routed(self) -> dict[str, torch.nn.Module]:
        """The view's linears that run through a stack, by name."""
        return self.ctx.modules


def strip_peft_layers(view: torch.nn.Module) -> int:
    """Put each PEFT LoRA layer of the view back to its base linear (shared with the user's model), and route the
    linears freed so through oneDNN where the view's others are (`use_onednn_linears`); returns how many."""
    n = 0
    for name, module in list(view.named_modules()):
        base = getattr(module, "base_layer", None)
        if isinstance(base, torch.nn.Linear) and hasattr(module, "lora_A") and "." in name:
            parent, _, child = name.rpartition(".")
            setattr(view.get_submodule(parent), child, base)
            n += 1
    use_onednn_linears(view)
    return n
