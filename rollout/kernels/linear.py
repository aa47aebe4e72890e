"""fp32 and bf16 Linear layers of the engine view through oneDNN on packed weights, on a CPU.

On a CPU torch runs an fp32 `F.linear` through MKL; bf16 already goes through oneDNN, on the plain
weight layout (packing helps it as much: see `DTYPES`). Inside a model
forward the weights stream from memory every step, and there MKL's sgemm falls far short: on the
2-core AMD EPYC of `benchmarks/`, a 100M Qwen3-arch forward over 1 / 3 / 16 / 64 tokens took 47 / 612
/ 72 / 148 ms with MKL and 29 / 38 / 61 / 112 ms with oneDNN's `_linear_pointwise` on the same, unpacked
weights. oneDNN's own blocked layout of the weight ("packed", as vLLM's CPU build keeps it) is faster
again in decode: 24-28 / 33-35 / 81-91 ms at 3 / 16 / 64 tokens. Small layers, whose weights stay in
cache, keep MKL: oneDNN's per-call cost (~12 us) is larger than their matmul there.

The packed copy costs one more copy of those weights (the engine's own, as any serving engine holds).
It is rebuilt at the first forward after the weight changed: in place (the tensor's version counter),
replaced (its storage), or through `update_weights` / `reset_prefix_cache` (which drop every copy).
Writes through `.data` reach neither counter nor storage; like the prefix cache, they need
`update_weights`.

Only the engine view is touched (the user's module keeps its forward): each plain `nn.Linear` of the
view whose fp32 or bf16 CPU weight has at least `MIN_WEIGHT_ELEMENTS` elements gets an instance
`forward` that calls oneDNN on the packed weight, and falls back to `F.linear` when the input's dtype
differs from the weight's or either is not on a CPU. Vendors' vLLM
CPU builds route their linears to oneDNN for the same reason. The results match `F.linear` to float
rounding (not bitwise: another summation order).

Smaller fp32 weights (`SMALL_WEIGHT_ELEMENTS` up to `MIN_WEIGHT_ELEMENTS`: a 5M model's q / k / v / o, SmolLM2-135M's
k / v) run on the small-M kernel below at decode sizes only and keep torch's linear above `SMALL_ROWS` rows (no
packed copy): inside a step MKL took 23-35 us a 4-row call of a 256 x 256 weight (9 us alone, back to back), and
with a layer's q / k / v in one small-M call a 4-row 5M decode step ran ~7% faster.

Decode steps (up to `SMALL_ROWS` fp32 rows) go further: oneDNN reads a weight and then computes on it,
so 16 rows cost the memory time plus the FMA time. rollout's small-M kernel (`rollout/kernels/csrc/small_gemm.cpp`)
streams the weights ahead of the FMAs on its own panel layout (a second copy, built at the first decode
step, dropped with the packed one), 1.3-1.4x oneDNN's packed linears over 1-32 rows.
"""

from __future__ import annotations

import functools
import logging
import os
import types
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch.nn.modules import module as _nn_module

from rollout.kernels import cpu_kernels

logger = logging.getLogger("rollout")

# NOTE: measured on the packed weights, 2 threads: from 2**18 fp32 elements (1 MiB: a 5M model's 4096x256
# head, every linear of a 100M model) oneDNN wins at any row count (1.5-1.8x at 1-64 rows); from 2**17
# (a 256x768 MLP, a 768x256 K/V projection) it wins from 8 rows on (1.2-1.6x at 16-64) and loses at 1
# (~5 us); below that (256x256) MKL is as fast or faster.
MIN_WEIGHT_ELEMENTS = 2**17
ALWAYS_WEIGHT_ELEMENTS = 2**18
MIN_ROWS = 8  # rows from which a weight between the two sizes runs on oneDNN
# NOTE: from here up to MIN_WEIGHT_ELEMENTS an fp32 weight runs on the small-M kernel up to SMALL_ROWS rows and on
# torch's linear above (issue 60, ninth session): alone, back to back, MKL and the small-M kernel tie at 36-48 rows
# and ours wins at 1-16 (256 x 256: 9 vs 7 us at 4 rows); inside a 4-row 5M decode step MKL's calls took 23-35 us
# (the weights and MKL's threads cold after the other kernels) and the step ran 7.4% faster routed (8 tail seeds,
# four engines in lockstep; the speculative one 2.6%). Below it (the tests' tiny models) torch's linear stays.
SMALL_WEIGHT_ELEMENTS = 2**15
# NOTE: bf16 already runs on oneDNN in torch, but on the plain layout: packed, a 100M bf16 forward over
# 3 / 16 / 64 tokens took 18.5 / 24.7 / 55.5 ms against 29.3 / 43.5 / 75.6 (same results, bit for bit).
DTYPES = (torch.float32, torch.bfloat16)


