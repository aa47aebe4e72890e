"""Micro-benchmarks behind PROFILE.md's suggestions: the decode attention and the slot building of one step.

Shapes of the 5M Qwen3-arch model (4 query heads, 2 KV heads, head_dim 64), one layer, 64 decode rows.
Times are CPU time of this thread (robust on a busy box), best of several repeats, per call.

Decode attention variants (same K/V contents, results checked equal):
  current      (rollout at 39e389a, as profiled) cache [slots, Hkv, D]; index_select of every row's slots padded to
  Lmax, transpose to
               [B, Hkv, Lmax, D] (a view whose (Lmax, D) planes are strided), SDPA (bool mask, enable_gqa)
  head-major   cache [Hkv, slots, D]; index_select on dim 1 gives [B, Hkv, Lmax, D] with contiguous planes
  bucketed     current, but the rows split in two by KV length (less padding)
  page gather  gather whole pages by block id (fewer, larger copies, padded to whole pages)
  (bf16 only) the head-major gather cast to fp32 before SDPA / before an explicit bmm attention

Slot building (what `runner.prepare` does for decode rows each step):
  python_lists per request `[table[p // ps] * ps + p % ps for p in range(end)]`, padded, torch.tensor(nested)
  vectorised   a [B, max_pages] block-table tensor -> slots = table[:, j // ps] * ps + j % ps in torch

    python benchmarks/attn_micro.py [--rows 64] [--kv 256 384] [--page-size 256]
"""

from __future__ import annotations

import argparse
import random
import time

import torch
import torch.nn.functional as F


