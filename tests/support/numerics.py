"""Hand-value helpers of the loss tests: float64 tensors from literals, and a closeness check against them."""

from __future__ import annotations

import torch

F64 = torch.float64


def t(values, dtype=F64, **kwargs) -> torch.Tensor:
    return torch.tensor(values, dtype=dtype, **kwargs)


def close(actual, expected, atol: float) -> None:
    torch.testing.assert_close(torch.as_tensor(actual, dtype=F64), t(expected), atol=atol, rtol=0)