@functools.cache
def onednn_available() -> bool:
    """Whether torch's oneDNN fp32 linear runs here (probed once on a tiny input)."""
    try:
        x, w = torch.ones(2, 4), torch.ones(3, 4)
        with torch.inference_mode():
            y = torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")
        return bool(torch.backends.mkldnn.is_available()) and torch.equal(y, torch.full((2, 3), 4.0))
    except Exception:  # noqa: BLE001 - any failure means "not here": the view keeps torch's linear
        return False


@functools.cache
def onednn_dtypes() -> tuple[torch.dtype, ...]:
    """The weight dtypes oneDNN packs on this CPU: fp32 wherever oneDNN runs, bf16 only where the CPU has the
    instructions its bf16 path needs (AVX512-BF16 / AVX-NE-CONVERT or AVX512BW+VL+DQ; without them torch raises
    at the first pack, so such weights keep torch's linear)."""
    if not onednn_available():
        return ()
    try:
        with torch.inference_mode():
            torch.ops.mkldnn._reorder_linear_weight(torch.ones(3, 4, dtype=torch.bfloat16), PACK_ROWS)
        return DTYPES
    except Exception:  # noqa: BLE001 - e.g. "bf16 path needs the cpu support avx_ne_convert or avx512bw, ..."
        return (torch.float32,)


# NOTE: up to this many rows an fp32 linear runs on rollout's small-M kernel (rollout/kernels/csrc/small_gemm.cpp),
# which streams the weights while it computes; above, oneDNN's packed GEMM is faster (measured on the 100M
# model's 84 layer linears + head at 2 threads, oneDNN -> ours: 1 row 11.8 -> 8.7 ms, 16 rows 14.9 -> 10.5,
# 32 rows 22.2 -> 17.4, 64 rows 35.5 -> 33.0, 512 rows 258 -> 377; `benchmarks/decode_linears.py`). 48, not 32: a
# speculative step verifies 4 rows x (1 + 8) tokens = 36 (issue 60; at 1 thread on a loaded box, ours / oneDNN
# 1.08x at 36 rows, 1.10x at 48, 0.95x at 64; the 100M verifying step 104 vs 110 ms CPU, `benchmarks/verify_step.py`).
# With two-panel tiles above 16 rows (issue 60, seventh session), ours / oneDNN 1.05-1.09x at 36 rows and 0.98-1.04x
# at 48 on the 100M linears at 2 threads (`logs/decode_linears/100m_two_panel_tiles_*`)
SMALL_ROWS = 48
# NOTE: the batch size oneDNN lays a packed weight out for; decode steps run 1-256 rows and prompt chunks
# more, and one layout serves every size (measured: packed for 16 or 64 rows, the same speed at 1-64).
PACK_ROWS = 16


try:
    _LINEAR_POINTWISE = torch.ops.mkldnn._linear_pointwise.default
except (AttributeError, RuntimeError):  # NOTE: a torch without oneDNN: nothing is routed (`onednn_available`)
    _LINEAR_POINTWISE = None


def _weight_copy(module: torch.nn.Linear, attr: str, make) -> torch.Tensor:
    """`make(weight)`, kept in `module.<attr>` and made again after any change the engine can see: an in-place
    write bumps `_version`, a new storage moves `data_ptr`, and `update_weights` / `reset_prefix_cache` drop every
    copy (`drop_packed`)."""
    w, held = module.weight, getattr(module, attr)
    if held is None or held[1] != w._version or held[2] != w.data_ptr():
        held = (make(w.detach()), w._version, w.data_ptr())
        setattr(module, attr, held)
    return held[0]


def packed_weight(module: torch.nn.Linear) -> torch.Tensor:
    """The module's weight in oneDNN's packed layout (see `_weight_copy`)."""
    return _weight_copy(module, "_rollout_packed", lambda w: torch.ops.mkldnn._reorder_linear_weight(w, PACK_ROWS))


def panel_weight(module: torch.nn.Linear) -> torch.Tensor:
    """The module's fp32 weight as `small_linear`'s panels (see `_weight_copy`)."""
    return _weight_copy(module, "_rollout_panels", lambda w: cpu_kernels.pack_panels()(w))


