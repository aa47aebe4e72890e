"""Llama-family decoder layers and decoder stacks of the engine view in fewer calls on a CPU (issue 60: the few-row
step).

A decode step of a few rows is mostly fixed cost: at 5M (4 layers, 4 rows) the kernels are under half of a ~2.6 ms
step and the rest is Python, much of it transformers' module glue. Per decoder layer the class forward runs
`forward_with_checkpointing` and `deprecate_kwarg`'s wrappers, then four children through `nn.Module.__call__`
(`_wrapped_call_impl`, `_call_impl`, its hook checks) and `nn.Module.__getattr__` for each; per step the decoder stack
(`Qwen3Model`, ...) runs three decorators (`merge_with_config_defaults`, `capture_outputs`, `deprecate_kwarg`), slices
its `ModuleList` and calls each layer through `__call__`. The engine view's

- decoder layers whose class forward has the bytecode of Llama's (Llama, Qwen2/3, Qwen3-MoE, Mistral, Ministral,
  GLM, SmolLM3, DeepSeek-V3, ... share it) and whose four children run rollout's fused forwards
  (`rollout.kernels.fused_layers`: the two RMSNorms and the SiLU gated MLP; `rollout.kernels.fused_attention`: the
  attention) get an instance `forward` that runs the class forward's body (input_layernorm -> self_attn ->
  residual -> post_attention_layernorm -> mlp -> residual) calling those fused forwards directly;
- decoder stacks whose class forward (decorators included) has the bytecode of `LlamaModel`'s, `Qwen3Model`'s
  (Qwen2, SmolLM3) or `MistralModel`'s, every layer fused as above, get one that builds the same masks with the same
  mask functions, runs the rotary embedding and calls each layer's `forward` directly.

The same kernels run in the same order: the same bits (tests/kernels/test_fused_decoder.py). Only forwards whose
source this file was checked against are fused (`KNOWN_SOURCES`: transformers 5.23 and 5.24); another transformers
keeps the class forwards until this file is checked against it. A layer takes its class forward whenever positional
arguments or a cache object are passed, it trains, its hidden states are not fp32 CPU tensors without autograd,
autocast is on, or a hook is registered on a child or globally (`nn.Module.__call__` would run it); a stack whenever
the call is not the engine's (input ids and position ids, `use_cache=False`, no mask, cache or embeddings, no
`output_*` / `return_dict`, none asked for by the config), it trains, or a hook is registered on a layer or globally.
The children's fused forwards are checked once, at install: whoever gives a child its class forward back gives the
layer and the stack theirs too, as `drop_fused_layers` does (the same marker, `KERNEL_ATTR`: the batch-invariant mode,
the compiled forward). `ROLLOUT_FUSED_LAYERS=0` turns them off with the children's.
"""

from __future__ import annotations

import functools
import types

import torch
from torch.nn.modules import module as _nn_module

from rollout.kernels.fused_attention import attention_forward, module_globals, source_key
from rollout.kernels.fused_layers import KERNEL_ATTR, code_key, enabled, mlp_forward, norm_forward, plain_inputs

# NOTE: sha1 of the reference forwards' source (`source_key`: Llama's decoder layer, the three stacks): transformers
# 5.23 (past_key_values) and 5.24 (`cache`, behind deprecate_kwarg); the forwards below were checked against each
# (tests/kernels/test_fused_decoder.py passes on both)
KNOWN_SOURCES = {
    "layer": {"8c8727b7a2aac1a2", "953d3f186cbb7fe3"},
    "llama": {"8e1968d15e4fb369", "f014f65fd252431c"},
    "qwen3": {"866414aeb86141e3", "6ebfe0f7030d6524"},
    "mistral": {"8ba7b962ee6ef617", "bda644a86ae89e23"},
}
CHILDREN = {"input_layernorm": norm_forward, "self_attn": attention_forward,
            "post_attention_layernorm": norm_forward, "mlp": mlp_forward}
MODELS = ("llama", "qwen3", "mistral")
PASSED_NONE = ("attention_mask", "cache", "past_key_values", "inputs_embeds")  # NOTE: the fast path's, when None
# NOTE: torch's module-global hook dicts, mutated in place by `register_module_forward_hook` and its kin
GLOBAL_HOOKS = (_nn_module._global_forward_hooks, _nn_module._global_forward_pre_hooks,
                _nn_module._global_backward_hooks, _nn_module._global_backward_pre_hooks)


def _chain(fn) -> tuple:
    """The bytecode keys of `fn` and every function it wraps (`__wrapped__`: the decorators, then the body)."""
    keys = []
    while fn is not None:
        keys.append(code_key(fn))
        fn = getattr(fn, "__wrapped__", None)
    return tuple(keys)


@functools.cache
def references() -> dict[str, tuple]:
    """name -> the bytecode keys of the reference class forward and its decorators (`_chain`), for the references
    whose source is known: "layer" (`LlamaDecoderLayer`), "llama", "qwen3", "mistral" (`LlamaModel`, ...)."""
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaModel  # noqa: PLC0415
    from transformers.models.mistral.modeling_mistral import MistralModel  # noqa: PLC0415
    from transformers.models.qwen3.modeling_qwen3 import Qwen3Model  # noqa: PLC0415

    refs = {"layer": LlamaDecoderLayer.forward, "llama": LlamaModel.forward, "qwen3": Qwen3Model.forward,
            "mistral": MistralModel.forward}
    return {name: _chain(fn) for name, fn in refs.items() if source_key(fn) in KNOWN_SOURCES[name]}


