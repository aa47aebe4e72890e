"""Tensors from the step's Python lists: `int_tensor`, the one conversion every layer's per-step index lists use."""

from __future__ import annotations

from array import array

import torch

_TYPECODES = {torch.int64: "q", torch.int32: "i"}


def int_tensor(values: list[int], device: torch.device, dtype: torch.dtype = torch.int64) -> torch.Tensor:
    """`torch.tensor(values, dtype=dtype, device=device)` for a list of Python ints, through one packed
    buffer (~7x faster than torch's per-element conversion at 512 values: the step's index lists)."""
    if not values:
        return torch.empty(0, dtype=dtype, device=device)
    t = torch.frombuffer(array(_TYPECODES[dtype], values), dtype=dtype)  # NOTE: keeps the array alive
    if device.type == "cpu":
        return t
    if device.type == "cuda":
        # NOTE: from pinned memory the upload is asynchronous (a pageable one synchronises the host
        # with the device every call); torch's caching host allocator keeps the pinned block until
        # the copy has run
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)
