"""The batch-invariant mode of the engine (`ContinuousBatchingConfig(batch_invariant=True)`).

A request's sampled tokens and logprobs are then bitwise identical whatever else runs with it: alone or
in a batch of hundreds, in other prompt chunks, from the prefix cache, after preemption (recomputed or
offloaded), under another `max_batch_tokens`. Every op on a token's path has one reduction order
(`rollout.invariant.ops`): the engine view's linears run over fixed row tiles, rotary embeddings are
gathered from a table, and attention runs per row through `rollout.invariant.attention`. The rest (norms,
activations, the sampler's fp32 log-softmax and per-request seeded streams) is row-local already.

Two sets of kernels run the same ops (`kernels_for` picks): "cpu", the above (rollout's C++ per-row attention,
oneDNN / tiled GEMMs), and "triton", the GPU path (on CUDA; on a CPU under Triton's interpreter when
`attn_backend='triton'` is asked for, for tests): linears through a fixed-tile Triton GEMM (no split-K), RMSNorm
one program per row, attention through the Triton per-row paged kernel (`rollout.invariant.ops`). A model with
LayerNorm has no Triton norm yet and is refused there.

Owns `check` (what the mode refuses on a model and machine, by name; the config's own refusals are in
`rollout.config`), `kernels_for`, `install` (the ops on an engine view or a trainer's view)
and `engine_backend`. The trainer side is `rollout.invariant.forward`.
"""

from __future__ import annotations

import types

import torch

from rollout.invariant.attention import InvariantBackend
from rollout.invariant.ops import (
    RotaryTable,
    conv1d_forward,
    kernel,
    linear_forward,
    triton_kernels,
    triton_rms_norm_forward,
)
from rollout.kernels.fused_layers import drop_fused_layers

KERNELS = ("cpu", "triton")


def kernels_for(device: torch.device, attn_backend: str) -> str:
    """The mode's kernels on `device`: "triton" on CUDA, or on a CPU when `attn_backend='triton'` asks for it
    (under Triton's interpreter); else "cpu"."""
    return "triton" if device.type == "cuda" or attn_backend == "triton" else "cpu"


def check(device: torch.device, dtype: torch.dtype, has_sinks: bool, model: str = "the model",
          tp_size: int = 1, moe: bool = False, kernels: str = "cpu") -> None:
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
    if kernels == "triton":
        try:
            ready = triton_kernels().available(device)
        except ImportError as e:
            raise ValueError(f"batch_invariant=True on {device} runs Triton kernels, which need the triton extra "
                             f"({e}): pip install 'rollout[triton]'") from e
        if not ready:
            raise ValueError(f"batch_invariant=True runs its Triton kernels on CUDA, or on a CPU under Triton's "
                             f"interpreter (TRITON_INTERPRET=1, for tests); the model is on {device}")
    elif device.type != "cpu":
        raise ValueError(f"batch_invariant=True runs rollout's C++ kernels on a CPU, or Triton's on CUDA; the model "
                         f"is on {device}")
    if dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"batch_invariant=True supports float32 and bfloat16 models, got {dtype}")
    if has_sinks:
        raise ValueError(
            f"batch_invariant=True: {model} has attention sinks, which the per-row kernel does not implement"
        )
    if kernels == "cpu" and kernel() is None:
        raise ValueError(
            "batch_invariant=True needs rollout's C++ CPU attention kernel, unavailable here "
            "(ROLLOUT_CPU_KERNELS=0, no compiler, or a failed build: see the warning)"
        )


def install(view: torch.nn.Module, kernels: str = "cpu") -> int:
    """Put the invariant ops on `view` (a module tree the caller owns: an engine view or a trainer's view):
    each plain `nn.Linear` (and transformers' `Conv1D`) gets the tiled forward, each rotary embedding its table,
    and the engine view's one-call norms and MLPs their class forward (the trainer runs that); with
    `kernels="triton"` the linears run the Triton GEMM and each RMSNorm the Triton row kernel. Returns how many
    modules."""
    if kernels not in KERNELS:
        raise ValueError(f"batch_invariant: kernels must be one of {KERNELS}, got {kernels!r}")
    n = drop_fused_layers(view)
    for module in view.modules():
        if kernels == "triton" and _norm(module, kernels):
            n += 1
            continue
        if isinstance(module, torch.nn.Linear):
            if type(module) is not torch.nn.Linear:
                raise ValueError(
                    f"batch_invariant: {type(module).__name__} is a Linear subclass (quantized or adapter "
                    "layer) whose product the mode cannot make invariant"
                )
            module.forward = types.MethodType(linear_forward, module)
            module._rollout_invariant_packed = {}  # NOTE: this module tree's own packed copy (fp32)
            module._rollout_invariant_kernels = kernels
            n += 1
        elif type(module).__name__ == "Conv1D" and type(module).__module__.startswith("transformers"):
            module.forward = types.MethodType(conv1d_forward, module)  # NOTE: GPT-2's linears
            module._rollout_invariant_kernels = kernels
            n += 1
        elif hasattr(module, "inv_freq") and "rotary" in type(module).__name__.lower():
            module.forward = RotaryTable(module, _context(view))
            n += 1
    return n


def _norm(module: torch.nn.Module, kernels: str) -> bool:
    """Give an RMSNorm module the Triton row kernel (True); refuse a LayerNorm (no Triton kernel yet)."""
    name = type(module).__name__
    if isinstance(module, torch.nn.LayerNorm) or name.endswith("LayerNorm"):
        raise ValueError(f"batch_invariant: {name} has no Triton kernel yet (the GPU path supports RMSNorm "
                         "models: Llama, Qwen, Mistral, Gemma, Phi-3, ...)")
    if not name.endswith("RMSNorm"):
        return False
    eps = getattr(module, "variance_epsilon", getattr(module, "eps", None))
    if getattr(module, "weight", None) is None or eps is None:
        raise ValueError(f"batch_invariant: {name} has no weight or epsilon the Triton RMSNorm knows")
    module._rollout_invariant_norm = (float(eps), "Gemma" in name)  # NOTE: Gemma scales by (1 + weight)
    module.forward = types.MethodType(triton_rms_norm_forward, module)
    return True


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


def engine_backend(name: str, kernels: str = "cpu") -> InvariantBackend:
    """The mode's attention backend, standing for `attn_backend=name` (already checked), on `kernels`."""
    return InvariantBackend(name, kernels)