def _onednn_forward(self: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    # NOTE: runs ~85 times a decode step of a 100M model: the checks are ordered and kept cheap (`is_cpu`, no
    # `device` objects, the weight's shape read once at routing: `_rollout_k`, `_rollout_n`)
    w, b = self.weight, self.bias
    k, numel = self._rollout_k, x.numel()
    if x.dtype is w.dtype and x.is_cpu and w.is_cpu and (b is None or b.dtype is w.dtype) \
            and w.dtype in self._rollout_dtypes and (self._rollout_always or numel >= MIN_ROWS * k) \
            and not torch.is_autocast_enabled("cpu"):  # NOTE: under autocast, torch's linear keeps its semantics
        if self._rollout_small is not None and numel <= SMALL_ROWS * k and w.dtype is torch.float32:
            held = self._rollout_panels  # NOTE: `panel_weight`'s check, inlined (0.6 us a call: 85 calls a step)
            panels = held[0] if held is not None and held[1] == w._version and held[2] == w.data_ptr() \
                else panel_weight(self)
            y = self._rollout_small(x.reshape(-1, k), panels, b, self._rollout_n)
            return y.view(*x.shape[:-1], self._rollout_n)
        if self._rollout_onednn:
            return _LINEAR_POINTWISE(x, packed_weight(self), b, "none", [], "")
    return F.linear(x, w, b)


def _small_panels(module: torch.nn.Module, x: torch.Tensor) -> torch.Tensor | None:
    """The panels `module`'s own forward would hand the small-M kernel for `x` (the same checks as
    `_onednn_forward`), or None: another route, hooks, or a forward that is not ours."""
    if not (x.dtype is torch.float32 and x.is_cpu and x.dim() and x.shape[-1] \
            and x.shape[-1] == getattr(module, "_rollout_k", None)):
        return None
    return decode_panels(module, x.numel() // x.shape[-1])


def decode_panels(module: torch.nn.Module, rows: int) -> torch.Tensor | None:
    """The panels `module`'s own forward would hand the small-M kernel for `rows` fp32 CPU rows, or None: another
    route (too many or too few rows, another dtype, no kernel), hooks, or a forward that is not ours."""
    fwd = vars(module).get("forward")
    if getattr(fwd, "__func__", None) is not _onednn_forward or module._forward_hooks or module._forward_pre_hooks \
            or module._rollout_small is None:
        return None
    params = module._parameters  # NOTE: not `module.weight`: nn.Module.__getattr__ costs ~0.4 us a read, 14 a layer
    w, b = params.get("weight"), params.get("bias")
    if not (w is not None and w.dtype is torch.float32 and w.is_cpu and (b is None or b.dtype is torch.float32)
            and rows <= SMALL_ROWS and (module._rollout_always or rows >= MIN_ROWS)):
        return None
    held = module._rollout_panels
    return held[0] if held is not None and held[1] == w._version and held[2] == w.data_ptr() else panel_weight(module)


def linears(x: torch.Tensor, modules) -> list[torch.Tensor]:
    """`[m(x) for m in modules]`, in one call of the small-M kernel when every module would run on it for `x`
    (`small_linears`: the same bits as each module's own call), else one call per module."""
    panels = [_small_panels(m, x) for m in modules]
    kernel = cpu_kernels.small_linears() if all(p is not None for p in panels) else None
    if kernel is None or torch.is_autocast_enabled("cpu") or _nn_module._global_forward_hooks \
            or _nn_module._global_forward_pre_hooks:
        return [m(x) for m in modules]
    ys = kernel(x.reshape(-1, x.shape[-1]), panels, [m.bias for m in modules], [m._rollout_n for m in modules])
    return [y.view(*x.shape[:-1], m._rollout_n) for y, m in zip(ys, modules, strict=True)]


class RoutedCopies(NamedTuple):
    """What a routed linear holds now: its weight in oneDNN's packed layout, as the small-M kernel's panels
    (each None until a forward needed it, or after `drop_packed`), and the small-M kernel it routes decode
    rows to (None: off, `ROLLOUT_SMALL_LINEARS=0` or no kernels)."""

    packed: torch.Tensor | None
    panels: torch.Tensor | None
    small: object | None


def routed_copies(module: torch.nn.Linear) -> RoutedCopies:
    """The copies `module` holds (see `RoutedCopies`)."""
    def held(attr: str) -> torch.Tensor | None:
        copy = getattr(module, attr, None)
        return None if copy is None else copy[0]

    return RoutedCopies(held("_rollout_packed"), held("_rollout_panels"), getattr(module, "_rollout_small", None))


def drop_packed(view: torch.nn.Module) -> int:
    """Forget the packed weight copies (they are rebuilt at the next forward); returns how many were held."""
    n = 0
    for module in view.modules():
        if getattr(module, "_rollout_packed", None) is not None:
            module._rollout_packed = None
            n += 1
        if getattr(module, "_rollout_panels", None) is not None:
            module._rollout_panels = None
            n += 1
        # NOTE: the compiled forward's copy (rollout.model.compiled)
        if getattr(module, "_rollout_w", None) is not None:
            module._rollout_w = None
    return n


def enabled() -> bool:
    """False when `ROLLOUT_ONEDNN_LINEARS=0` (the view then runs torch's own linear: no packed copies)."""
    return os.environ.get("ROLLOUT_ONEDNN_LINEARS", "1") != "0"


def small_enabled() -> bool:
    """False when `ROLLOUT_SMALL_LINEARS=0` (decode-sized fp32 rows then stay on oneDNN too)."""
    return os.environ.get("ROLLOUT_SMALL_LINEARS", "1") != "0"


def use_onednn_linears(view: torch.nn.Module, min_elements: int | None = None) -> int:
    """Route the view's large fp32 / bf16 CPU `nn.Linear`s through oneDNN, and its smaller fp32 ones (from
    `SMALL_WEIGHT_ELEMENTS`) to the small-M kernel at decode sizes; returns how many were routed.

    Skips modules whose `forward` is already set on the instance (accelerate's hooks, other wrappers)
    and subclasses of `nn.Linear` (quantized or adapter layers keep their own forward)."""
    if not (enabled() and onednn_available()):
        return 0
    min_elements = MIN_WEIGHT_ELEMENTS if min_elements is None else min_elements
    dtypes = onednn_dtypes()
    min_small = min(SMALL_WEIGHT_ELEMENTS, min_elements) if small_enabled() else min_elements
    small, looked = None, False  # NOTE: the kernels are built only when a CPU weight is routed (never on a GPU)
    n = small_n = nbytes = 0
    for module in view.modules():
        if type(module) is not torch.nn.Linear or "forward" in vars(module):
            continue
        w = module.weight
        onednn = w.numel() >= min_elements
        if w.device.type != "cpu" or w.dtype not in dtypes or w.numel() < min_small \
                or (not onednn and w.dtype is not torch.float32):
            continue
        if not looked:
            small, looked = (cpu_kernels.small_linear() if small_enabled() else None), True
        if not onednn and small is None:
            continue
        module.forward = types.MethodType(_onednn_forward, module)
        module._rollout_packed = module._rollout_panels = None
        # NOTE: a module cast later (`.bfloat16()`) repacks only where it can; a small-only one keeps torch's linear
        module._rollout_dtypes = dtypes if onednn else (torch.float32,)
        module._rollout_small = small if w.dtype is torch.float32 else None
        module._rollout_onednn = onednn  # NOTE: False: the small-M kernel up to SMALL_ROWS rows, torch's linear above
        module._rollout_always = not onednn or w.numel() >= min(ALWAYS_WEIGHT_ELEMENTS, max(min_elements, 1))
        module._rollout_n, module._rollout_k = w.shape
        if onednn:
            n += 1
            nbytes += w.numel() * w.element_size()
        else:
            small_n += 1
    if n:
        logger.info("rollout: %d linear layers run through oneDNN on packed weight copies (%.1f MiB more, held "
                    "while the engine lives; ROLLOUT_ONEDNN_LINEARS=0 turns this off)%s", n, nbytes / 2**20,
                    "; fp32 decode rows through rollout's small-M kernel on a second copy, built at the first "
                    "decode step (ROLLOUT_SMALL_LINEARS=0 turns it off)" if small is not None else "")
    if small_n:
        logger.info("rollout: %d smaller fp32 linear layers run decode rows through rollout's small-M kernel (torch's "
                    "linear above %d rows; ROLLOUT_SMALL_LINEARS=0 turns this off)", small_n, SMALL_ROWS)
    return n + small_n


def small_only(module: torch.nn.Module) -> bool:
    """Whether `module` is a smaller fp32 linear routed to the small-M kernel only (no oneDNN copy; see
    `SMALL_WEIGHT_ELEMENTS`)."""
    return "_rollout_onednn" in vars(module) and not module._rollout_onednn


def small_rows(view: torch.nn.Module) -> int | None:
    """The most rows a step runs with the view's fp32 linears on the small-M kernel (`SMALL_ROWS`), or None when
    none is routed there. Past it they take torch's linear, and the fused decoder layers their Python path
    (`rollout.kernels.fused_decoder`): a step of a few more rows costs far more (speculation keeps under it)."""
    return SMALL_ROWS if any(getattr(m, "_rollout_small", None) is not None for m in view.modules()) else None


def onednn_routed(view: torch.nn.Module) -> int:
    """How many of the view's linears run through oneDNN on packed copies (`use_onednn_linears`; not the smaller
    ones routed to the small-M kernel only)."""
    return sum(bool(getattr(m, "_rollout_onednn", False)) for m in view.modules())
