"""Norms and gated MLPs of the engine view in fewer calls on a CPU (`rollout/kernels/csrc/rms_norm.cpp`,
`silu_mul.cpp`).

transformers' Llama-family RMSNorm is six tensor ops, and a decode step runs one per norm (a 12-layer Qwen3:
49 of them, q_norm and k_norm included) on a few rows, where dispatch is most of their cost; its gated MLP runs
`act_fn(gate_proj(x)) * up_proj(x)` as two passes over [tokens, intermediate]. The engine view's modules whose
class `forward` is Llama's (the same bytecode) get an instance `forward` with one call in their place:

- RMSNorm (Qwen2/3, Mistral, Phi-3, Mixtral, Granite, SmolLM3, DeepSeek-V3, ...; not Gemma's `1 + weight`
  nor OLMo 2's): `rms_norm(x, weight, eps)`;
- the gated MLP with a SiLU activation (Llama, Qwen2/3, Mistral, Granite, ...; not Gemma's GELU, not Phi-3's
  fused gate_up): `down_proj(silu_mul(gate_proj(x), up_proj(x)))`, gate and up in one small-M call on decode
  rows (`rollout.kernels.linear.linears`).

The attention modules and rotary embeddings get theirs from `rollout.kernels.fused_attention` (the same marker,
`KERNEL_ATTR`, so `drop_fused_layers` removes them too).

They take the class forward whenever the inputs are not fp32 CPU tensors without autograd, or autocast is on.
Results equal the class forward up to float rounding (a summation order, an exp). The batch-invariant mode
removes these forwards (`drop_fused_layers`): its trainer runs the class forward, and the engine must compute
the same bits. `ROLLOUT_FUSED_LAYERS=0` turns them off.
"""

from __future__ import annotations

import functools
import os
import types

import torch

from rollout.kernels import cpu_kernels
from rollout.kernels.linear import linears

KERNEL_ATTR = "_rollout_fused"  # NOTE: the kernel an instance forward calls; marks a fused module


def code_key(fn) -> tuple | None:
    code = getattr(fn, "__code__", None)
    return None if code is None else (code.co_code, code.co_consts, code.co_names, code.co_varnames)


@functools.cache
def _llama_keys() -> tuple[tuple, tuple]:
    from transformers.models.llama.modeling_llama import LlamaMLP, LlamaRMSNorm  # noqa: PLC0415

    return code_key(LlamaRMSNorm.forward), code_key(LlamaMLP.forward)


def is_llama_rms_norm(module: torch.nn.Module) -> bool:
    """Whether `module`'s class forward is Llama's RMSNorm forward (with its 1-D `weight` and `variance_epsilon`)."""
    weight = getattr(module, "weight", None)
    return (isinstance(weight, torch.Tensor) and weight.dim() == 1 and hasattr(module, "variance_epsilon")
            and code_key(type(module).forward) == _llama_keys()[0])


def is_silu_gated_mlp(module: torch.nn.Module) -> bool:
    """Whether `module`'s class forward is Llama's gated MLP forward and its activation is SiLU."""
    from transformers.activations import SiLUActivation  # noqa: PLC0415

    act = getattr(module, "act_fn", None)
    return (type(act) in (SiLUActivation, torch.nn.SiLU) and all(
        isinstance(getattr(module, name, None), torch.nn.Module) for name in ("gate_proj", "up_proj", "down_proj"))
            and code_key(type(module).forward) == _llama_keys()[1])


def plain_inputs(x: torch.Tensor, w: torch.Tensor | None = None) -> bool:
    """fp32 CPU tensors, no autograd to record, no autocast: where the kernels stand in for the class forward."""
    return x.dtype is torch.float32 and x.is_cpu and (w is None or (w.dtype is torch.float32 and w.is_cpu)) \
        and not (torch.is_grad_enabled() and (x.requires_grad or (w is not None and w.requires_grad))) \
        and not torch.is_autocast_enabled("cpu")


def norm_forward(self: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    if plain_inputs(x, self.weight):
        return self._rollout_fused(x, self.weight, float(self.variance_epsilon))
    return type(self).forward(self, x)


def mlp_forward(self: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    gate, up = linears(x, (self.gate_proj, self.up_proj))
    if plain_inputs(gate) and up.dtype is torch.float32:
        return self.down_proj(self._rollout_fused(gate, up))
    return self.down_proj(self.act_fn(gate) * up)


def enabled() -> bool:
    """False when `ROLLOUT_FUSED_LAYERS=0`."""
    return os.environ.get("ROLLOUT_FUSED_LAYERS", "1") != "0"


def use_fused_layers(view: torch.nn.Module) -> int:
    """Give the view's Llama-family RMSNorms and SiLU gated MLPs their one-call forwards; returns how many modules
    (0 without the kernels). Skips modules whose `forward` is already set on the instance."""
    if not enabled():
        return 0
    kernels = None  # NOTE: built only when the view holds a module to fuse on a CPU (never on a GPU)
    n = 0
    for module in view.modules():
        if "forward" in vars(module) or not (is_llama_rms_norm(module) or is_silu_gated_mlp(module)) \
                or not any(p.device.type == "cpu" for p in module.parameters()):
            continue
        if kernels is None:
            kernels = (cpu_kernels.rms_norm(), cpu_kernels.silu_mul())
        norm, silu_mul = kernels
        if norm is None or silu_mul is None:
            return 0
        if is_llama_rms_norm(module):
            module.forward, kernel = types.MethodType(norm_forward, module), norm
        else:
            module.forward, kernel = types.MethodType(mlp_forward, module), silu_mul
        setattr(module, KERNEL_ATTR, kernel)
        n += 1
    return n


def drop_fused_layers(view: torch.nn.Module) -> int:
    """Give the fused modules back their class forward; returns how many."""
    n = 0
    for module in view.modules():
        if KERNEL_ATTR in vars(module):
            vars(module).pop("forward", None)
            delattr(module, KERNEL_ATTR)
            n += 1
    return n
