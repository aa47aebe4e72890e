"""Random paged caches for the decode-attention kernels (the C++ kernels' tests and the Triton kernel's).

- `shared_case`: page tables of GRPO-like groups (forks of a few prompts, prefix-cache hits on part of a prompt,
  rows sharing nothing), scattered pages, sliding-window starts;
- `forked_case`: one group forked from a prompt whose partial last page every fork copied (`alias` rows);
- `reference`: fp64 attention of each query over its positions, softcap and sinks included.
"""

from __future__ import annotations

import random

import torch


def shared_case(ps: int, window: int | None, seed: int):
    """A block table [R, P] of `R` requests: a few prompts of several full pages each; each request forks a
    prompt, keeping all or a leading part of its pages (shared block ids), then its own pages, ending inside
    or at the end of a page; some requests share nothing. Rows read [start, end) (start > 0 with a window)."""
    rng = random.Random(seed)
    next_block = iter(range(10_000))
    prompts = [[next(next_block) for _ in range(rng.randint(1, 6))] for _ in range(4)]
    tables, ends = [], []
    for _ in range(rng.randint(10, 24)):
        if rng.random() < 0.8:
            pages = list(rng.choice(prompts))
            if rng.random() < 0.3:  # NOTE: a prefix-cache hit on only the first pages of that prompt
                pages = pages[: rng.randint(1, len(pages))]
        else:
            pages = []
        own = rng.randint(0 if pages else 1, 3)
        pages += [next(next_block) for _ in range(own)]
        fill = ps if own == 0 else rng.randint(1, ps)  # NOTE: no own page: it ends at its last shared page
        tables.append(pages)
        ends.append((len(pages) - 1) * ps + fill)
    tables.append(list(tables[0]))  # NOTE: a twin of request 0: every full page of it shared
    ends.append(ends[0])
    blocks = next(next_block)
    width = max(map(len, tables))
    table = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.long)
    perm = torch.randperm(blocks, generator=torch.Generator().manual_seed(seed))  # NOTE: scattered pages
    table = perm[table]
    end = torch.tensor(ends, dtype=torch.long)
    start = torch.zeros_like(end) if window is None else (end - window).clamp_min(0)
    order = torch.randperm(len(ends), generator=torch.Generator().manual_seed(seed + 1))  # NOTE: groups interleaved
    return table, order, start[order], end[order], blocks


def reference(q, k, v, table, row, start, end, ps, scale, softcap, sinks=None):
    """fp64 attention of each query over its positions [start, end) (`sinks` [H]: gpt-oss's per-head sink logit,
    in the softmax's denominator only)."""
    n, h, d = q.shape
    hkv = k.shape[0]
    out = torch.empty(n, h, d, dtype=torch.float64)
    for i in range(n):
        pos = torch.arange(int(start[i]), int(end[i]))
        slots = table[row[i], pos // ps] * ps + pos % ps
        kk = k[:, slots].double().repeat_interleave(h // hkv, 0)  # [H, L, D]
        vv = v[:, slots].double().repeat_interleave(h // hkv, 0)
        s = torch.einsum("hd,hld->hl", q[i].double(), kk) * scale
        if softcap:
            s = torch.tanh(s / softcap) * softcap
        if sinks is not None:
            s = torch.cat([s, sinks.double()[:, None]], 1)
        p = torch.softmax(s, -1)[:, : len(pos)]
        out[i] = torch.einsum("hl,hld->hd", p, vv)
    return out


def forked_case(ps: int, members: int, shared: int, rest: int, leader: bool, seed: int, kv_heads=2, head_dim=64,
                dtype=torch.float32):
    """A group forked from one prompt of `shared` full pages and `rest` more tokens: every member's page
    `shared` is its own, its first `rest` slots copied from the leader's; the leader (row 0, when `leader`) reads
    that block itself, past `rest`. Members end at different positions past the copy."""
    g = torch.Generator().manual_seed(seed)
    blocks = shared + 2 * members + 1
    source = shared  # NOTE: the leader's partial page
    table = torch.zeros(members, shared + 2, dtype=torch.long)
    for i in range(members):
        own = [source if (leader and i == 0) else shared + 1 + 2 * i, shared + 2 + 2 * i]
        table[i] = torch.tensor(list(range(shared)) + own)
    end = torch.tensor([shared * ps + rest + 1 + (5 * i) % (ps + 3) for i in range(members)])
    k = torch.randn(kv_heads, blocks * ps, head_dim, generator=g).to(dtype)
    v = torch.randn(kv_heads, blocks * ps, head_dim, generator=g).to(dtype)
    alias = torch.tensor([[-1, 0, 0]] * members)
    for i in range(members):
        if leader and i == 0:
            continue
        dst = int(table[i, shared]) * ps
        k[:, dst : dst + rest] = k[:, source * ps : source * ps + rest]  # NOTE: the fork's copy-on-write
        v[:, dst : dst + rest] = v[:, source * ps : source * ps + rest]
        alias[i] = torch.tensor([shared, source, rest])
    perm = torch.randperm(blocks, generator=g)  # NOTE: scattered pages; the aliases name the same blocks
    inv = torch.empty_like(perm)
    inv[perm] = torch.arange(blocks)
    k = k.view(kv_heads, blocks, ps, head_dim)[:, inv].reshape(kv_heads, blocks * ps, head_dim)
    v = v.view(kv_heads, blocks, ps, head_dim)[:, inv].reshape(kv_heads, blocks * ps, head_dim)
    table = perm[table]
    alias[:, 1] = torch.where(alias[:, 0] >= 0, perm[alias[:, 1]], alias[:, 1])
    return table, alias, end, k, v
