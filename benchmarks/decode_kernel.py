"""Decode attention over the paged cache: rollout's C++ kernel vs gather + SDPA (the no-compiler path), per thread
count.

Shapes of one layer of the 5M Qwen3-arch model by default (4 query heads, 2 KV heads, head size 64):
`--rows` decode rows, each reading `--kv` keys (drawn in a range) through a block table of scattered
16-token pages of a head-major cache `[Hkv, slots, D]`. Two variants, results checked close:

  gather  what `rollout.attention.backends.sdpa` does without the kernel: `index_select` of each row's slots into
          `[B, Hkv, Lmax, D]`, a key-padding mask, `F.scaled_dot_product_attention(..., enable_gqa=True)`
  kernel  `rollout.kernels.cpu_kernels.paged_decode_attention`: every row read in place at its own length

Each variant is timed at every thread count of `--threads` (wall clock, median of `--reps` calls, warm:
the same call repeated), interleaved. GB/s counts the K/V bytes the rows need (no padding).

    python benchmarks/decode_kernel.py [--rows 64] [--kv 300 540] [--threads 1 2] [--dtype fp32]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from rollout.kernels import cpu_kernels  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=64)
    p.add_argument("--kv", type=int, nargs=2, default=(300, 540), help="range of the rows' KV lengths")
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--dtype", choices=list(DTYPES), default="fp32")
    p.add_argument("--reps", type=int, default=30)
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    a = p.parse_args()
    kernel = cpu_kernels.paged_decode_attention()
    if kernel is None:
        sys.exit("the kernel is not available here (no compiler, or ROLLOUT_CPU_KERNELS=0)")
    g = torch.Generator().manual_seed(0)
    n, H, Hkv, D, ps = a.rows, a.heads, a.kv_heads, a.head_dim, 16
    dtype = DTYPES[a.dtype]
    lens = torch.randint(a.kv[0], a.kv[1] + 1, (n,), generator=g)
    width = -(-int(lens.max()) // ps)
    blocks = n * width + 1
    k = torch.randn(Hkv, blocks * ps, D, generator=g).to(dtype)
    v = torch.randn(Hkv, blocks * ps, D, generator=g).to(dtype)
    table = torch.randperm(blocks, generator=g)[: n * width].view(n, width).to(torch.int32)  # scattered pages
    row, start, end = torch.arange(n), torch.zeros(n, dtype=torch.long), lens.clone()
    q = torch.randn(n, H, D, generator=g)
    lmax = int(lens.max())
    j = torch.arange(lmax)
    pos = torch.minimum(j[None, :], lens[:, None] - 1)  # [n, Lmax]
    slots = (table.long().gather(1, pos // ps) * ps + pos % ps).reshape(-1)
    mask = (j[None, :] < lens[:, None])[:, None, None, :]

    def run_kernel():
        out = torch.empty_like(q)
        kernel(q, k, v, table, row, start, end, ps, D**-0.5, 0.0, out)
        return out

    def run_gather():
        kk = k.index_select(1, slots).view(Hkv, n, lmax, D).transpose(0, 1).float()
        vv = v.index_select(1, slots).view(Hkv, n, lmax, D).transpose(0, 1).float()
        o = F.scaled_dot_product_attention(q[:, :, None], kk, vv, attn_mask=mask, scale=D**-0.5, enable_gqa=True)
        return o[:, :, 0]

    torch.testing.assert_close(run_kernel(), run_gather(), atol=1e-4, rtol=1e-4)
    nbytes = 2 * int(lens.sum()) * Hkv * D * k.element_size()
    times: dict[tuple[str, int], list[float]] = {}
    for _ in range(a.reps):
        for t in a.threads:
            torch.set_num_threads(t)
            for name, fn in (("kernel", run_kernel), ("gather", run_gather)):
                t0 = time.perf_counter()
                fn()
                times.setdefault((name, t), []).append(time.perf_counter() - t0)
    print(f"rows {n}, KV {a.kv[0]}-{a.kv[1]} ({a.dtype}), H {H}, Hkv {Hkv}, D {D}; {nbytes / 1e6:.1f} MB of K/V per "
          f"call; load average {os.getloadavg()[0]:.2f}")
    print("| variant | threads | ms per call | GB/s | vs 1 thread |")
    print("|---|---|---|---|---|")
    for name in ("kernel", "gather"):
        base = statistics.median(times[(name, a.threads[0])])
        for t in a.threads:
            ms = statistics.median(times[(name, t)])
            print(f"| {name} | {t} | {ms * 1e3:.2f} | {nbytes / ms / 1e9:.1f} | {base / ms:.2f}x |")


if __name__ == "__main__":
    main()
