"""`LoraTable`: the engine's LoRA adapters, stacked by slot beside the base linears they adapt.

As punica / S-LoRA (vLLM's `lora/`): each adapted base linear gets one `LoraStack`, A [K, R, in] and
B [K, out, R] for `K = max_loras` slots of rank up to `R = max_lora_rank`, allocated when the first adapter
targeting it arrives. An adapter is a slot: adding one copies its tensors into that slot of every stack it
targets (and marks it absent, rank 0, in the others); updating copies again, in place (adapter tensors only,
never the base weights); removing frees the slot. Each adapter has a version (1 when added, +1 per update)
and a prefix-cache salt, new at every add and update, so KV computed under another adapter, or under an
older version of this one, is never shared (`Request.cache_salt`). Every check runs before anything is
copied: a refused adapter changes nothing. The grouped product itself is `rollout.kernels.lora_linear`'s.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass

import torch

from rollout.weights.lora_adapters import LoraModule, LoraWeights


@dataclass(frozen=True)
class LoraInfo:
    """What `list_loras()` says of one adapter: its slot, largest rank, version (1 when added, +1 per
    `update_lora`), the base modules it adapts and the bytes its tensors take."""

    name: str
    slot: int
    rank: int
    version: int
    target_modules: tuple[str, ...]
    nbytes: int


class LoraStack:
    """The adapters of one base linear by slot: `a` [K, R, in], `b` [K, out, R], and each slot's rank (0: that
    slot's adapter leaves this linear alone) and scale."""

    def __init__(self, max_loras: int, max_rank: int, linear: torch.nn.Linear) -> None:
        w = linear.weight
        out_features, in_features = w.shape
        self.a = torch.zeros(max_loras, max_rank, in_features, device=w.device, dtype=w.dtype)  # [K, R, in]
        self.b = torch.zeros(max_loras, out_features, max_rank, device=w.device, dtype=w.dtype)  # [K, out, R]
        self.ranks = [0] * max_loras
        self.scales = [0.0] * max_loras

    def load(self, slot: int, module: LoraModule | None) -> None:
        """Copy `module`'s tensors into `slot` (None: the slot's adapter does not adapt this linear)."""
        if module is None:
            self.ranks[slot] = 0
            return
        r = module.rank
        with torch.no_grad():
            self.a[slot, :r].copy_(module.a)
            self.b[slot, :, :r].copy_(module.b)
        self.ranks[slot], self.scales[slot] = r, module.scale


class LoraTable:
    """Args: modules: the engine view's modules by name (adapters may target its `torch.nn.Linear`s);
    max_loras: slots; max_rank: the largest rank a slot holds; on_new_stack: called with (name, stack) when a
    base linear gets its stack (the engine view then routes that linear through it)."""

    def __init__(self, modules: dict[str, torch.nn.Module], max_loras: int, max_rank: int,
                 on_new_stack: Callable[[str, LoraStack], None] | None = None) -> None:
        self.modules = modules
        self.max_loras, self.max_rank = max_loras, max_rank
        self.on_new_stack = on_new_stack
        self.stacks: dict[str, LoraStack] = {}
        self.infos: dict[str, LoraInfo] = {}
        self.salts: dict[str, bytes] = {}
        self._salt_ids = itertools.count(1)

    # ------------------------------------------------------------- lookups
    def slot(self, name: str) -> int:
        """The slot of adapter `name`; ValueError naming an unknown one."""
        info = self.infos.get(name) if isinstance(name, str) else None
        if info is None:
            raise ValueError(f"unknown LoRA adapter {name!r}; loaded: {sorted(self.infos) or 'none'} (add_lora first)")
        return info.slot

    def list(self) -> list[LoraInfo]:
        return sorted(self.infos.values(), key=lambda i: i.slot)

    # ------------------------------------------------------------- changes
    def add(self, name: str, weights: LoraWeights) -> LoraInfo:
        if not isinstance(name, str) or not name:
            raise ValueError(f"a LoRA adapter's name must be a non-empty string, got {name!r}")
        if name in self.infos:
            raise ValueError(f"LoRA adapter {name!r} is already loaded: update_lora replaces its tensors")
        used = {i.slot for i in self.infos.values()}
        free = [s for s in range(self.max_loras) if s not in used]
        if not free:
            raise ValueError(f"the LoRA table is full: max_loras={self.max_loras} adapters are loaded "
                             f"({', '.join(sorted(self.infos))}); remove_lora one or raise max_loras")
        self._check(name, weights)
        return self._load(name, free[0], weights, version=1)

    def update(self, name: str, weights: LoraWeights) -> LoraInfo:
        slot = self.slot(name)
        self._check(name, weights)
        return self._load(name, slot, weights, version=self.infos[name].version + 1)

    def remove(self, name: str) -> LoraInfo:
        slot = self.slot(name)
        for stack in self.stacks.values():
            stack.ranks[slot] = 0
        self.salts.pop(name)
        return self.infos.pop(name)

    def _check(self, name: str, weights: LoraWeights) -> None:
        """Every refusal before any copy: ranks, missing or non-linear target modules, shapes."""
        where = f"LoRA adapter {name!r}"
        if weights.rank > self.max_rank:
            worst = max(weights.modules, key=lambda m: weights.modules[m].rank)
            raise ValueError(f"{where} has rank {weights.rank} ({worst}) above max_lora_rank={self.max_rank}; "
                             "raise ContinuousBatchingConfig(max_lora_rank=...)")
        missing = [m for m in weights.modules if m not in self.modules]
        if missing:
            raise ValueError(f"{where} targets modules the base model lacks: {missing[:4]}"
                             f"{'...' if len(missing) > 4 else ''} (an adapter trained on another model?)")
        for module_name, module in weights.modules.items():
            base = self.modules[module_name]
            if not isinstance(base, torch.nn.Linear):
                raise ValueError(f"{where} targets {module_name}, a {type(base).__name__}; rollout runs LoRA on "
                                 "torch.nn.Linear layers only")
            out_features, in_features = base.weight.shape
            if tuple(module.a.shape) != (module.rank, in_features) or tuple(module.b.shape) != (
                out_features,
                module.rank,
            ):
                raise ValueError(f"{where}: {module_name} has lora_A {tuple(module.a.shape)} and lora_B "
                                 f"{tuple(module.b.shape)}, but the base linear is [{out_features}, {in_features}]")

    def _load(self, name: str, slot: int, weights: LoraWeights, version: int) -> LoraInfo:
        for module_name in weights.modules:
            if module_name not in self.stacks:
                stack = self.stacks[module_name] = LoraStack(self.max_loras, self.max_rank, self.modules[module_name])
                if self.on_new_stack is not None:
                    self.on_new_stack(module_name, stack)
        for module_name, stack in self.stacks.items():
            stack.load(slot, weights.modules.get(module_name))
        self.salts[name] = b"lora:%d" % next(self._salt_ids)
        info = LoraInfo(name, slot, weights.rank, version, tuple(sorted(weights.modules)), weights.nbytes)
        self.infos[name] = info
        return info
