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

Where a step's rows are all decode rows read in place (a decode-only step, a verifying step), everything is fp32
and each of the layer's seven linears would run on the small-M kernel (`rollout.kernels.linear.decode_panels`), a
fused layer goes one step further: one `decoder_layer` call (rollout/kernels/csrc/decoder_layer.cpp) runs those same
kernels in that order from C++, with no Python between them (`_native_layer`; `ROLLOUT_NATIVE_LAYERS=0` turns it off).
At 5M and 4 rows the Python between a layer's kernels cost more than the kernels (~330 of ~530 us a layer): the
step went 2.47 -> 2.01 ms, 1 row 2.20 -> 1.75, a 4 x 9-token verifying step 5.62 -> 4.75 (interleaved, one process).

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
import os
import types

import torch
from torch.nn.modules import module as _nn_module

from rollout.kernels import cpu_kernels
from rollout.kernels.fused_attention import WINDOW, attention_forward, attention_variant, module_globals, source_key
from rollout.kernels.fused_layers import KERNEL_ATTR, code_key, enabled, mlp_forward, norm_forward, plain_inputs
from rollout.kernels.linear import decode_panels

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
    native = self._rollout_native
    if native is UNSET and "rollout_meta" in kwargs:  # NOTE: the engine's first forward, on its attention
        native = self._rollout_native = _native(self, self._rollout_children)
    if native is not None and native is not UNSET \
            and (out := _native_layer(self, native, hidden_states, kwargs)) is not None:
        return out
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


UNSET = object()
# NOTE: the keyword arguments the decoder stack passes a layer that `_native_layer` knows (the attention function
# ignores position_ids, use_cache and the mask; cache and past_key_values are None there): any other goes the Python way
NATIVE_KWARGS = frozenset({"rollout_meta", "position_embeddings", "attention_mask", "position_ids", "use_cache",
                           "cache", "past_key_values"})


def _native_layer(self, native, x, kwargs):
    """The layer's output from one `decoder_layer` call (rollout/kernels/csrc/decoder_layer.cpp: the kernels the
    Python path runs, in its order, same bits), or None where that path would run anything else: rows not all
    decode rows read in place (a prompt chunk, sdpa's buckets), a cache or rows not fp32, a linear off the small-M
    kernel (too many rows, hooks, an adapter), a window the group does not have (the Python path raises), kwargs
    it does not know, the first step's layer check."""
    kernel, attn, config, attention, layer, d, window_from, linears, norms, qk_norms = native
    meta, pe = kwargs.get("rollout_meta"), kwargs.get("position_embeddings")
    if meta is None or pe is None or meta.layers_seen is not None or not NATIVE_KWARGS.issuperset(kwargs) \
            or x.dim() != 3 or x.shape[0] != 1 or not x.is_contiguous() \
            or getattr(meta.backend, "name", None) != "cpu" or config._attn_implementation != attention:
        return None
    cache = meta.cache
    group = meta.groups[cache.group_of(layer)]
    paged = getattr(group, "paged", None)
    if paged is None or not paged.all_rows or group.buckets or group.segments:
        return None
    window = None if window_from is None else \
        (attn.sliding_window if window_from == "module" else getattr(config, "sliding_window", None))
    if (window or None) != group.window:
        return None
    cos, sin = pe
    t, e = x.shape[1], x.shape[2]
    if cos.dtype is not torch.float32 or cos.shape != (1, t, d) or sin.shape != cos.shape or not cos.is_cpu:
        return None
    panels, biases, outs = [], [], []
    for m in linears:
        p = decode_panels(m, t)
        if p is None:
            return None
        panels.append(p)
        biases.append(m._parameters["bias"])
        outs.append(m._parameters["weight"].shape[0])  # NOTE: the weight held (a tensor-parallel shard's rows)
    heads, kv_heads = outs[0] // d, outs[1] // d
    if heads * d != outs[0] or kv_heads * d != outs[1] or outs[2] != outs[1] \
            or linears[3]._parameters["weight"].shape[1] != outs[0]:
        return None
    slots = group.slot_mapping
    k_cache, v_cache = cache.layer(layer, kv_heads, d)  # NOTE: last: it makes the storage of a key it has not seen
    if k_cache.dtype is not torch.float32 or v_cache.dtype is not torch.float32 or slots.dtype is not torch.long:
        return None
    (in_w, in_eps), (post_w, post_eps) = ((n._parameters["weight"], float(n.variance_epsilon)) for n in norms)
    if not (plain_inputs(x, in_w) and plain_inputs(x, post_w)):
        return None
    qw, kw, qe, ke = None, None, 0.0, 0.0
    if qk_norms is not None:
        qn, kn = qk_norms
        qw, kw, qe, ke = qn._parameters["weight"], kn._parameters["weight"], float(qn.variance_epsilon), \
            float(kn.variance_epsilon)
    out = kernel(x.view(t, e), in_w, in_eps, post_w, post_eps, panels, biases, outs, qw, kw, qe, ke, cos.view(t, d),
                 sin.view(t, d), heads, kv_heads, d, k_cache, v_cache, slots, paged.table, paged.row, paged.start,
                 paged.end, cache.page_size, float(attn.scaling), paged.alias)
    return out.view(1, t, e)


def _native(module: torch.nn.Module, children: tuple):
    """`_native_layer`'s fixed arguments for a fused layer (the kernel, the attention, its config and the attention
    implementation it runs now -- the engine's, called from the engine's first forward --, its layer index and head
    size, where its window comes from, its seven linears, two norms, the q / k norms or None), or None: no kernel, or
    an attention it does not cover."""
    kernel = cpu_kernels.decoder_layer() if native_enabled() else None
    in_norm, attn, post_norm, mlp = children
    variant = attention_variant(attn)
    layer, d = getattr(attn, "layer_idx", None), getattr(attn, "head_dim", None)
    if kernel is None or variant is None or not isinstance(layer, int) or not isinstance(d, int) or d <= 0:
        return None
    linears = (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj)
    if not all(type(m) is torch.nn.Linear for m in linears):
        return None
    qk_norms = (attn.q_norm, attn.k_norm) if variant == "qwen3" else None
    return (kernel, attn, attn.config, attn.config._attn_implementation, layer, d, WINDOW[variant], linears,
            (in_norm, post_norm), qk_norms)


def set_native_layers(view: torch.nn.Module, on: bool) -> int:
    """Let the view's fused decoder layers run `_native_layer` (on: from their next engine forward, as at install) or
    only their Python path (benchmarks' A/B); returns how many layers."""
    layers = [m for m in view.modules() if "_rollout_native" in vars(m)]
    for m in layers:
        m._rollout_native = UNSET if on else None
    return len(layers)


def native_enabled() -> bool:
    """False when `ROLLOUT_NATIVE_LAYERS=0` (the fused layers then run their Python path)."""
    return os.environ.get("ROLLOUT_NATIVE_LAYERS", "1") != "0"


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
        module._rollout_native = UNSET  # NOTE: `_native`'s, at the first forward (`_layer_forward`)
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
