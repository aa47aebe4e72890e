"""The greedy token of every row: torch's `argmax(dim=-1)` against rollout's kernel (`rollout/kernels/csrc/argmax.cpp`).

On fp32 logits [R, V] of decode-step sizes: the 100M model's vocabulary (32768) and Qwen's (151936), 1-64 rows,
at `--threads`. Indices are checked equal first; then the best of 5 passes of 100 calls each.

    python benchmarks/argmax_rows.py [--threads 2]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from rollout.kernels import cpu_kernels  # noqa: E402


def best_us(fn, calls: int = 100) -> float:
    fn()
    best = float("inf")
    for _ in range(5):
        t = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - t) / calls)
    return best * 1e6


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=2)
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    kernel = cpu_kernels.argmax_rows()
    if kernel is None:
        raise SystemExit("rollout's C++ kernels are unavailable here (no compiler or ROLLOUT_CPU_KERNELS=0)")
    print(f"threads {a.threads}, torch {torch.__version__}, load {os.getloadavg()[0]:.2f}")
    for rows, vocab in ((1, 32768), (16, 32768), (64, 4096), (64, 32768), (1, 151936), (16, 151936), (64, 151936)):
        x = torch.randn(rows, vocab)
        assert torch.equal(kernel(x), x.argmax(dim=-1))
        ours, theirs = best_us(lambda x=x: kernel(x)), best_us(lambda x=x: x.argmax(dim=-1))
        print(f"  {rows:3d} x {vocab:6d}: torch {theirs:7.0f} us, ours {ours:6.0f} us "
              f"({x.numel() * 4 / ours / 1e3:4.1f} GB/s), {theirs / ours:4.1f}x")


if __name__ == "__main__":
    main()
