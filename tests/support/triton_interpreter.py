"""`rollout.kernels.triton_decode` for a test: compiled on a CUDA machine, under Triton's interpreter on a CPU.

Triton decides at decoration time whether a kernel is interpreted (`TRITON_INTERPRET=1` when the kernel's module
is imported) and reads the variable again while an interpreted kernel runs, so `load()` sets it for the rest of
the session, only on a machine without CUDA (there no other Triton kernel runs: inductor's CPU code is C++; on a
GPU machine the same tests run the compiled kernel on the device). Skips the test, with the reason, without
triton or numpy (the interpreter runs kernels in numpy).
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys

import pytest
import torch

MODULE = "rollout.kernels.triton_decode"


def device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def load(module_name: str = MODULE):
    """The kernel module (default the paged decode kernel's), ready to run on `device()`; skips (with why) when it
    cannot."""
    # NOTE: find_spec, not an import: triton must first be imported with the variable set
    if importlib.util.find_spec("triton") is None:
        pytest.skip("the triton extra is not installed (pip install 'rollout[triton]')")
    if not torch.cuda.is_available():
        if importlib.util.find_spec("numpy") is None:
            pytest.skip("Triton's interpreter needs numpy")
        if "triton" not in sys.modules:
            os.environ["TRITON_INTERPRET"] = "1"
    module = importlib.import_module(module_name)
    if not module.available(device()):
        pytest.skip("triton was imported before TRITON_INTERPRET=1 could be set, and this machine has no GPU")
    return module


def ordered_dots():
    """Under Triton's interpreter, `tl.dot` as each output element's own chain of multiply-adds over K in order, until
    the returned callable is called (a no-op on a CUDA machine, where the compiled kernels run).

    The interpreter runs `tl.dot` as numpy's `matmul`, whose BLAS decides a row's summation order by where the row
    falls in its micro-kernel's blocks: on an AMD EPYC of family 26 (OpenBLAS's Haswell kernels) a row's bits changed
    with its place in the tile, so a batch-invariance test failed on the interpreter, not on the kernel (whose tile
    shapes and K order do not depend on the batch); on family 25 (AVX-512 kernels) they did not. A compiled kernel's
    dot sums K in its own fixed order, as this does."""
    if torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") != "1":
        return lambda: None
    import numpy as np  # noqa: PLC0415 - only under the interpreter
    from triton.runtime import interpreter  # noqa: PLC0415

    builder = interpreter.InterpreterBuilder
    original = builder.create_dot

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        if a.dtype.primitive_bitwidth == 8 or b.dtype.primitive_bitwidth == 8:
            return original(self, a, b, d, input_precision, max_num_imprecise_acc)
        dt = d.data.dtype
        x, y = a.data.astype(dt), b.data.astype(dt)
        acc = np.zeros(np.broadcast_shapes(x.shape[:-1] + (1,), y.shape[:-2] + (1, y.shape[-1])), dtype=dt)
        for k in range(x.shape[-1]):
            acc += x[..., :, k : k + 1] * y[..., k : k + 1, :]
        return interpreter.TensorHandle(acc + d.data, d.dtype.scalar)

    builder.create_dot = create_dot

    def undo() -> None:
        builder.create_dot = original

    return undo
