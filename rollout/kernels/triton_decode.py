"""Paged decode attention in Triton: one query token per row, read in place over the paged cache.

The GPU counterpart of the C++ kernel's `paged_decode_attention` (`rollout.kernels.cpu_kernels`), with the same
arguments and result: each row's query heads attend the keys at positions [start, end) of its request, whose
slots come from the page table (`table[row, pos // page_size] * page_size + pos % page_size`), read straight from
the head-major cache `[Hkv, slots, D]` (no gather). One program per (row, KV head) serves that head's GQA group
of query heads; positions run in tiles of `BLOCK_N` with an online (flash-decoding) softmax in fp32, fp16 and
bf16 caches widened on load. Sliding windows are the caller's `start`; Gemma 2's logit softcap and gpt-oss's
attention sinks (a per-head logit in the softmax's denominator only) are compile-time variants. Every input is
a tensor read on the device and every size a launch constant, so the kernel serves CUDA graphs as it is.

Optional: needs `triton` (`pip install rollout[triton]`). On a CPU it runs under Triton's interpreter only
(`TRITON_INTERPRET=1` set before triton is imported; slow, for exactness tests); `available()` says whether it
can run on a device. The kernel is built when this module is imported: import it after setting the variable.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError as e:  # pragma: no cover - exercised where triton is not installed
    raise ImportError("rollout's Triton kernels need the `triton` package: pip install 'rollout[triton]'") from e

__all__ = ["BLOCK_N", "available", "built_for_interpreter", "interpreted", "paged_decode_attention", "runs_on"]

BLOCK_N = 32  # NOTE: key positions per tile; tl.dot needs >= 16 on a GPU


@triton.jit
def _paged_decode_kernel(
    Q, K, V, Table, Row, Start, End, Sinks, Out,
    stride_qn, stride_qh, stride_kh, stride_ks, stride_vh, stride_vs, stride_tr, stride_on, stride_oh,
    scale, softcap, page_size,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_SINKS: tl.constexpr,
):
    n = tl.program_id(0)  # NOTE: the query row
    kvh = tl.program_id(1)  # NOTE: its KV head; the group's query heads are kvh * GROUP + [0, GROUP)
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    mask_h = offs_h < GROUP
    mask_d = offs_d < HEAD_DIM
    heads = kvh * GROUP + offs_h
    q = tl.load(Q + n.to(tl.int64) * stride_qn + heads[:, None] * stride_qh + offs_d[None, :],
                mask=mask_h[:, None] & mask_d[None, :], other=0.0).to(tl.float32)  # [BLOCK_H, BLOCK_D]
    row = tl.load(Row + n).to(tl.int64)
    start = tl.load(Start + n).to(tl.int32)
    end = tl.load(End + n).to(tl.int32)
    if HAS_SINKS:  # NOTE: the sink is one more logit per head, with no value: it starts the running max and sum
        m = tl.load(Sinks + heads, mask=mask_h, other=0.0).to(tl.float32)  # [BLOCK_H]
        l_sum = tl.full([BLOCK_H], 1.0, tl.float32)
    else:
        m = tl.full([BLOCK_H], float("-inf"), tl.float32)
        l_sum = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    k_base = K + kvh.to(tl.int64) * stride_kh
    v_base = V + kvh.to(tl.int64) * stride_vh
    for lo in range(start, end, BLOCK_N):
        pos = lo + offs_n  # [BLOCK_N]
        valid = pos < end
        page = tl.load(Table + row * stride_tr + pos // page_size, mask=valid, other=0).to(tl.int64)
        slot = page * page_size + pos % page_size  # [BLOCK_N] cache slots, read in place
        kv_mask = valid[:, None] & mask_d[None, :]
        k = tl.load(k_base + slot[:, None] * stride_ks + offs_d[None, :], mask=kv_mask, other=0.0).to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale  # [BLOCK_H, BLOCK_N]
        if HAS_SOFTCAP:  # NOTE: tanh(x) = 1 - 2 / (exp(2x) + 1), exact at both tails in fp32
            s = softcap * (1.0 - 2.0 / (tl.exp(2.0 * s / softcap) + 1.0))
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        alpha = tl.exp(m - m_new)
        p = tl.exp(s - m_new[:, None])
        v = tl.load(v_base + slot[:, None] * stride_vs + offs_d[None, :], mask=kv_mask, other=0.0).to(tl.float32)
        l_sum = l_sum * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
        m = m_new
    out = acc / l_sum[:, None]
    tl.store(Out + n.to(tl.int64) * stride_on + heads[:, None] * stride_oh + offs_d[None, :],
             out.to(Out.dtype.element_ty), mask=mask_h[:, None] & mask_d[None, :])


def built_for_interpreter(kernel) -> bool:
    """`kernel` (a `triton.jit` function) was built for Triton's interpreter (`TRITON_INTERPRET=1` when its module
    was imported)."""
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(kernel, InterpretedFunction)


def runs_on(device: torch.device, kernel) -> bool:
    """`kernel` runs on `device`: CUDA, or a CPU when it was built for the interpreter."""
    return device.type == "cuda" or (device.type == "cpu" and built_for_interpreter(kernel))


def interpreted() -> bool:
    """The kernel was built for Triton's interpreter (`TRITON_INTERPRET=1` when this module was imported)."""
    return built_for_interpreter(_paged_decode_kernel)


