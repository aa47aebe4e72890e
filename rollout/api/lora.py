"""`RolloutEngine`'s LoRA adapters: `add_lora`, `update_lora`, `remove_lora`, `list_loras`, and `lora=` of a call.

Adapters are served unmerged beside the base model's linears, many per step (`rollout.model.lora`): a call may
mix rows of several adapters and of the base model. `update_lora` copies the adapter's tensors only (never
the base weights) and bumps that adapter's version, with `update_weights`' in-flight modes
(`rollout.in_flight`): "wait" (default) lets the requests in flight finish on the adapter they started with,
"abort" ends them, "keep" lets them go on under the new tensors. Every refusal is a ValueError naming it: an
unknown adapter, a rank above `max_lora_rank`, target modules the base lacks, a full table, no slots at all.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from rollout.engine.tp import tp_size_of
from rollout.in_flight import UPDATE_DEFAULT, InFlight, check_mode, check_recompute_kv
from rollout.model.lora import EngineLoras
from rollout.weights.lora_adapters import read_adapter
from rollout.weights.lora_table import LoraInfo

logger = logging.getLogger("rollout")

LoraChoice = str | Sequence[str | None] | None  # one adapter for every prompt, one (or None) per prompt, or none


def compiles(config) -> bool:
    """Whether the engine would run a compiled forward (`rollout.model.compiled`, `rollout.model.static_decode`)."""
    return config.default_compile_level >= 1 or config.varlen_compile_config is not None \
        or config.decode_compile_config is not None or bool(config.use_cuda_graph)


def policy_config(model, config):
    """A PEFT policy's engine config: one more slot (the policy's adapter) and a rank that fits it; None when the
    adapter cannot run unmerged here (DoRA, modules_to_save, TP, ...: PEFT's own layers then run it, as before)."""
    try:
        rank = read_adapter(model).rank
        for refused, why in (
            (config.batch_invariant, "batch_invariant=True"),
            (tp_size_of(model) > 1, "tensor parallelism"),
            (
                compiles(config),
                "a compiled forward (default_compile_level >= 1, "
                "varlen_compile_config, decode_compile_config, use_cuda_graph)",
            ),
        ):
            if refused:
                raise ValueError(f"unmerged adapters do not run with {why} yet")
    except ValueError as e:
        logger.warning("the PeftModel runs through PEFT's own layers, one adapter, every update a full copy: %s", e)
        return None
    return config.replace(max_loras=config.max_loras + 1, max_lora_rank=max(config.max_lora_rank, rank))


class LoraMethods:
    """The LoRA half of `RolloutEngine` (it supplies `manager`, `_lock`, `_check_open` and `_policy_lora`, the
    adapter name of a PEFT policy or None)."""

    def add_lora(self, name: str, adapter, config=None, adapter_name: str | None = None) -> LoraInfo:
        """Load adapter `name`: a `PeftModel` (its active adapter, or `adapter_name`), a PEFT state dict with its
        `LoraConfig` (`config=`), or a directory saved with `save_pretrained`. Returns its `LoraInfo`."""
        self._check_open()
        weights = read_adapter(adapter, config, adapter_name)
        with self.manager.step_lock:  # NOTE: between two steps; a new slot is no live request's
            return self.manager.loras().table.add(name, weights)

    def update_lora(self, name: str, adapter, config=None, in_flight: InFlight = UPDATE_DEFAULT,
                    adapter_name: str | None = None) -> int:
        """Copy new tensors into adapter `name` (the adapter's only: a rank-16 adapter of a 0.6B model is ~20 MB
        against ~1.2 GB of weights); returns its new version. Its prefix KV is never reused after. `in_flight`:
        as `update_weights`."""
        self._check_open()
        check_mode(in_flight, "in_flight")
        weights = read_adapter(adapter, config, adapter_name)
        loras = self._loras()
        loras.table.slot(name)  # NOTE: an unknown name is refused before anything waits or aborts
        with self._between_steps(in_flight):
            return loras.table.update(name, weights).version

    def remove_lora(self, name: str, in_flight: InFlight = UPDATE_DEFAULT) -> LoraInfo:
        """Unload adapter `name` once the requests in flight finished ("wait") or were aborted ("abort")."""
        self._check_open()
        check_mode(in_flight, "in_flight")
        if in_flight == "keep":
            raise ValueError("remove_lora cannot keep requests in flight on an adapter it removes: "
                             "in_flight='wait' or 'abort'")
        loras = self._loras()
        loras.table.slot(name)
        with self._between_steps(in_flight):  # NOTE: "keep" was refused above
            return loras.table.remove(name)

    def _update_policy(self, source, in_flight: InFlight, recompute_kv: bool, version: int | None = None) -> int:
        """`update_weights(peft_model)` of a PEFT policy: its adapter's tensors only; returns the new policy version."""
        check_recompute_kv(in_flight, recompute_kv)
        weights = read_adapter(source)
        return self._swap_weights(lambda m: m.load_policy_adapter(weights, recompute_kv, version), in_flight,
                                  "adapter")

    def list_loras(self) -> list[LoraInfo]:
        """The loaded adapters, by slot."""
        loras = self.manager.loras(create=False)
        return [] if loras is None else loras.table.list()

    def _loras(self) -> EngineLoras:
        loras = self.manager.loras(create=False)
        if loras is None:
            raise ValueError("no LoRA adapter is loaded (add_lora first)")
        return loras

    def resolve_lora(self, name: str | None) -> tuple[int | None, bytes]:
        """(slot, prefix-cache salt) a request under adapter `name` runs with (None: the policy: a PEFT policy's
        adapter, else the base model); ValueError naming an unknown adapter. For `Request.lora_slot` / `cache_salt`."""
        name = self._policy_lora if name is None else name
        if name is None:
            return None, b""
        loras = self.manager.loras(create=False)
        if loras is None:
            raise ValueError(f"unknown LoRA adapter {name!r}: no adapter is loaded (add_lora first)")
        return loras.table.slot(name), loras.table.salts[name]

    def _lora_rows(self, lora: LoraChoice, n: int) -> list[tuple[int | None, bytes]] | None:
        """(slot, cache salt) of each of `n` prompts (None: all run the base model); ValueError naming a bad choice."""
        if lora is None and self._policy_lora is None:
            return None
        # NOTE: a PEFT policy's rows run its adapter unless they name another
        lora = self._policy_lora if lora is None else lora
        names = [lora] * n if isinstance(lora, str) else [self._policy_lora if x is None else x for x in lora]
        if len(names) != n:
            raise ValueError(f"lora has {len(names)} entries for {n} prompts (one adapter name or None per prompt)")
        return [self.resolve_lora(name) for name in names]