def variant(module: torch.nn.Module) -> str | None:
    """"layer" when `module`'s class forward (with its decorators) has the bytecode of Llama's decoder-layer
    forward, "llama" / "qwen3" / "mistral" when it has that model's decoder-stack forward's, else None."""
    fn = getattr(type(module), "forward", None)
    if fn is None:
        return None
    chain = _chain(fn)
    return next((name for name, ref in references().items() if chain == ref), None)


def _fused_children(module: torch.nn.Module) -> tuple | None:
    """The layer's four children when each runs its fused instance forward (and none is compiled), else None."""
    children = []
    for name, fn in CHILDREN.items():
        child = module._modules.get(name)
        fwd = None if child is None else vars(child).get("forward")
        if getattr(fwd, "__func__", None) is not fn or KERNEL_ATTR not in vars(child) \
                or child._compiled_call_impl is not None:
            return None
        children.append(child)
    return tuple(children)


def _layer_forward(self, hidden_states, *args, **kwargs):
    if args or self.training or kwargs.get("cache") is not None or kwargs.get("past_key_values") is not None \
            or any(self._rollout_hooks) or not plain_inputs(hidden_states):
        return type(self).forward(self, hidden_states, *args, **kwargs)
    in_norm, attn, post_norm, mlp = self._rollout_children
    position_embeddings = kwargs.pop("position_embeddings", None)
    attention_mask = kwargs.pop("attention_mask", None)
    kwargs.pop("cache", None)
    kwargs.pop("past_key_values", None)
    if "position_ids" not in kwargs:  # NOTE: the class forward passes both to the attention, defaulted
        kwargs["position_ids"] = None
    if "use_cache" not in kwargs:
        kwargs["use_cache"] = False
    hidden, _ = attention_forward(attn, norm_forward(in_norm, hidden_states), position_embeddings, attention_mask,
                                   **kwargs)
    hidden = hidden_states + hidden
    return hidden + mlp_forward(mlp, norm_forward(post_norm, hidden))


def use_fused_decoder_layers(view: torch.nn.Module) -> int:
    """Give the view's Llama-family decoder layers whose four children run fused forwards on a CPU (call after
    `use_fused_layers` and `use_fused_attention`) the instance forward of the module doc; returns how many (0 when
    `ROLLOUT_FUSED_LAYERS=0`). Skips layers whose `forward` is already set on the instance."""
    if not enabled():
        return 0
    n = 0
    for module in view.modules():
        if "forward" in vars(module) or variant(module) != "layer":
            continue
        children = _fused_children(module)
        if children is None:
            continue
        module._rollout_children = children
        module._rollout_hooks = _hook_dicts(children)
        module.forward = types.MethodType(_layer_forward, module)
        setattr(module, KERNEL_ATTR, "decoder layer")
        n += 1
    return n


def _hook_dicts(modules) -> tuple:
    """The global hook dicts and `modules`' own: while any of them is non-empty, a call takes the class forward."""
    return GLOBAL_HOOKS + tuple(d for m in modules for d in (m._forward_hooks, m._forward_pre_hooks,
                                                              m._backward_hooks, m._backward_pre_hooks))


def _model_forward(self, input_ids=None, *args, **kwargs):
    cfg = self.config
    if args or input_ids is None or self.training or kwargs.get("position_ids") is None \
            or kwargs.get("use_cache") is not False or any(kwargs.get(k) is not None for k in PASSED_NONE) \
            or any(k.startswith("output_") or k == "return_dict" for k in kwargs) or any(self._rollout_hooks) \
            or cfg.output_attentions or cfg.output_hidden_states or not cfg.return_dict:
        return type(self).forward(self, input_ids, *args, **kwargs)
    for k in PASSED_NONE:
        kwargs.pop(k, None)
    position_ids = kwargs.pop("position_ids")
    hidden = self.embed_tokens(input_ids)
    glb, layers = module_globals(type(self)), tuple(self.layers._modules.values())[: cfg.num_hidden_layers]
    mask_args = (cfg, hidden, None, None, position_ids)  # NOTE: attention_mask and cache are None here
    name = self._rollout_variant
    if name == "qwen3":
        masks = {"full_attention": glb["create_causal_mask"](*mask_args)}
        if self.has_sliding_layers:
            masks["sliding_attention"] = glb["create_sliding_window_causal_mask"](*mask_args)
        masks = [masks[t] for t in cfg.layer_types[: len(layers)]]
    else:
        sliding = name == "mistral" and cfg.sliding_window is not None
        mask = glb["create_sliding_window_causal_mask" if sliding else "create_causal_mask"](*mask_args)
        masks = [mask] * len(layers)
    position_embeddings = self.rotary_emb(hidden, position_ids)
    for layer, mask in zip(layers, masks, strict=True):
        hidden = layer.forward(hidden, attention_mask=mask, position_ids=position_ids,
                               position_embeddings=position_embeddings, **kwargs)
    return glb["BaseModelOutputWithPast"](self.norm(hidden))


def use_fused_decoder_models(view: torch.nn.Module) -> int:
    """Give the view's Llama / Qwen3 / Mistral decoder stacks whose layers all run `_layer_forward` (call after
    `use_fused_decoder_layers`) the instance forward of the module doc; returns how many."""
    if not enabled():
        return 0
    n = 0
    for module in view.modules():
        if "forward" in vars(module) or variant(module) not in MODELS:
            continue
        layers = getattr(module, "layers", None)
        if not isinstance(layers, torch.nn.ModuleList) or not len(layers) or not all(
                getattr(vars(m).get("forward"), "__func__", None) is _layer_forward and m._compiled_call_impl is None
                for m in layers):
            continue
        module._rollout_variant = variant(module)
        module._rollout_hooks = _hook_dicts(layers)
        module.forward = types.MethodType(_model_forward, module)
        setattr(module, KERNEL_ATTR, "decoder stack")
        n += 1
    return n