def available(device: torch.device) -> bool:
    """The kernel runs on `device`: CUDA, or a CPU under the interpreter."""
    return runs_on(device, _paged_decode_kernel)


def paged_decode_attention(
    q: torch.Tensor,  # [n, H, D] one query per row (any float dtype)
    k_cache: torch.Tensor,  # [Hkv, slots, D] fp32 / bf16 / fp16
    v_cache: torch.Tensor,  # [Hkv, slots, D]
    table: torch.Tensor,  # [R, P] int32 or int64 page tables
    row: torch.Tensor,  # [n] table row of each query
    start: torch.Tensor,  # [n] first position read
    end: torch.Tensor,  # [n] one past the last position read (> start)
    page_size: int,
    scale: float,
    softcap: float,  # 0: none
    out: torch.Tensor,  # [n, H, D] written
    sinks: torch.Tensor | None = None,  # [H] attention-sink logits (gpt-oss), or None
) -> torch.Tensor:
    """Decode attention of `q` over the paged cache into `out` (returned); shapes are checked, values are not
    read on the host (no device sync)."""
    n, heads, dim = q.shape
    hkv, _, kdim = k_cache.shape
    if kdim != dim or v_cache.shape != k_cache.shape:
        raise ValueError(f"paged_decode_attention: k_cache/v_cache must be [Hkv, slots, {dim}] alike, got "
                         f"{tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
    if heads % hkv:
        raise ValueError(f"paged_decode_attention: {heads} query heads are not a multiple of {hkv} KV heads")
    if out.shape != q.shape or row.shape != (n,) or start.shape != (n,) or end.shape != (n,) or table.dim() != 2:
        raise ValueError(f"paged_decode_attention: out must be q's shape {tuple(q.shape)}, row/start/end [{n}], "
                         f"table [R, P]; got out {tuple(out.shape)}, row {tuple(row.shape)}, start "
                         f"{tuple(start.shape)}, end {tuple(end.shape)}, table {tuple(table.shape)}")
    if sinks is not None and sinks.shape != (heads,):
        raise ValueError(f"paged_decode_attention: sinks must be [{heads}], got {tuple(sinks.shape)}")
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache), ("out", out)):
        if t.stride(-1) != 1:
            raise ValueError(f"paged_decode_attention: {name} must be contiguous in its last dimension")
    if table.stride(1) != 1:
        raise ValueError("paged_decode_attention: table must be contiguous in its last dimension")
    if n == 0:
        return out
    group = heads // hkv
    _paged_decode_kernel[(n, hkv)](
        q, k_cache, v_cache, table, row, start, end, q if sinks is None else sinks, out,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        table.stride(0), out.stride(0), out.stride(1),
        float(scale), float(softcap or 1.0), int(page_size),
        GROUP=group, HEAD_DIM=dim, BLOCK_H=max(16, triton.next_power_of_2(group)),
        BLOCK_D=max(16, triton.next_power_of_2(dim)), BLOCK_N=BLOCK_N,
        HAS_SOFTCAP=bool(softcap), HAS_SINKS=sinks is not None,
    )
    return out
