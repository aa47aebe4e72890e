"""fp32 Linear layers of the engine view through oneDNN on a CPU (torch's own fp32 CPU linear is MKL's sgemm).

On a CPU torch runs an fp32 `F.linear` through MKL; bf16 already goes through oneDNN. Inside a model
forward the weights stream from memory every step, and there MKL's sgemm falls far short: on the
2-core AMD EPYC of `benchmarks/`, a 100M Qwen3-arch forward over 1 / 3 / 16 / 64 tokens took 47 / 612
/ 72 / 148 ms with MKL and 29 / 38 / 61 / 112 ms with oneDNN's `_linear_pointwise` on the same, unpacked
weights (no copy: weight updates, in place or not, are read at the next call). Small layers, whose
weights stay in cache, keep MKL: oneDNN's per-call cost (~12 us) is larger than their matmul there.

Only the engine view is touched (the user's module keeps its forward): each plain `nn.Linear` of the
view whose fp32 CPU weight has at least `MIN_WEIGHT_ELEMENTS` elements gets an instance `forward` that
calls oneDNN, and falls back to `F.linear` when an input or weight is not fp32 on a CPU. Vendors' vLLM
CPU builds route their linears to oneDNN for the same reason. The results match `F.linear` to float
rounding (not bitwise: another summation order).
"""

from __future__ import annotations

import functools
import logging
import types

import torch
import torch.nn.functional as F

logger = logging.getLogger("rollout")

# NOTE: 2**18 fp32 elements = 1 MiB: a 5M model's 256x768 MLP stays on MKL, its 4096x256 head and every
# linear of a 100M model go to oneDNN (both measured faster that way; see the module docstring).
MIN_WEIGHT_ELEMENTS = 2**18


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


def _onednn_forward(self: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    w, b = self.weight, self.bias
    if x.dtype is torch.float32 and w.dtype is torch.float32 and x.device.type == "cpu" and w.device.type == "cpu" \
            and (b is None or b.dtype is torch.float32):
        return torch.ops.mkldnn._linear_pointwise(x, w, b, "none", [], "")
    return F.linear(x, w, b)


def use_onednn_linears(view: torch.nn.Module, min_elements: int | None = None) -> int:
    """Route the view's large fp32 CPU `nn.Linear`s through oneDNN; returns how many were routed.

    Skips modules whose `forward` is already set on the instance (accelerate's hooks, other wrappers)
    and subclasses of `nn.Linear` (quantized or adapter layers keep their own forward)."""
    if not onednn_available():
        return 0
    min_elements = MIN_WEIGHT_ELEMENTS if min_elements is None else min_elements
    n = 0
    for module in view.modules():
        if type(module) is not torch.nn.Linear or "forward" in vars(module):
            continue
        w = module.weight
        if w.device.type != "cpu" or w.dtype is not torch.float32 or w.numel() < min_elements:
            continue
        module.forward = types.MethodType(_onednn_forward, module)
        n += 1
    if n:
        logger.debug("rollout: %d fp32 linear layers run through oneDNN", n)
    return n
