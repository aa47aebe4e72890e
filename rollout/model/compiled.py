"""The engine view's forward as ONE `torch.compile(fullgraph=True, dynamic=True)` graph, on a CPU.

Opt-in: `ContinuousBatchingConfig(default_compile_level=1)` (any level >= 1; off by default). Nothing
breaks the graph:

- our paged attention (cache writes, the C++ decode kernel, SDPA over prompt chunks) is one opaque
  custom op per layer, `rollout::paged_attention`. The per-step metadata (page tables, segments) is
  not a tensor, so the op finds it through the `CompiledForward` that runs the step: a 0-d tensor
  handle passed down HF's forward kwargs (`rollout_step`), never a constant baked into the graph;
- the view's oneDNN linears on packed weights (`rollout.kernels.linear`) are a second custom op,
  `rollout::packed_linear` (inductor's own lowering of `mkldnn._linear_pointwise` takes frozen weights
  only, and frozen weights would miss weight updates); the packed copies are refreshed before each
  forward, outside the graph, after any weight change.

Everything else of the HF forward (embedding, RMSNorm, RoPE, SiLU * mul, residual adds, the small
linears, the rows kept for the LM head) is inductor's: fused C++/OpenMP kernels instead of ~40 small ops
per layer dispatched from Python. The token dimension is dynamic: one graph serves every step size, plus
torch's specialisation of one-token steps; a new torch thread count compiles again (inductor's kernels
are built for it). Compiling takes ~10 s for a 5M model and ~60-70 s for a 100M one on the 2-core box of
`benchmarks/`, once per process and thread count; see `benchmarks/compile_fullgraph.py` for what it buys.

Dynamo's guards on the view's modules are skipped (`skip_guard_on_all_nn_modules_unsafe`: checking
them cost ~0.3 ms a step): the view is the engine's own, its structure never changes, and its tensors
are read again at every call.
"""

from __future__ import annotations

import itertools
import logging
import types
import weakref

import torch

from rollout.attention.interface import check_kwargs, paged_attention_forward
from rollout.kernels.fused_layers import drop_fused_layers
from rollout.kernels.linear import packed_weight, small_only

logger = logging.getLogger("rollout")

ATTN_NAME_COMPILED = "rollout_paged_compiled"

# NOTE: the one piece of module state: custom ops take tensors and numbers only, so the op reaches the
# step's metadata through this table, keyed by the handle each `CompiledForward` passes in.
_FORWARDS: weakref.WeakValueDictionary[int, CompiledForward] = weakref.WeakValueDictionary()
_HANDLES = itertools.count(1)
_COMPILE_ERRORS = (torch._dynamo.exc.TorchDynamoException, torch._dynamo.exc.FailOnRecompileLimitHit)
DYNAMIC = {"fullgraph": True, "dynamic": True}  # NOTE: the whole forward, one graph for every step size


def compile_kwargs(config, field: str = "decode_compile_config") -> dict:
    """`torch.compile` keyword arguments of a transformers `CompileConfig` (fullgraph, dynamic, backend, mode,
    options); ValueError naming `field` for anything else. NOTE: mode "reduce-overhead" means CUDA graphs, which
    rollout captures itself (`use_cuda_graph`): it is dropped; a mode and options together keep the options
    (torch.compile takes one of them)."""
    missing = [a for a in ("fullgraph", "dynamic", "backend", "mode", "options") if not hasattr(config, a)]
    if missing:
        raise ValueError(f"{field} must be a transformers CompileConfig (fields fullgraph, dynamic, backend, mode, "
                         f"options), got {type(config).__name__} without {missing}")
    kwargs = {"fullgraph": bool(config.fullgraph), "dynamic": config.dynamic, "backend": config.backend}
    if config.options:
        kwargs["options"] = dict(config.options)
    elif config.mode and config.mode != "reduce-overhead":
        kwargs["mode"] = config.mode
    return kwargs


@torch.library.custom_op("rollout::paged_attention", mutates_args=())
def paged_attention_op(
    query: torch.Tensor,  # [1, H, T, D]
    key: torch.Tensor,  # [1, Hkv, T, D]
    value: torch.Tensor,  # [1, Hkv, T, D]
    step: torch.Tensor,  # [] int64: the handle of the CompiledForward running this step
    layer: int,
    scale: float,
    softcap: float,  # 0: none
    window: int,  # 0: none
    sinks: torch.Tensor | None,  # [H] attention sinks (gpt-oss)
) -> torch.Tensor:  # [T, H, D], contiguous
    """rollout's paged attention for one layer. It also writes the step's K/V into the cache, which the
    graph does not see; each layer's call consumes the previous layer's output, so the order holds."""
    meta = _FORWARDS[int(step)].meta
    out, _ = paged_attention_forward(types.SimpleNamespace(layer_idx=layer), query, key, value, scaling=scale,
                                     sliding_window=window or None, softcap=softcap or None,
                                     rollout_meta=meta, s_aux=sinks)
    return out[0].contiguous()


@paged_attention_op.register_fake
def _(query, key, value, step, layer, scale, softcap, window, sinks):
    return query.new_empty(query.shape[2], query.shape[1], query.shape[3])


