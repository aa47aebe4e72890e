"""The 100M model's decode-step linears alone: how close do oneDNN's packed linears get to the memory bound?

Runs the 85 linear layers of the 100M Qwen3-arch model of `benchmarks/common.py` (12 layers x q, k, v, o,
gate, up, down, plus the 768 x 32768 head) one after the other on packed weights, as the engine's view does
(`rollout/linear.py`), for M = 1 / 16 / 64 rows, at 1 and 2 threads. The weights total 440 MB, far more than
any cache, so each call reads its weight from memory as in a real step. For each case it prints the time,
the weights' read rate, and the GFLOP/s; beside them, a `torch.sum` over 256 MB at the same thread count
(the machine's read bandwidth).

    python benchmarks/decode_linears.py

Issue #26 (100M, long contexts) asks where a decode step of 16 rows loses against the memory bound.
"""

from __future__ import annotations

import time

import torch


def main() -> None:
    torch.manual_seed(0)

    def lin(x, pw):
        return torch.ops.mkldnn._linear_pointwise(x, pw, None, "none", [], "")

    shapes = []
    for _ in range(12):
        shapes += [(768, 768), (768, 256), (768, 256), (768, 768), (768, 2048), (768, 2048), (2048, 768)]
    shapes.append((768, 32768))  # the head
    weights = [torch.ops.mkldnn._reorder_linear_weight(torch.randn(n, k), 16) for k, n in shapes]
    nbytes = sum(k * n * 4 for k, n in shapes)
    big = torch.randn(64 * 2**20)
    with torch.inference_mode():
        for threads in (1, 2):
            torch.set_num_threads(threads)
            big.sum()
            t = time.perf_counter()
            big.sum()
            bandwidth = big.numel() * 4 / (time.perf_counter() - t)
            cells = []
            for m in (1, 16, 64):
                xs = {768: torch.randn(m, 768), 2048: torch.randn(m, 2048)}
                best = float("inf")
                for _ in range(5):
                    t = time.perf_counter()
                    for (k, _n), w in zip(shapes, weights, strict=True):
                        lin(xs[k], w)
                    best = min(best, time.perf_counter() - t)
                cells.append(f"M={m}: {best * 1e3:.1f} ms ({nbytes / best / 1e9:.1f} GB/s of weights, "
                             f"{2 * m * nbytes / 4 / best / 1e9:.0f} GFLOP/s)")
            print(f"threads {threads} (torch.sum {bandwidth / 1e9:.0f} GB/s, weights {nbytes / 1e6:.0f} MB): "
                  + "; ".join(cells), flush=True)


if __name__ == "__main__":
    main()
