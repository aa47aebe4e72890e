"""Decode attention on lanes: torch SDPA (what runs without the kernel) vs rollout's C++ kernel.

Shapes of one layer of the 5M Qwen3-arch model by default (4 query heads, 2 KV heads, head size 64):
`--rows` decode rows whose lanes (`[lanes, Hkv, lane_len, D]`, fp32, rows in shuffled lanes) hold
`--kv` keys each. Two variants, results checked close (they are not bitwise equal):

  sdpa    what `rollout.attention` does without the kernel: the lanes of the rows read as one padded
          view (the rows in lanes 0..n-1, in order: the best case, after compaction), a key-padding
          mask, `F.scaled_dot_product_attention(..., enable_gqa=True)`
  kernel  `rollout.cpu_kernels.decode_attention`: every lane read in place at its own length

Each is timed warm (the same call repeated: K/V in cache) and cold (a 256 MB write between calls
evicts the caches, as in a real step where the lanes of 4+ layers and the weights do not fit in L3).
Times are per call, median of `--reps`, CPU time of this thread. GB/s counts the K/V bytes the rows
need (no padding), so it compares directly with a plain streaming read (`torch.sum` of a 256 MB fp32 tensor).

    python benchmarks/decode_kernel.py [--rows 16] [--kv 300 540] [--heads 4 --kv-heads 2 --head-dim 64]
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

from rollout import cpu_kernels  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=16)
    p.add_argument("--kv", type=int, nargs=2, default=(300, 540), help="range of the rows' KV lengths")
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--reps", type=int, default=30)
    p.add_argument("--threads", type=int, default=1)
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    kernel = cpu_kernels.decode_attention()
    if kernel is None:
        sys.exit("the kernel is not available here (no compiler, or ROLLOUT_CPU_KERNELS=0)")
    g = torch.Generator().manual_seed(0)
    n, H, Hkv, D = a.rows, a.heads, a.kv_heads, a.head_dim
    lane_len = -(-(a.kv[1] + 1) // 256) * 256
    num_lanes = max(64, 2 * n)
    lk = torch.randn(num_lanes, Hkv, lane_len, D, generator=g)
    lv = torch.randn(num_lanes, Hkv, lane_len, D, generator=g)
    q = torch.randn(n, H, D, generator=g)
    lens = torch.randint(a.kv[0], a.kv[1] + 1, (n,), generator=g)
    lmax = int(lens.max())
    mask = (torch.arange(lmax)[None, :] < lens[:, None])[:, None, None, :]
    shuffled = torch.randperm(num_lanes, generator=g)[:n]
    # NOTE: the kernel reads the rows from shuffled lanes of its own tensors; SDPA gets the same contents
    # in lanes 0..n-1 (its best case)
    kk, kv = torch.randn_like(lk), torch.randn_like(lv)
    kk[shuffled], kv[shuffled] = lk[:n], lv[:n]
    out = torch.empty(n, H, D)

    def sdpa():
        return F.scaled_dot_product_attention(q[:, :, None], lk[:n, :, :lmax], lv[:n, :, :lmax], attn_mask=mask,
                                              scale=D**-0.5, enable_gqa=H != Hkv)[:, :, 0]

    def kern():
        kernel(q, kk, kv, shuffled, lens, D**-0.5, 0.0, out)
        return out

    torch.testing.assert_close(kern(), sdpa(), atol=1e-5, rtol=1e-5)
    big = torch.empty(256 << 20, dtype=torch.uint8)
    need = int(lens.sum()) * Hkv * D * 4 * 2
    times = {name: ([], []) for name in ("sdpa", "kernel")}
    for rep in range(a.reps):
        for name, fn in (("sdpa", sdpa), ("kernel", kern)):
            big.fill_(rep)  # NOTE: evicts L1-L3
            c0 = time.thread_time()
            fn()
            times[name][0].append(time.thread_time() - c0)
            c0 = time.thread_time()
            for _ in range(5):
                fn()
            times[name][1].append((time.thread_time() - c0) / 5)
    stream = []
    for _ in range(5):
        c0 = time.thread_time()
        big.view(torch.float32).sum()
        stream.append(big.numel() / (time.thread_time() - c0) / 1e9)
    print(f"{n} decode rows, KV {int(lens.min())}-{lmax} (padding to Lmax {1 - int(lens.sum()) / (n * lmax):.0%}), "
          f"{H} heads / {Hkv} KV heads x {D}, {need / 1e6:.1f} MB of K+V needed; {a.threads} thread(s)")
    print(f"plain streaming read (sum of 256 MB fp32): {statistics.median(stream):.1f} GB/s")
    med = {k: (statistics.median(c), statistics.median(w)) for k, (c, w) in times.items()}
    for name, (cold, warm) in med.items():
        print(f"  {name:7s} cold {cold * 1e3:6.3f} ms ({need / cold / 1e9:5.1f} GB/s)   "
              f"warm {warm * 1e3:6.3f} ms ({need / warm / 1e9:5.1f} GB/s)")
    print(f"kernel speed-up: cold {med['sdpa'][0] / med['kernel'][0]:.2f}x, warm {med['sdpa'][1] / med['kernel'][1]:.2f}x")


if __name__ == "__main__":
    main()
