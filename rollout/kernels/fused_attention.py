"""Llama-family attention modules and rotary embeddings of the engine view in fewer calls on a CPU.

A decode step of a 12-layer Qwen3 spends about a fifth of its time in transformers' module glue around the
kernels (py-spy at 16 rows, 100M), a third of that in the attention forward and its RoPE: three projection
calls, `view`/`transpose`, q_norm and k_norm, and `apply_rotary_pos_emb` (per q and k: two slices, a `neg`, a
`cat`, two `mul`s and an `add`), each on a few rows; and the rotary embedding recomputes cos / sin of every
position every step. The engine view's modules whose class forward is one of the forwards below get an
instance `forward` that computes the same thing in fewer calls:

- the attention of Llama (Granite, Gemma, GLM, Qwen2-MoE, ...), Qwen3 (q_norm / k_norm; Qwen3-MoE) and
  Mistral (Mixtral): the three projections in one call when they run on rollout's small-M kernel
  (`rollout.kernels.linear.linears`), q_norm / k_norm and the rotation in one (`qk_norm_rope`, bit for bit
  transformers' RMSNorm and `apply_rotary_pos_emb`), then the same attention interface and `o_proj`;
- the rotary embedding of the default, linear, yarn and llama3 RoPE types (fixed `inv_freq`): cos / sin read
  from a table of positions computed by the class forward itself (the same values), grown as positions do.

A module is fused only when its class forward has the bytecode of the reference class's and that reference's
source is one this file was written against (`KNOWN_SOURCES`: transformers 5.23 and 5.24); another
transformers keeps the class forwards until this file is checked against it. The instance forwards take the
class forward whenever the inputs are not fp32 CPU tensors without autograd, a cache object is passed, or the
module trains. `drop_fused_layers` (the batch-invariant mode, the compiled forward) removes them with the rest.
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import textwrap
import types

import torch

from rollout.kernels import cpu_kernels
from rollout.kernels.fused_layers import KERNEL_ATTR, code_key, enabled, is_llama_rms_norm, plain_inputs
from rollout.kernels.linear import linears

# NOTE: sha1 of the reference forwards' source (`source_key`): transformers 5.23 (past_key_values) and 5.24
# (`cache`, behind deprecate_kwarg); the forward below was checked against each (tests/kernels/test_fused_attention.py)
KNOWN_SOURCES = {
    "llama": {"9ec290e693aa2519", "bcb1c27cdcf3820f"},
    "qwen3": {"bb7da0f854bb6d3b", "9e6b5f545474d484"},
    "mistral": {"3cf8de7318b6a66d", "358a7fb43ccfec0f"},
    "rotary": {"419e93cc8429dae7", "8128803b1d858295"},
}
WINDOW = {"llama": None, "qwen3": "module", "mistral": "config"}  # NOTE: where each passes sliding_window from
STATIC_ROPE_TYPES = ("default", "linear", "yarn", "llama3")  # NOTE: inv_freq and attention_scaling fixed at init
MIN_TABLE = 256


def source_key(fn) -> str | None:
    try:
        return hashlib.sha1(textwrap.dedent(inspect.getsource(inspect.unwrap(fn))).encode()).hexdigest()[:16]
    except (OSError, TypeError):  # NOTE: no source (a frozen install): not fused
        return None


@functools.cache
def references() -> dict[str, tuple]:
    """variant -> (bytecode key of the reference forward, its module's `apply_rotary_pos_emb` and `rotate_half`
    keys), for the references whose source is known; the rotary embedding under "rotary"."""
    from transformers.models.llama import modeling_llama  # noqa: PLC0415
    from transformers.models.mistral.modeling_mistral import MistralAttention  # noqa: PLC0415
    from transformers.models.qwen3.modeling_qwen3 import Qwen3Attention  # noqa: PLC0415

    refs = {"llama": modeling_llama.LlamaAttention.forward, "qwen3": Qwen3Attention.forward,
            "mistral": MistralAttention.forward, "rotary": modeling_llama.LlamaRotaryEmbedding.forward}
    helpers = (code_key(inspect.unwrap(modeling_llama.apply_rotary_pos_emb)), code_key(modeling_llama.rotate_half))
    return {name: (code_key(inspect.unwrap(fn)), helpers) for name, fn in refs.items()
            if source_key(fn) in KNOWN_SOURCES[name]}


def attention_variant(module: torch.nn.Module) -> str | None:
    """"llama", "qwen3" or "mistral" when `module`'s class forward is that reference's (and its helpers are
    Llama's), else None."""
    fn = getattr(type(module), "forward", None)
    if fn is None or not all(isinstance(getattr(module, n, None), torch.nn.Module)
                             for n in ("q_proj", "k_proj", "v_proj", "o_proj")):
        return None
    inner = inspect.unwrap(fn)
    key, glb = code_key(inner), getattr(inner, "__globals__", {})
    for name, (ref, (rope_key, rotate_key)) in references().items():
        if name == "rotary" or key != ref:
            continue
        rope, rotate = glb.get("apply_rotary_pos_emb"), glb.get("rotate_half")
        if rope is None or rotate is None or code_key(inspect.unwrap(rope)) != rope_key \
                or code_key(rotate) != rotate_key:
            return None
        if name == "qwen3" and not all(is_llama_rms_norm(getattr(module, n, None) or torch.nn.Identity())
                                       for n in ("q_norm", "k_norm")):
            return None
        return name
    return None


@functools.cache
def module_globals(cls: type) -> dict:
    """The globals of `cls.forward`'s module (its `ALL_ATTENTION_FUNCTIONS`, `eager_attention_forward`)."""
    return inspect.unwrap(cls.forward).__globals__


def is_static_rotary(module: torch.nn.Module) -> bool:
    """Whether `module` is a Llama-family rotary embedding whose cos / sin depend on the position only."""
    ref = references().get("rotary")
    fn = getattr(type(module), "forward", None)
    return ref is not None and fn is not None and code_key(inspect.unwrap(fn)) == ref[0] \
        and getattr(module, "rope_type", None) in STATIC_ROPE_TYPES \
        and isinstance(getattr(module, "inv_freq", None), torch.Tensor)


def attention_forward(self, hidden_states, position_embeddings=None, attention_mask=None, cache=None,
                       past_key_values=None, **kwargs):
    if cache is None and past_key_values is None and position_embeddings is not None and not self.training \
            and plain_inputs(hidden_states):
        out = _fused_attention(self, hidden_states, position_embeddings, attention_mask, kwargs)
        if out is not None:
            return out
    if cache is not None:
        kwargs["cache"] = cache
    if past_key_values is not None:
        kwargs["past_key_values"] = past_key_values
    return type(self).forward(self, hidden_states, position_embeddings, attention_mask, **kwargs)


def _fused_attention(self, x, position_embeddings, attention_mask, kwargs):
    cos, sin = position_embeddings
    d, shape = self.head_dim, x.shape[:-1]
    if cos.dtype is not torch.float32 or cos.shape[-1] != d or sin.shape != cos.shape or cos.dim() != len(shape) + 1:
        return None
    if cos.shape[:-1] != shape:  # NOTE: one row of positions for a batch (HF's position_ids [1, T])
        try:
            cos, sin = cos.expand(*shape, d), sin.expand(*shape, d)
        except RuntimeError:
            return None
    q, k, v = linears(x, (self.q_proj, self.k_proj, self.v_proj))
    variant, glb = self._rollout_variant, module_globals(type(self))
    if variant == "qwen3":
        qn, kn = self.q_norm, self.k_norm
        qw, kw, qe, ke = qn.weight, kn.weight, float(qn.variance_epsilon), float(kn.variance_epsilon)
        if not (plain_inputs(q, qw) and plain_inputs(k, kw)):
            return None
    else:
        qw = kw = None
        qe = ke = 0.0
    q, k = self._rollout_fused(q.reshape(-1, q.shape[-1]), k.reshape(-1, k.shape[-1]), qw, kw, qe, ke,
                               cos.reshape(-1, d), sin.reshape(-1, d), d)
    q = q.view(*shape, -1, d).transpose(1, 2)
    k = k.view(*shape, -1, d).transpose(1, 2)
    v = v.view(*shape, -1, d).transpose(1, 2)
    window = WINDOW[variant]
    if window == "module":
        kwargs["sliding_window"] = self.sliding_window
    elif window == "config":
        kwargs["sliding_window"] = getattr(self.config, "sliding_window", None)
    interface = glb["ALL_ATTENTION_FUNCTIONS"].get_interface(self.config._attn_implementation,
                                                              glb["eager_attention_forward"])
    out, weights = interface(
        self,
        q,
        k,
        v,
        attention_mask,
        dropout=0.0 if not self.training else self.attention_dropout,
        scaling=self.scaling,
        **kwargs,
    )
    return self.o_proj(out.reshape(*shape, -1).contiguous()), weights


def _rotary_forward(self, x, position_ids):
    if not (x.is_cpu and position_ids.is_cpu) or position_ids.numel() == 0:
        return type(self).forward(self, x, position_ids)
    inv = self.inv_freq
    key = (x.dtype, inv.data_ptr(), inv._version, float(self.attention_scaling), torch.is_inference_mode_enabled())
    table = self._rollout_table
    need = int(position_ids.max()) + 1
    if table is None or table[0] != key or table[1].shape[0] < need:
        size = max(MIN_TABLE, 1 << (need - 1).bit_length(), 0 if table is None else 2 * table[1].shape[0])
        with torch.no_grad():
            cos, sin = type(self).forward(self, x, torch.arange(size, device=x.device)[None])
        table = self._rollout_table = (key, cos[0], sin[0])
    idx = position_ids.reshape(-1)
    out_shape = (*position_ids.shape, table[1].shape[-1])
    return table[1].index_select(0, idx).view(out_shape), table[2].index_select(0, idx).view(out_shape)


def rotary_table_size(module: torch.nn.Module) -> int:
    """How many positions the fused rotary embedding `module` holds cos / sin for (0: none yet, or not fused)."""
    table = getattr(module, "_rollout_table", None)
    return 0 if table is None else table[1].shape[0]


def use_fused_attention(view: torch.nn.Module) -> int:
    """Give the view's Llama-family attentions and static rotary embeddings on a CPU their fused forwards (see the
    module doc); returns how many modules (0 when `ROLLOUT_FUSED_LAYERS=0`). Skips modules whose `forward` is
    already set on the instance."""
    if not enabled():
        return 0
    kernel = None
    n = 0
    for module in view.modules():
        if "forward" in vars(module) or not any(t.device.type == "cpu" for t in (*module.parameters(),
                                                                                  *module.buffers())):
            continue
        if is_static_rotary(module):
            module.forward = types.MethodType(_rotary_forward, module)
            module._rollout_table = None
            setattr(module, KERNEL_ATTR, "rotary table")
            n += 1
            continue
        variant = attention_variant(module)
        if variant is None:
            continue
        if kernel is None:
            kernel = cpu_kernels.qk_norm_rope()
            if kernel is None:
                return n
        module.forward = types.MethodType(attention_forward, module)
        module._rollout_variant = variant
        setattr(module, KERNEL_ATTR, kernel)
        n += 1
    return n
