"""Base linears plus the step's LoRA deltas, grouped by adapter, unmerged (punica / S-LoRA's shape on torch ops).

A step packs rows of several requests into `[1, T]`; each row runs under one adapter or none. `plan_step` turns
the rows' slots into segments, once per step: per adapter, its tokens as a slice (one contiguous run, the
common case: a call's rows of one adapter) or an index tensor. Every adapted linear then runs its base
forward as before (oneDNN on packed weights, the small-M kernel, or torch's own: whatever the engine view
gave it, `rollout.kernels.linear`) and adds, per segment, `scale * (x @ A.T) @ B.T` with the slot's A [r, in]
and B [out, r] (`rollout.weights.lora_table.LoraStack`): two thin matmuls per adapter, never a merged copy.
Rows of the base model are not touched, and a step without an adapter row costs one attribute check per
linear. The same torch ops run on a CPU and a GPU.

The step's plan reaches the linears through the `LoraContext` object they share (one per engine), set by
the runner around its forward and cleared after it: no module-global state.
"""

from __future__ import annotations

import types
from dataclasses import dataclass, field

import torch

from rollout.tensors import int_tensor
from rollout.weights.lora_table import LoraStack


@dataclass
class LoraStep:
    """The step's adapter segments: (slot, its packed rows as a slice or an int64 index tensor [n])."""

    segments: list[tuple[int, slice | torch.Tensor]]


@dataclass
class LoraContext:
    """Shared by an engine's adapted linears: the plan of the step running now (None outside a step, or when
    no row of the step runs an adapter)."""

    plan: LoraStep | None = None
    modules: dict[str, torch.nn.Module] = field(default_factory=dict)  # the linears routed through it


def plan_step(slots: list[int | None], lens: list[int], device: torch.device) -> LoraStep | None:
    """Segments of a step whose row i runs `lens[i]` tokens under slot `slots[i]` (None: the base model)."""
    runs: dict[int, list[tuple[int, int]]] = {}
    offset = 0
    for slot, n in zip(slots, lens, strict=True):
        if slot is not None:
            spans = runs.setdefault(slot, [])
            if spans and spans[-1][1] == offset:  # NOTE: adjacent rows of one adapter merge into one run
                spans[-1] = (spans[-1][0], offset + n)
            else:
                spans.append((offset, offset + n))
        offset += n
    if not runs:
        return None
    segments: list[tuple[int, slice | torch.Tensor]] = []
    for slot, spans in runs.items():
        if len(spans) == 1:
            segments.append((slot, slice(*spans[0])))
        else:
            segments.append((slot, int_tensor([t for lo, hi in spans for t in range(lo, hi)], device)))
    return LoraStep(segments)


def _lora_forward(self: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    y = self._rollout_lora_base(x)
    plan = self._rollout_lora_ctx.plan
    if plan is None:
        return y
    stack: LoraStack = self._rollout_lora_stack
    x2 = x.reshape(-1, x.shape[-1])  # [T, in]
    y2 = y.view(-1, y.shape[-1])  # [T, out]: the base output, fresh, updated in place
    for slot, rows in plan.segments:
        r = stack.ranks[slot]
        if not r:
            continue
        a, b = stack.a[slot, :r], stack.b[slot, :, :r]  # [r, in], [out, r]
        # NOTE: PEFT's order, `y + (x @ A.T @ B.T) * scale`, so the sums round as the PeftModel's do
        if isinstance(rows, slice):
            y2[rows] += (x2[rows] @ a.T) @ b.T * stack.scales[slot]
        else:
            y2.index_add_(0, rows, (x2.index_select(0, rows) @ a.T) @ b.T * stack.scales[slot])
    return y


def route_through_stack(module: torch.nn.Linear, stack: LoraStack, ctx: LoraContext, name: str) -> None:
    """Give `module` (an engine view's linear) a forward that adds the step's deltas from `stack` to what its
    current forward (an instance one, as the oneDNN routing, or the class's) returns."""
    module._rollout_lora_base = vars(module).get("forward") or types.MethodType(type(module).forward, module)
    module._rollout_lora_stack = stack
    module._rollout_lora_ctx = ctx
    module.forward = types.MethodType(_lora_forward, module)
    ctx.modules[name] = module
