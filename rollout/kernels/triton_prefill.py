"""Varlen (prefill and chunked-prefill) attention over the paged cache in Triton.

The step's query tokens are packed `[T, H, D]`, sequence b's `lens[b]` of them from `q_start[b]` on, at positions
`pos_start[b]` onward (its tokens already computed sit before them in its pages; the chunk's own K/V are written to
the cache before attention, as `rollout.attention.interface` does). Query token t at position p attends the keys
at positions [max(0, p - window + 1), p] of its request, read in place from the head-major cache `[Hkv, slots, D]`
through its page-table row (`table[row[b], pos // page_size] * page_size + pos % page_size`): causal, with a
sliding window, Gemma 2's logit softcap and gpt-oss's attention sinks as compile-time variants, fp32 / bf16 / fp16
caches widened on load. One program per (sequence, block of `BLOCK_M` query tokens, KV head) serves the block's
tokens times the GQA group's query heads as one tile, so each K/V tile is read once for all of them; an online
softmax in fp32 over key tiles of `BLOCK_N`. A one-token sequence is a decode row: the same numbers as
`rollout.kernels.triton_decode` and the C++ kernel.

Written without a GPU: exact under `TRITON_INTERPRET=1` against an fp64 reference and the C++ decode kernel
(`tests/kernels/test_triton_prefill.py`), and the `triton` backend's prompt chunks run through it
(`tests/attention/test_triton_backend.py`); NOT yet run on a GPU. Optional: needs `triton`; import after setting
`TRITON_INTERPRET=1` on a CPU.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError as e:  # pragma: no cover - exercised where triton is not installed
    raise ImportError("rollout's Triton kernels need the `triton` package: pip install 'rollout[triton]'") from e

from rollout.kernels.triton_decode import built_for_interpreter, runs_on

__all__ = ["BLOCK_M", "BLOCK_N", "available", "paged_prefill_attention"]

BLOCK_M = 16  # NOTE: query tokens per program (times the GQA group: the tile's rows)
BLOCK_N = 32  # NOTE: key positions per tile


@triton.jit
def _paged_prefill_kernel(
    Q, K, V, Table, Row, QStart, PosStart, Lens, Sinks, Out,
    stride_qn, stride_qh, stride_kh, stride_ks, stride_vh, stride_vs, stride_tr, stride_on, stride_oh,
    scale, softcap, page_size, window,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_SINKS: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
):
    b = tl.program_id(0)  # NOTE: the sequence
    first = tl.program_id(1) * BLOCK_M  # NOTE: its first query token in this program
    kvh = tl.program_id(2)
    qlen = tl.load(Lens + b).to(tl.int32)
    if first < qlen:
        q0 = tl.load(QStart + b).to(tl.int64)
        p0 = tl.load(PosStart + b).to(tl.int32)
        row = tl.load(Row + b).to(tl.int64)
        offs_r = tl.arange(0, BLOCK_M * BLOCK_H)
        tok = first + offs_r // BLOCK_H  # [R] query token of each tile row
        hh = offs_r % BLOCK_H  # [R] its head within the group
        offs_d = tl.arange(0, BLOCK_D)
        offs_n = tl.arange(0, BLOCK_N)
        mask_d = offs_d < HEAD_DIM
        valid_r = (tok < qlen) & (hh < GROUP)
        heads = kvh * GROUP + hh
        q = tl.load(Q + (q0 + tok)[:, None] * stride_qn + heads[:, None] * stride_qh + offs_d[None, :],
                    mask=valid_r[:, None] & mask_d[None, :], other=0.0).to(tl.float32)  # [R, BLOCK_D]
        pos = p0 + tok  # [R]
        hi = p0 + tl.minimum(first + BLOCK_M, qlen)  # NOTE: one past the block's last position
        if HAS_WINDOW:
            lo = tl.maximum(p0 + first - window + 1, 0)
        else:
            lo = p0 * 0
        if HAS_SINKS:  # NOTE: one more logit per head with no value: it starts the running max and sum
            m = tl.load(Sinks + heads, mask=valid_r, other=0.0).to(tl.float32)
            l_sum = tl.full([BLOCK_M * BLOCK_H], 1.0, tl.float32)
        else:
            m = tl.full([BLOCK_M * BLOCK_H], float("-inf"), tl.float32)
            l_sum = tl.zeros([BLOCK_M * BLOCK_H], tl.float32)
        acc = tl.zeros([BLOCK_M * BLOCK_H, BLOCK_D], tl.float32)
        k_base = K + kvh.to(tl.int64) * stride_kh
        v_base = V + kvh.to(tl.int64) * stride_vh
        for start in range(lo, hi, BLOCK_N):
            kpos = start + offs_n  # [BLOCK_N]
            kvalid = kpos < hi
            page = tl.load(Table + row * stride_tr + kpos // page_size, mask=kvalid, other=0).to(tl.int64)
            slot = page * page_size + kpos % page_size
            kv_mask = kvalid[:, None] & mask_d[None, :]
            k = tl.load(k_base + slot[:, None] * stride_ks + offs_d[None, :], mask=kv_mask, other=0.0).to(tl.float32)
            s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale  # [R, BLOCK_N]
            if HAS_SOFTCAP:  # NOTE: tanh(x) = 1 - 2 / (exp(2x) + 1), exact at both tails in fp32
                s = softcap * (1.0 - 2.0 / (tl.exp(2.0 * s / softcap) + 1.0))
            allowed = kvalid[None, :] & (kpos[None, :] <= pos[:, None])
            if HAS_WINDOW:
                allowed = allowed & (kpos[None, :] > pos[:, None] - window)
            s = tl.where(allowed, s, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # NOTE: a row with no key yet in this tile
            alpha = tl.exp(m - m_safe)
            p = tl.exp(s - m_safe[:, None])
            v = tl.load(v_base + slot[:, None] * stride_vs + offs_d[None, :], mask=kv_mask, other=0.0).to(tl.float32)
            l_sum = l_sum * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
            m = m_new
        out = acc / tl.where(l_sum == 0.0, 1.0, l_sum)[:, None]  # NOTE: 0 only on padding rows (not stored)
        tl.store(Out + (q0 + tok)[:, None] * stride_on + heads[:, None] * stride_oh + offs_d[None, :],
                 out.to(Out.dtype.element_ty), mask=valid_r[:, None] & mask_d[None, :])


def interpreted() -> bool:
    return built_for_interpreter(_paged_prefill_kernel)


def available(device: torch.device) -> bool:
    """The kernel runs on `device`: CUDA, or a CPU under the interpreter."""
    return runs_on(device, _paged_prefill_kernel)


def paged_prefill_attention(
    q: torch.Tensor,  # [T, H, D] the step's query tokens, packed by sequence
    k_cache: torch.Tensor,  # [Hkv, slots, D] fp32 / bf16 / fp16 (the chunk's own K/V already written)
    v_cache: torch.Tensor,  # [Hkv, slots, D]
    table: torch.Tensor,  # [R, P] int32 or int64 page tables
    row: torch.Tensor,  # [B] table row of each sequence
    q_start: torch.Tensor,  # [B] its first query token in `q`
    pos_start: torch.Tensor,  # [B] the position of that token
    lens: list[int],  # [B] its query tokens (host ints: they size the grid)
    page_size: int,
    scale: float,
    softcap: float,  # 0: none
    window: int | None,  # sliding window (None: full causal attention)
    out: torch.Tensor,  # [T, H, D] written
    sinks: torch.Tensor | None = None,  # [H] attention-sink logits (gpt-oss), or None
) -> torch.Tensor:
    """Causal paged attention of every packed query token into `out` (returned); shapes are checked, values are
    not read on the host (no device sync)."""
    n, heads, dim = q.shape
    hkv, _, kdim = k_cache.shape
    b = len(lens)
    if kdim != dim or v_cache.shape != k_cache.shape:
        raise ValueError(f"paged_prefill_attention: k_cache/v_cache must be [Hkv, slots, {dim}] alike, got "
                         f"{tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
    if heads % hkv:
        raise ValueError(f"paged_prefill_attention: {heads} query heads are not a multiple of {hkv} KV heads")
    if out.shape != q.shape or row.shape != (b,) or q_start.shape != (b,) or pos_start.shape != (b,) \
            or table.dim() != 2:
        raise ValueError(f"paged_prefill_attention: out must be q's shape {tuple(q.shape)}, row/q_start/pos_start "
                         f"[{b}], table [R, P]; got out {tuple(out.shape)}, row {tuple(row.shape)}, q_start "
                         f"{tuple(q_start.shape)}, pos_start {tuple(pos_start.shape)}, table {tuple(table.shape)}")
    if sum(lens) > n or min(lens, default=1) < 1:
        raise ValueError(f"paged_prefill_attention: lens must be >= 1 each and sum to at most {n}, got {lens}")
    if sinks is not None and sinks.shape != (heads,):
        raise ValueError(f"paged_prefill_attention: sinks must be [{heads}], got {tuple(sinks.shape)}")
    if window is not None and window < 1:
        raise ValueError(f"paged_prefill_attention: window must be >= 1 or None, got {window}")
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache), ("out", out), ("table", table)):
        if t.stride(-1) != 1:
            raise ValueError(f"paged_prefill_attention: {name} must be contiguous in its last dimension")
    if b == 0:
        return out
    group = heads // hkv
    lens_t = torch.tensor(lens, dtype=torch.int32)
    lens_t = lens_t.pin_memory().to(q.device, non_blocking=True) if q.is_cuda else lens_t.to(q.device)
    grid = (b, triton.cdiv(max(lens), BLOCK_M), hkv)
    _paged_prefill_kernel[grid](
        q, k_cache, v_cache, table, row, q_start, pos_start, lens_t, q if sinks is None else sinks, out,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        table.stride(0), out.stride(0), out.stride(1),
        float(scale), float(softcap or 1.0), int(page_size), int(window or 0),
        GROUP=group, HEAD_DIM=dim, BLOCK_M=BLOCK_M, BLOCK_H=triton.next_power_of_2(group),
        BLOCK_D=max(16, triton.next_power_of_2(dim)), BLOCK_N=BLOCK_N,
        HAS_SOFTCAP=bool(softcap), HAS_SINKS=sinks is not None, HAS_WINDOW=window is not None,
    )
    return out
