"""Routed experts on the wire, as `vllm serve --enable-return-routed-experts` sends them: one choice's routes as a
base64 string of `.npy` bytes (`numpy.save`), decoded by `np.load(io.BytesIO(base64.b64decode(s)))`.

The array is `[num_tokens - 1, L, k]`: the experts each of the L MoE layers chose at every token of prompt +
completion but the last sampled one (which never ran through the model). Compact: `uint8` when every expert id is
under 256, else `uint16`, as vLLM; `int16` only where a position holds -1 (no route: a fully sliding model's
recycled positions, `docs/moe.md`). Qwen3-30B-A3B (48 layers x 8 experts): 384 bytes a token before base64.
"""

from __future__ import annotations

import base64
import io

import torch


def encode_routes(routes: torch.Tensor) -> str:
    """`routes [S, L, k]` (integers) as base64 `.npy` bytes of the smallest dtype that holds them."""
    import numpy as np

    arr = routes.detach().to("cpu", torch.int32).numpy()
    low, high = (int(arr.min()), int(arr.max())) if arr.size else (0, 0)
    dtype = np.int16 if low < 0 else np.uint8 if high < 256 else np.uint16
    buf = io.BytesIO()
    np.save(buf, arr.astype(dtype), allow_pickle=False)
    return base64.b64encode(buf.getvalue()).decode("ascii")


def decode_routes(text: str, param: str = "routed_experts") -> torch.Tensor:
    """The `[S, L, k]` int16 tensor of `encode_routes` (or of vLLM's field); ValueError naming `param` if it is
    not base64 `.npy` bytes of a 3-d integer array."""
    import numpy as np

    try:
        arr = np.load(io.BytesIO(base64.b64decode(text, validate=True)), allow_pickle=False)
    except Exception as e:
        raise ValueError(f"{param} is not base64-encoded .npy bytes: {type(e).__name__}: {e}") from None
    if arr.ndim != 3 or arr.dtype.kind not in "iu":
        raise ValueError(f"{param} must be a 3-d integer array [tokens, layers, k], got {arr.dtype} {arr.shape}")
    return torch.from_numpy(arr.astype(np.int16))
