"""Cascade decode attention in Triton: a group's shared prompt pages read once for all its rows.

The decode rows of a GRPO group forked from one prompt (or of prefix-cache hits on the same pages) name the same
physical pages for their prompt; `groups` (host tuples as `rollout.kernels.cpu_kernels.cascade_plan` returns them:
first shared page, shared full pages, member rows, ...) says which. A first launch, one program per (group, KV
head), attends every member's query heads (one tile: members x the GQA group's heads) to the shared pages and keeps
each row's partial softmax state (running max, sum, weighted values, fp32); a second, one program per (row, KV
head), starts from that state (from nothing for rows in no group) and goes on over the row's own positions
(before and after the shared span), then adds the sink (gpt-oss) and normalises: the log-sum-exp merge of the C++
kernel's cascade, with the same numbers as `rollout.kernels.triton_decode` up to float rounding.

Written without a GPU: exact under `TRITON_INTERPRET=1` against the C++ cascade kernel and fp64
(`tests/kernels/test_triton_cascade.py`); the `triton` backend's decode rows run through it where its host plan
(`rollout.attention.backends.triton.plan_cascades`, over the host page tables: the general step path, not a CUDA
graph's fixed shapes) finds groups (`tests/attention/test_triton_backend.py`). Not yet run on a GPU.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError as e:  # pragma: no cover - exercised where triton is not installed
    raise ImportError("rollout's Triton kernels need the `triton` package: pip install 'rollout[triton]'") from e

from rollout.kernels.triton_decode import built_for_interpreter, runs_on

__all__ = ["available", "cascade_decode_attention"]

BLOCK_N = 32


@triton.jit
def _attend_span(q, m, l_sum, acc, k_base, v_base, Table, row, lo, hi, stride_tr, stride_ks, stride_vs, page_size,
                 scale, softcap, offs_n, offs_d, mask_d, HAS_SOFTCAP: tl.constexpr, BLOCK_N: tl.constexpr):
    """Online softmax of the tile `q` [R, D] over key positions [lo, hi) of table row `row`."""
    for start in range(lo, hi, BLOCK_N):
        pos = start + offs_n
        valid = pos < hi
        page = tl.load(Table + row * stride_tr + pos // page_size, mask=valid, other=0).to(tl.int64)
        slot = page * page_size + pos % page_size
        kv_mask = valid[:, None] & mask_d[None, :]
        k = tl.load(k_base + slot[:, None] * stride_ks + offs_d[None, :], mask=kv_mask, other=0.0).to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale
        if HAS_SOFTCAP:
            s = softcap * (1.0 - 2.0 / (tl.exp(2.0 * s / softcap) + 1.0))
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m - m_safe)
        p = tl.exp(s - m_safe[:, None])
        v = tl.load(v_base + slot[:, None] * stride_vs + offs_d[None, :], mask=kv_mask, other=0.0).to(tl.float32)
        l_sum = l_sum * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
        m = m_new
    return m, l_sum, acc


@triton.jit
def _shared_kernel(Q, K, V, Table, Row, Members, First, Pages, PM, PL, PACC,
                   stride_qn, stride_qh, stride_kh, stride_ks, stride_vh, stride_vs, stride_tr, num_heads,
                   scale, softcap, page_size, max_members,
                   GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_H: tl.constexpr,
                   BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, HAS_SOFTCAP: tl.constexpr):
    c = tl.program_id(0)  # NOTE: the cascade group
    kvh = tl.program_id(1)
    offs_r = tl.arange(0, BLOCK_M * BLOCK_H)
    mi = offs_r // BLOCK_H
    hh = offs_r % BLOCK_H
    qi = tl.load(Members + c * max_members + mi, mask=mi < max_members, other=-1)  # [R] member rows (-1: none)
    valid_r = (qi >= 0) & (hh < GROUP)
    qi = tl.where(valid_r, qi, 0).to(tl.int64)
    heads = kvh * GROUP + hh
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    mask_d = offs_d < HEAD_DIM
    q = tl.load(Q + qi[:, None] * stride_qn + heads[:, None] * stride_qh + offs_d[None, :],
                mask=valid_r[:, None] & mask_d[None, :], other=0.0).to(tl.float32)
    row = tl.load(Row + tl.load(Members + c * max_members)).to(tl.int64)  # NOTE: every member names these pages
    lo = tl.load(First + c).to(tl.int32) * page_size
    hi = lo + tl.load(Pages + c).to(tl.int32) * page_size
    m = tl.full([BLOCK_M * BLOCK_H], float("-inf"), tl.float32)
    l_sum = tl.zeros([BLOCK_M * BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_M * BLOCK_H, BLOCK_D], tl.float32)
    m, l_sum, acc = _attend_span(q, m, l_sum, acc, K + kvh.to(tl.int64) * stride_kh, V + kvh.to(tl.int64) * stride_vh,
                                 Table, row, lo, hi, stride_tr, stride_ks, stride_vs, page_size, scale, softcap,
                                 offs_n, offs_d, mask_d, HAS_SOFTCAP, BLOCK_N)
    state = qi * num_heads + heads  # [R]
    tl.store(PM + state, m, mask=valid_r)
    tl.store(PL + state, l_sum, mask=valid_r)
    tl.store(PACC + state[:, None] * BLOCK_D + offs_d[None, :], acc, mask=valid_r[:, None] & mask_d[None, :])


@triton.jit
def _private_kernel(Q, K, V, Table, Row, Start, End, S0, S1, InGroup, PM, PL, PACC, Sinks, Out,
                    stride_qn, stride_qh, stride_kh, stride_ks, stride_vh, stride_vs, stride_tr, stride_on, stride_oh,
                    num_heads, scale, softcap, page_size,
                    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
                    BLOCK_N: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_SINKS: tl.constexpr):
    n = tl.program_id(0)
    kvh = tl.program_id(1)
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    mask_h = offs_h < GROUP
    mask_d = offs_d < HEAD_DIM
    heads = kvh * GROUP + offs_h
    q = tl.load(Q + n.to(tl.int64) * stride_qn + heads[:, None] * stride_qh + offs_d[None, :],
                mask=mask_h[:, None] & mask_d[None, :], other=0.0).to(tl.float32)
    row = tl.load(Row + n).to(tl.int64)
    start = tl.load(Start + n).to(tl.int32)
    end = tl.load(End + n).to(tl.int32)
    s0 = tl.load(S0 + n).to(tl.int32)  # NOTE: the shared span [s0, s1) (s0 = s1 = end for a row in no group)
    s1 = tl.load(S1 + n).to(tl.int32)
    in_group = mask_h & ((offs_h * 0 + tl.load(InGroup + n).to(tl.int32)) > 0)  # [BLOCK_H]
    state = n.to(tl.int64) * num_heads + heads
    m = tl.load(PM + state, mask=in_group, other=float("-inf"))
    l_sum = tl.load(PL + state, mask=in_group, other=0.0)
    acc = tl.load(PACC + state[:, None] * BLOCK_D + offs_d[None, :], mask=in_group[:, None] & mask_d[None, :],
                  other=0.0)
    k_base = K + kvh.to(tl.int64) * stride_kh
    v_base = V + kvh.to(tl.int64) * stride_vh
    m, l_sum, acc = _attend_span(q, m, l_sum, acc, k_base, v_base, Table, row, start, s0, stride_tr, stride_ks,
                                 stride_vs, page_size, scale, softcap, offs_n, offs_d, mask_d, HAS_SOFTCAP, BLOCK_N)
    m, l_sum, acc = _attend_span(q, m, l_sum, acc, k_base, v_base, Table, row, s1, end, stride_tr, stride_ks,
                                 stride_vs, page_size, scale, softcap, offs_n, offs_d, mask_d, HAS_SOFTCAP, BLOCK_N)
    if HAS_SINKS:  # NOTE: one more logit per head, with no value
        sink = tl.load(Sinks + heads, mask=mask_h, other=0.0).to(tl.float32)
        m_new = tl.maximum(m, sink)
        alpha = tl.exp(m - m_new)
        l_sum = l_sum * alpha + tl.exp(sink - m_new)
        acc = acc * alpha[:, None]
    out = acc / tl.where(l_sum == 0.0, 1.0, l_sum)[:, None]
    tl.store(Out + n.to(tl.int64) * stride_on + heads[:, None] * stride_oh + offs_d[None, :],
             out.to(Out.dtype.element_ty), mask=mask_h[:, None] & mask_d[None, :])


def interpreted() -> bool:
    return built_for_interpreter(_private_kernel)


def available(device: torch.device) -> bool:
    return runs_on(device, _private_kernel)


def cascade_decode_attention(q, k_cache, v_cache, table, row, start, end, page_size: int, scale: float,
                             softcap: float, out, groups, sinks=None, ends: list[int] | None = None):
    """`rollout.kernels.triton_decode.paged_decode_attention`'s arguments and result, with `groups` (host tuples:
    first shared page, shared full pages, member rows, ...: `cpu_kernels.cascade_plan`'s) read once per group.
    `ends`: `end` as host ints (else read from `end`: a device read on CUDA)."""
    n, heads, dim = q.shape
    hkv = k_cache.shape[0]
    if heads % hkv or v_cache.shape != k_cache.shape or out.shape != q.shape:
        raise ValueError(f"cascade_decode_attention: q {tuple(q.shape)}, caches {tuple(k_cache.shape)} / "
                         f"{tuple(v_cache.shape)}, out {tuple(out.shape)} do not fit")
    if n == 0:
        return out
    dev, group = q.device, heads // hkv
    block_d = max(16, triton.next_power_of_2(dim))
    block_h = max(16, triton.next_power_of_2(group))
    s0 = list(ends) if ends is not None else end.to("cpu", torch.int64).tolist()  # NOTE: the plan is the host's
    s1, member = list(s0), [0] * n
    max_m = max((len(g[2]) for g in groups), default=1)
    members = torch.full((max(len(groups), 1), max_m), -1, dtype=torch.int64)
    for c, g in enumerate(groups):
        first, pages, rows = int(g[0]), int(g[1]), [int(r) for r in g[2]]
        members[c, : len(rows)] = torch.tensor(rows)
        for r in rows:
            s0[r], s1[r], member[r] = first * page_size, (first + pages) * page_size, 1
    to = (lambda t: t.pin_memory().to(dev, non_blocking=True)) if dev.type == "cuda" else (lambda t: t.to(dev))
    pm = torch.empty(n, heads, dtype=torch.float32, device=dev)
    pl = torch.empty(n, heads, dtype=torch.float32, device=dev)
    pacc = torch.empty(n, heads, block_d, dtype=torch.float32, device=dev)
    cap = float(softcap or 1.0)
    if groups:
        first = torch.tensor([int(g[0]) for g in groups])
        pages = torch.tensor([int(g[1]) for g in groups])
        _shared_kernel[(len(groups), hkv)](
            q, k_cache, v_cache, table, row, to(members), to(first), to(pages), pm, pl, pacc,
            q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
            table.stride(0), heads, float(scale), cap, int(page_size), max_m,
            GROUP=group, HEAD_DIM=dim, BLOCK_H=triton.next_power_of_2(group),
            BLOCK_M=max(triton.next_power_of_2(max_m), 16 // min(16, triton.next_power_of_2(group))),
            BLOCK_D=block_d, BLOCK_N=BLOCK_N, HAS_SOFTCAP=bool(softcap))
    _private_kernel[(n, hkv)](
        q, k_cache, v_cache, table, row, start, end, to(torch.tensor(s0)), to(torch.tensor(s1)),
        to(torch.tensor(member)), pm, pl, pacc, q if sinks is None else sinks, out,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        table.stride(0), out.stride(0), out.stride(1), heads, float(scale), cap, int(page_size),
        GROUP=group, HEAD_DIM=dim, BLOCK_H=block_h, BLOCK_D=block_d, BLOCK_N=BLOCK_N, HAS_SOFTCAP=bool(softcap),
        HAS_SINKS=sinks is not None)
    return out