def best_cpu(fn, reps: int = 7, inner: int = 5) -> float:
    fn()
    best = float("inf")
    for _ in range(reps):
        c0 = time.thread_time()
        for _ in range(inner):
            fn()
        best = min(best, (time.thread_time() - c0) / inner)
    return best


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rows", type=int, default=64)
    p.add_argument("--kv", type=int, nargs=2, default=(256, 384), help="range of KV lengths of the rows")
    p.add_argument("--page-size", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    p.add_argument("--threads", type=int, default=1)
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[a.dtype]
    rng = random.Random(0)
    B, H, Hkv, D, ps = a.rows, a.heads, a.kv_heads, a.head_dim, a.page_size
    lens = [rng.randint(*a.kv) for _ in range(B)]
    pages = [-(-n // ps) for n in lens]
    num_blocks = sum(pages) + 8
    order = list(range(num_blocks))
    rng.shuffle(order)  # pages of a request are scattered, as in a long-running cache
    tables, k = [], 0
    for n in pages:
        tables.append(order[k:k + n])
        k += n
    k_cache = torch.randn(num_blocks * ps, Hkv, D, dtype=dtype)
    v_cache = torch.randn_like(k_cache)
    q = torch.randn(B, H, 1, D, dtype=dtype)
    lmax = max(lens)
    maxp = max(pages)

    # ---- slot building
    def python_lists():
        dec = [[t[p_ // ps] * ps + p_ % ps for p_ in range(n)] for t, n in zip(tables, lens, strict=True)]
        return torch.tensor([s + s[:1] * (lmax - len(s)) for s in dec])

    table_t = torch.tensor([t + t[:1] * (maxp - len(t)) for t in tables])  # [B, maxp]
    lens_t = torch.tensor(lens)
    j = torch.arange(lmax)

    def vectorised():
        slots = table_t[:, j // ps] * ps + j % ps  # [B, Lmax]
        return torch.where(j[None, :] < lens_t[:, None], slots, slots[:, :1])

    assert torch.equal(python_lists(), vectorised())
    slots = vectorised()
    flat = slots.reshape(-1)
    mask = (j[None, :] < lens_t[:, None])[:, None, None, :]
    block_flat = table_t.reshape(-1)
    page_mask = (torch.arange(maxp * ps)[None, :] < lens_t[:, None])[:, None, None, :]

    k_hm = k_cache.transpose(0, 1).contiguous()  # head-major layout [Hkv, slots, D]
    v_hm = v_cache.transpose(0, 1).contiguous()

    def gather_only():
        return k_cache.index_select(0, flat), v_cache.index_select(0, flat)

    def slot_kv():  # today: [B, Lmax, Hkv, D] -> [B, Hkv, Lmax, D] view, (Lmax, D) not contiguous
        kk = k_cache.index_select(0, flat).view(B, lmax, Hkv, D).transpose(1, 2)
        vv = v_cache.index_select(0, flat).view(B, lmax, Hkv, D).transpose(1, 2)
        return kk, vv

    def hm_kv():  # head-major cache: [Hkv, B, Lmax, D] -> [B, Hkv, Lmax, D] view, (Lmax, D) contiguous
        kk = k_hm.index_select(1, flat).view(Hkv, B, lmax, D).transpose(0, 1)
        vv = v_hm.index_select(1, flat).view(Hkv, B, lmax, D).transpose(0, 1)
        return kk, vv

    def page_kv():
        kk = k_cache.view(num_blocks, ps, Hkv, D).index_select(0, block_flat).view(B, maxp * ps, Hkv, D).transpose(1, 2)
        vv = v_cache.view(num_blocks, ps, Hkv, D).index_select(0, block_flat).view(B, maxp * ps, Hkv, D).transpose(1, 2)
        return kk, vv

    def sdpa(kk, vv, m, qq=q):
        return F.scaled_dot_product_attention(qq, kk, vv, attn_mask=m, scale=D**-0.5, enable_gqa=True)

    # two length buckets (rows sorted by KV length, split in half): less padding in the gather and SDPA
    by_len = sorted(range(B), key=lambda i: lens[i])
    buckets = []
    for part in (by_len[: B // 2], by_len[B // 2:]):
        lm = max(lens[i] for i in part)
        jj = torch.arange(lm)
        sl = table_t[part][:, jj // ps] * ps + jj % ps
        ln = lens_t[part]
        sl = torch.where(jj[None, :] < ln[:, None], sl, sl[:, :1])
        buckets.append(
            (torch.tensor(part), sl.reshape(-1), len(part), lm, (jj[None, :] < ln[:, None])[:, None, None, :])
        )

    def bucketed():
        out = torch.empty_like(q)
        for rows_, fl, b, lm, m in buckets:
            kk = k_cache.index_select(0, fl).view(b, lm, Hkv, D).transpose(1, 2)
            vv = v_cache.index_select(0, fl).view(b, lm, Hkv, D).transpose(1, 2)
            out.index_copy_(0, rows_, sdpa(kk, vv, m, q.index_select(0, rows_)))
        return out

    ref = sdpa(*slot_kv(), mask)
    for name, fn in (("hm", lambda: sdpa(*hm_kv(), mask)), ("page", lambda: sdpa(*page_kv(), page_mask)),
                     ("bucketed", bucketed)):
        err = (fn().float() - ref.float()).abs().max().item()
        assert err < (1e-4 if dtype == torch.float32 else 5e-2), (name, err)

    kk, vv = slot_kv()
    hk, hv = hm_kv()
    rows = [
        ("slots: python lists + torch.tensor (runner.prepare at 39e389a)", best_cpu(python_lists, 3, 1)),
        ("slots: vectorised from a block-table tensor", best_cpu(vectorised)),
        ("attn: as profiled (39e389a) = slot gather [S,Hkv,D] + SDPA", best_cpu(lambda: sdpa(*slot_kv(), mask))),
        ("attn:   its gather alone (2 x index_select)", best_cpu(gather_only)),
        ("attn:   its SDPA alone (K/V (L,D) non-contiguous)", best_cpu(lambda: sdpa(kk, vv, mask))),
        ("attn: head-major cache [Hkv,S,D]: gather + SDPA", best_cpu(lambda: sdpa(*hm_kv(), mask))),
        ("attn:   its SDPA alone (K/V (L,D) contiguous)", best_cpu(lambda: sdpa(hk, hv, mask))),
        ("attn: current, rows in 2 length buckets", best_cpu(bucketed)),
        ("attn: whole-page gather + SDPA", best_cpu(lambda: sdpa(*page_kv(), page_mask))),
    ]
    if dtype != torch.float32:
        qf = q.float()

        def upcast():
            kk, vv = hm_kv()
            return sdpa(kk.float(), vv.float(), mask, qf).to(dtype)

        def upcast_bmm():  # explicit GQA attention in fp32 on the head-major gather
            kk, vv = hm_kv()
            g = H // Hkv
            sc = torch.matmul(qf.view(B, Hkv, g, D), kk.float().transpose(-1, -2)) * D**-0.5
            sc = sc.masked_fill(~mask.view(B, 1, 1, -1), float("-inf"))
            return torch.matmul(torch.softmax(sc, dim=-1), vv.float()).view(B, H, 1, D).to(dtype)

        for name, fn in (("upcast", upcast), ("upcast_bmm", upcast_bmm)):
            err = (fn().float() - ref.float()).abs().max().item()
            assert err < 5e-2, (name, err)
        rows += [
            ("attn: head-major gather, K/V/q cast to fp32, SDPA in fp32", best_cpu(upcast)),
            ("attn: head-major gather, fp32 explicit GQA bmm + softmax", best_cpu(upcast_bmm)),
        ]
    kv_bytes = 2 * sum(lens) * Hkv * D * k_cache.element_size()
    print(f"{B} decode rows, KV lengths {min(lens)}-{max(lens)} (Lmax {lmax}, padding "
          f"{1 - sum(lens) / (B * lmax):.0%}), page_size {ps}, H={H} Hkv={Hkv} D={D} {a.dtype}, "
          f"{torch.get_num_threads()} thread(s); useful K+V bytes per layer {kv_bytes / 2**20:.1f} MiB")
    for name, t in rows:
        print(f"  {1e3 * t:8.3f} ms  {name}")


if __name__ == "__main__":
    main()
