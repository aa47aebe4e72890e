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
