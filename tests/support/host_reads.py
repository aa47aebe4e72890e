"""`HostReads`: a context that records every read of a tensor's values by the host.

On CUDA each such read is a device-to-host synchronisation (the step waits for the device); on a CPU it is
the same code path, so a CPU test can prove a step has none. Recorded: the ops that produce a host scalar
(`aten._local_scalar_dense`, behind `.item()`, `int(t)`, `float(t)`, `bool(t)` and so every Python branch on a
tensor's value), data-dependent shapes (`nonzero`, `masked_select`, `unique`...), and the `Tensor` methods that
read values (`tolist`, `numpy`, `item`, `nonzero`, `__bool__`, `__int__`, `__float__`, `__index__`: patched for
the length of the context, since under inference mode the dispatch mode does not see them). Each entry names the read
and the innermost rollout frame that made it, so a failure says where.
"""

from __future__ import annotations

import os
import traceback

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import rollout

# NOTE: patched too: under `torch.inference_mode` (the engine's step) ops on inference tensors skip the Python
# dispatch mode, so `.item()` or a branch on a tensor there would go unseen by `__torch_dispatch__` alone
METHODS = ("tolist", "numpy", "item", "nonzero", "__bool__", "__int__", "__float__", "__index__")
READ_OPS = {"aten._local_scalar_dense.default", "aten.nonzero.default", "aten.masked_select.default",
            "aten._unique2.default", "aten.unique_dim.default", "aten.unique_consecutive.default",
            "aten.repeat_interleave.Tensor"}


PACKAGE = os.path.dirname(os.path.abspath(rollout.__file__)) + os.sep


def where(filenames_and_lines: list[tuple[str, int]], package: str = PACKAGE) -> str:
    """"file:line" of the innermost frame inside the `rollout` package, relative to it ("?" if none).

    Matched by the package's own directory, not by a "/rollout/" substring: a clone in a folder named `rollout`
    puts that substring in every path (tests, the venv), and the package itself sits at `.../rollout/rollout/`."""
    inside = [(name, line) for name, line in filenames_and_lines if os.path.abspath(name).startswith(package)]
    return f"{os.path.abspath(inside[-1][0])[len(package):]}:{inside[-1][1]}" if inside else "?"


def _where() -> str:
    return where([(f.filename, f.lineno) for f in traceback.extract_stack()[:-2]])


class HostReads(TorchDispatchMode):
    """`with HostReads() as reads: ...` then `reads.found` lists ("op or method", "file:line") pairs.

    `host`: tensors that live on the host on every device (e.g. the compiled forward's 0-d step handle), whose
    reads are no device read."""

    def __init__(self, host: tuple[torch.Tensor, ...] = ()) -> None:
        super().__init__()
        self.found: list[tuple[str, str]] = []
        self._saved: dict[str, object] = {}
        self._host = host

    def _is_host(self, t) -> bool:
        return any(t is h for h in self._host)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func)
        if name in READ_OPS and not (name == "aten.repeat_interleave.Tensor" and (kwargs or {}).get("output_size")) \
                and not (args and self._is_host(args[0])):
            self.found.append((name, _where()))
        return func(*args, **(kwargs or {}))

    def __enter__(self):
        for method in METHODS:
            original = getattr(torch.Tensor, method)
            self._saved[method] = torch.Tensor.__dict__.get(method)  # NOTE: None: inherited from TensorBase

            def record(t, *a, _method=method, _original=original, **k):
                if not self._is_host(t):
                    self.found.append((f"Tensor.{_method}", _where()))
                return _original(t, *a, **k)

            setattr(torch.Tensor, method, record)
        return super().__enter__()

    def __exit__(self, *exc):
        for method, original in self._saved.items():
            if original is None:
                delattr(torch.Tensor, method)
            else:
                setattr(torch.Tensor, method, original)
        self._saved.clear()
        return super().__exit__(*exc)
