"""The batch-invariant mode of the engine (`ContinuousBatchingConfig(batch_invariant=True)`).

A request's sampled tokens and logprobs are then bitwise identical whatever else runs with it: alone or
in a batch of hundreds, in other prompt chunks, from the prefix cache, after preemption (recomputed or
offloaded), under another `max_batch_tokens`. Every op on a token's path has one reduction order
(`rollout.invariant.ops`): the engine view's linears run over fixed row tiles, rotary embeddings are
gathered from a table, and attention runs per row through `rollout.invariant.attention`. The rest (norms,
activations, the sampler's fp32 log-softmax and per-request seeded streams) is row-local already.

Owns `check` (what the mode refuses on a model and machine, by name; the config's own refusals are in
`rollout.config`), `install` (the ops on an engine view or a trainer's view)
and `engine_backend`. The trainer side is `rollout.invariant.forward`.
"""

from __future__ import annotations

import types

import torch

from rollout.invariant.attention import InvariantBackend
from rollout.invariant.ops import RotaryTable, conv1d_forward, kernel, linear_forward
from rollout.kernels.fused_layers import drop_fused_layers


def check(device: torch.device, dtype: torch.dtype, has_sinks: bool, model: str = "the model",
          tp_size: int = 1, moe: bool = False) -> None:
    """Refuse what the mode cannot honour on this model and machine (ValueError naming `batch_invariant`)."""
    if moe:
        raise ValueError(
            f"batch_invariant=True does not support mixture-of-experts models yet ({model}): its routers and "
            "experts call F.linear on their own weights (not nn.Linear, so the tiled linears never reach them), "
            "each expert over however many of the step's tokens were routed to it, so a token's bits would "
            "depend on the batch's composition"
        )
    if tp_size > 1:
        raise ValueError(f"batch_invariant=True does not support tensor parallelism yet ({model} is sharded with "
                         f"tp_size={tp_size}: its all-reduces sum the shards' partial products in another order)")
    if device.type != "cpu":
        raise ValueError(
            f"batch_invariant=True runs on a CPU only for now (the model is on {device}); the CUDA "
            "version is planned (fixed split-KV, no split-K GEMMs, invariant RMSNorm)"
        )
    if dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"batch_invariant=True supports float32 and bfloat16 models, got {dtype}")
    if has_sinks:
        raise ValueError(
            f"batch_invariant=True: {model} has attention sinks, which the per-row kernel does not implement"
        )
    if kernel() is None:
        raise ValueError(
            "batch_invariant=True needs rollout's C++ CPU attention kernel, unavailable here "
            "(ROLLOUT_CPU_KERNELS=0, no compiler, or a failed build: see the warning)"
        )


def install(view: torch.nn.Module) -> int:
    """Put the invariant ops on `view` (a module tree the caller owns: an engine view or a trainer's view):
    each plain `nn.Linear` (and transformers' `Conv1D`) gets the tiled forward, each rotary embedding its table,
    and the engine view's one-call norms and MLPs their class forward (the trainer runs that). Returns how many
    modules."""
    n = drop_fused_layers(view)
    for module in view.modules():
        if isinstance(module, torch.nn.Linear):
            if type(module) is not torch.nn.Linear:
                raise ValueError(
                    f"batch_invariant: {type(module).__name__} is a Linear subclass (quantized or adapter "
                    "layer) whose product the mode cannot make invariant"
                )
            module.forward = types.MethodType(linear_forward, module)
            module._rollout_invariant_packed = {}  # NOTE: this module tree's own packed copy (fp32)
            n += 1
        elif type(module).__name__ == "Conv1D" and type(module).__module__.startswith("transformers"):
            module.forward = types.MethodType(conv1d_forward, module)  # NOTE: GPT-2's linears
            n += 1
        elif hasattr(module, "inv_freq") and "rotary" in type(module).__name__.lower():
            module.forward = RotaryTable(module, _context(view))
            n += 1
    return n


def _context(view: torch.nn.Module) -> int:
    """The model's context (the rotary tables' length), from the first config that states it (the view may be
    a wrapper, e.g. a policy with a value head)."""
    for module in view.modules():
        config = getattr(module, "config", None)
        config = config.get_text_config() if hasattr(config, "get_text_config") else config
        length = getattr(config, "max_position_embeddings", None)
        if length:
            return int(length)
    raise ValueError(
        "batch_invariant: the model's config has no max_position_embeddings (the rotary table's length)"
    )


def engine_backend(name: str) -> InvariantBackend:
    """The mode's attention backend, standing for `attn_backend=name` (already checked)."""
    return InvariantBackend(name)