@torch.library.custom_op("rollout::packed_linear", mutates_args=())
def packed_linear_op(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """oneDNN's linear on a weight packed by `mkldnn._reorder_linear_weight` (what `rollout.kernels.linear` runs)."""
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


@packed_linear_op.register_fake
def _(x, weight, bias):
    return x.new_empty(*x.shape[:-1], weight.shape[0])


def compiled_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,  # [1, H, T, D]
    key: torch.Tensor,  # [1, Hkv, T, D]
    value: torch.Tensor,  # [1, Hkv, T, D]
    attention_mask: torch.Tensor | None = None,
    scaling: float | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    s_aux: torch.Tensor | None = None,
    dropout: float = 0.0,
    rollout_step: torch.Tensor | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:  # ([1, T, H, D], no weights)
    """The attention HF calls inside the compiled forward: the custom op (checks run at trace time)."""
    if rollout_step is None:
        raise RuntimeError(f"attention '{ATTN_NAME_COMPILED}' only runs inside rollout's compiled engine forward")
    check_kwargs(module, kwargs, dropout)
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    out = paged_attention_op(query, key, value, rollout_step, module.layer_idx, float(scale),
                             float(softcap or 0.0), int(sliding_window or 0), s_aux)
    return out[None], None


def _packed_forward(self: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    return packed_linear_op(x, self._rollout_w, self.bias)


def register() -> str:
    """Register the compiled attention with transformers (idempotent; no mask function, as
    `rollout.attention.interface.register` explains)."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_NAME_COMPILED, compiled_attention_forward)
    return ATTN_NAME_COMPILED


class CompiledForward:
    """Runs the engine view's forward compiled: `forward(rollout_meta=meta, input_ids=..., position_ids=...,
    logits_to_keep=..., use_cache=False)`, the runner's call. Switches the view to the compiled attention
    and its oneDNN linears (`rollout.kernels.linear`) to the packed-linear op."""

    def __init__(self, view: torch.nn.Module, compile_kwargs: dict | None = DYNAMIC) -> None:
        view.set_attn_implementation(register())
        drop_fused_layers(view)  # NOTE: dynamo cannot trace their C++ calls; the compiled graph fuses those ops itself
        self.handle = next(_HANDLES)
        _FORWARDS[self.handle] = self
        self.step = torch.tensor(self.handle)
        self.meta = None  # NOTE: the step's AttentionMetadata, set for the length of one forward
        self.linears = []
        for module in view.modules():
            if small_only(module):
                vars(module).pop("forward", None)  # NOTE: a smaller linear on the small-M kernel only: torch's, traced
            elif "_rollout_packed" in vars(module):  # NOTE: routed to oneDNN by rollout.kernels.linear
                module.forward = types.MethodType(_packed_forward, module)
                module._rollout_w = None
                self.linears.append(module)
        self.view = view
        self.eager = view.forward
        self.fn = self.eager if compile_kwargs is None else self.compile("", compile_kwargs)
        self.checked = False  # NOTE: set once a forward ran

    def compile(self, name: str, compile_kwargs: dict):
        """The view's forward compiled with `torch.compile(**compile_kwargs)` behind a code object of its own
        (`name` tells it apart: its own dynamo cache and recompile limit, e.g. one per decode bucket)."""
        kwargs = dict(compile_kwargs)
        if "mode" not in kwargs:  # NOTE: torch.compile takes a mode or options, not both
            kwargs["options"] = {"guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe,
                                 **(kwargs.get("options") or {})}
        return torch.compile(_entry_point(self.view, f"{self.handle}{name}"), **kwargs)

    def _refresh_packed(self) -> None:
        """Pack each routed weight again when it changed (`rollout.kernels.linear.packed_weight`), outside the graph."""
        for m in self.linears:
            m._rollout_w = packed_weight(m)

    def __call__(self, rollout_meta, **kwargs):
        out, self.fn = self.run(self.fn, rollout_meta, kwargs)
        return out

    def run(self, fn, rollout_meta, kwargs: dict):
        """(`fn(**kwargs)` with `rollout_meta` as the step's metadata, the function to call from now on: `fn`, or
        the eager forward once compiling `fn` failed, with one warning)."""
        self._refresh_packed()
        self.meta = rollout_meta
        try:
            try:
                out = fn(rollout_step=self.step, **kwargs)
            except Exception as e:
                # NOTE: the first call compiles (any failure there: no compiler, an op dynamo cannot trace);
                # later ones may compile again (a new thread count, past dynamo's recompile limit).
                if fn is self.eager or (self.checked and not isinstance(e, _COMPILE_ERRORS)):
                    raise
                logger.warning("rollout: compiling the engine forward failed (%s: %s); this engine runs it "
                               "uncompiled from now on", type(e).__name__, (str(e).splitlines() or [""])[0])
                fn = self.eager
                out = fn(rollout_step=self.step, **kwargs)
            self.checked = True
            return out, fn
        finally:
            self.meta = None


def _entry_point(view: torch.nn.Module, handle: str):
    """`view.forward` behind a code object of its own: dynamo keeps its compiled graphs (and its limit of 8
    per code object, past which a fullgraph compile raises) per code object, and HF's forwards share one
    decorator wrapper's code, so without this every engine of the process would share one cache."""

    def forward(**kwargs):
        return view.forward(**kwargs)

    code = forward.__code__.replace(co_name=f"rollout_forward_{handle}")
    return types.FunctionType(code, forward.__globals__, code.co_name, None, forward.__closure__)
