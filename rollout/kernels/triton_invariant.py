"""The batch-invariant mode's linears and RMSNorm in Triton: one reduction order per row, whatever the batch.

The GPU path of `rollout.invariant` (`ContinuousBatchingConfig(batch_invariant=True)` on CUDA, or with
`attn_backend='triton'` on a CPU under Triton's interpreter). cuBLAS picks its GEMM (and split-K) by the row
count, and torch's CUDA reductions split a row over more threads or blocks when there are few rows, so a token's
bits there depend on how many others share its step. These kernels do not:

- `linear(x, weight, bias)`: `x @ weight.T + bias` over fixed `[BLOCK_M, BLOCK_K] x [BLOCK_K, BLOCK_N]` tiles (64s),
  one program per output tile, K walked in `BLOCK_K` steps in order into one fp32 accumulator (no split-K, no
  autotuning: one configuration for every shape), bias added in fp32, one rounding to the output dtype. A row's
  result depends only on its own input and the weights. fp32 runs `tl.dot` in IEEE fp32 (no TF32), bf16 on its
  native dot with fp32 accumulation (under the interpreter, whose numpy dot has no bf16, widened to fp32 first).
  The tile sizes are a guess not yet timed on a GPU (the device check's `invariant_overhead` measures them).
- `rms_norm(x, weight, eps, offset)`: one program per row, the whole row in one block, its sum of squares one
  `tl.sum` over a fixed block: Llama's `weight * (x * rsqrt(mean(x^2) + eps)).to(dtype)`, or with `offset`
  Gemma's `(x * rsqrt(...)) * (1 + weight)` in fp32, then the dtype.

The mode's attention on this path is `rollout.kernels.triton_decode` (one program per token and KV head, keys in
fixed tiles from the token's first position: already one order per token), for prompt rows too. Tested under
`TRITON_INTERPRET=1` (`tests/invariant/test_triton_invariant.py`); not yet run on a GPU. Optional: needs `triton`.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError as e:  # pragma: no cover - exercised where triton is not installed
    raise ImportError("rollout's Triton kernels need the `triton` package: pip install 'rollout[triton]'") from e

from rollout.kernels.triton_decode import built_for_interpreter, runs_on

__all__ = ["BLOCK_K", "BLOCK_M", "BLOCK_N", "available", "linear", "rms_norm"]

BLOCK_M = 64  # NOTE: rows per output tile (a decode step of <= 64 rows reads each weight tile once)
BLOCK_N = 64  # NOTE: columns per output tile
BLOCK_K = 64  # NOTE: the reduction's step: every element sums K in these chunks, in order


@triton.jit
def _linear_kernel(X, W, B, Y, M, N, K, stride_xm, stride_wn, stride_ym,
                   HAS_BIAS: tl.constexpr, IEEE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_K: tl.constexpr):
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    mask_m = rm < M
    mask_n = rn < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + rk
        mask_k = kk < K
        a = tl.load(X + rm.to(tl.int64)[:, None] * stride_xm + kk[None, :], mask=mask_m[:, None] & mask_k[None, :],
                    other=0.0)
        b = tl.load(W + rn.to(tl.int64)[None, :] * stride_wn + kk[:, None], mask=mask_n[None, :] & mask_k[:, None],
                    other=0.0)  # [BLOCK_K, BLOCK_N]: the weight's [N, K] rows read as columns
        if IEEE:  # NOTE: fp32, and half precision under the interpreter (its numpy dot has no bf16); exact products
            acc += tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
        else:
            acc += tl.dot(a, b)
    if HAS_BIAS:
        acc += tl.load(B + rn, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    tl.store(Y + rm.to(tl.int64)[:, None] * stride_ym + rn[None, :], acc.to(Y.dtype.element_ty),
             mask=mask_m[:, None] & mask_n[None, :])


@triton.jit
def _rms_norm_kernel(X, W, Y, N, stride_x, stride_y, eps, OFFSET: tl.constexpr, BLOCK: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < N
    x = tl.load(X + r * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    var = tl.sum(x * x, 0) / N
    y = x * (1.0 / tl.sqrt(var + eps))
    w = tl.load(W + offs, mask=mask, other=0.0).to(tl.float32)
    if OFFSET:  # NOTE: Gemma: the scale (1 + weight) applied in fp32
        out = y * (1.0 + w)
    else:  # NOTE: Llama: the normed row rounded to the input's dtype, then times the weight
        out = y.to(Y.dtype.element_ty).to(tl.float32) * w
    tl.store(Y + r * stride_y + offs, out.to(Y.dtype.element_ty), mask=mask)


def interpreted() -> bool:
    return built_for_interpreter(_linear_kernel)


def available(device: torch.device) -> bool:
    """The kernels run on `device`: CUDA, or a CPU under the interpreter."""
    return runs_on(device, _linear_kernel)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear(x, weight, bias)` with each row's bits independent of the other rows (see the docstring)."""
    k, n = x.shape[-1], weight.shape[0]
    if weight.shape[1] != k or x.dtype != weight.dtype:
        raise ValueError(f"triton_invariant.linear: x {tuple(x.shape)} {x.dtype} does not fit weight "
                         f"{tuple(weight.shape)} {weight.dtype}")
    rows = x.reshape(-1, k)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    w = weight if weight.stride(-1) == 1 else weight.contiguous()
    m = rows.shape[0]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m:
        grid = (triton.cdiv(m, BLOCK_M), triton.cdiv(n, BLOCK_N))
        _linear_kernel[grid](rows, w, rows if bias is None else bias, out, m, n, k, rows.stride(0), w.stride(0),
                             out.stride(0), HAS_BIAS=bias is not None,
                             IEEE=x.dtype == torch.float32 or interpreted(),
                             BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K)
    return out.view(*x.shape[:-1], n)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: bool = False) -> torch.Tensor:
    """RMSNorm over the last dimension, one program per row (see the docstring)."""
    n = x.shape[-1]
    rows = x.reshape(-1, n)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = torch.empty(rows.shape, dtype=x.dtype, device=x.device)
    if rows.shape[0]:
        _rms_norm_kernel[(rows.shape[0],)](rows, weight.contiguous(), out, n, rows.stride(0), out.stride(0),
                                           float(eps), OFFSET=offset, BLOCK=triton.next_power_of_2(n))
    return out.view(x.shape)
