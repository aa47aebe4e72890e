"""The 100M model's decode-step linears alone: oneDNN's packed linears vs rollout's small-M kernel, beside the
memory bound.

Runs the 85 linear layers of the 100M Qwen3-arch model of `benchmarks/common.py` (12 layers x q, k, v, o,
gate, up, down, plus the 768 x 32768 head) one after the other, as the engine's view does (`rollout/kernels/linear.py`),
for M = 1 / 4 / 16 / 32 / 64 rows, at 1 and 2 threads, each way:

  onednn  `torch.ops.mkldnn._linear_pointwise` on oneDNN's packed weights (the engine above `SMALL_ROWS` rows)
  ours    `rollout.kernels.cpu_kernels.small_linear` on its panels (`rollout/kernels/csrc/small_gemm.cpp`; the engine up
  to
          `SMALL_ROWS` rows)

The weights total 403 MB, far more than any cache, so each call reads its weight from memory as in a real step.
`--model 5m` runs the 5M model's 29 linears instead (4 layers, the 256 x 4096 head; ~17 MB, which a big L3 holds:
the passes then read them from cache, as that model's steps do).
For each case: the best of 5 passes, the weights' read rate, and the GFLOP/s; beside them a `torch.sum` over
256 MB at the same thread count (the machine's read bandwidth). Results are checked against `F.linear` first.

    python benchmarks/decode_linears.py [--ms 1,4,16,32,64] [--threads 1,2] [--model 100m | 5m]

Issue #26 (100M, long contexts): a decode step of 16 rows with oneDNN costs the memory time plus the FMA time.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from common import MODEL_SPECS  # noqa: E402

from rollout.kernels import cpu_kernels  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ms", default="1,4,16,32,64")
    p.add_argument("--threads", default="1,2")
    p.add_argument("--model", default="100m", help="a model of benchmarks/common.py (MODEL_SPECS): its linears' shapes")
    a = p.parse_args()
    torch.manual_seed(0)
    small, pack = cpu_kernels.small_linear(), cpu_kernels.pack_panels()

    def onednn(x, w):
        return torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")

    spec = MODEL_SPECS[a.model]
    h, q, kv = spec["hidden_size"], spec["num_attention_heads"] * spec["head_dim"], \
        spec["num_key_value_heads"] * spec["head_dim"]
    inter = spec["intermediate_size"]
    shapes = []  # NOTE: (in, out) of q, k, v, o, gate, up, down per layer, then the head
    for _ in range(spec["num_hidden_layers"]):
        shapes += [(h, q), (h, kv), (h, kv), (q, h), (h, inter), (h, inter), (inter, h)]
    shapes.append((h, spec["vocab_size"]))  # the head
    raw = [torch.randn(n, k) for k, n in shapes]
    ways = {"onednn": (onednn, [torch.ops.mkldnn._reorder_linear_weight(w, 16) for w in raw])}
    if small is not None:
        ways["ours"] = (lambda x, w, n: small(x, w, None, n), [pack(w) for w in raw])
    else:
        print("ours: rollout's CPU kernels are unavailable here (no compiler or no AVX-512): onednn only")
    nbytes = sum(k * n * 4 for k, n in shapes)
    big = torch.randn(64 * 2**20)
    with torch.inference_mode():
        x = torch.randn(5, h)
        for i in (0, 1, len(shapes) - 1):
            want = F.linear(x, raw[i])
            torch.testing.assert_close(onednn(x, ways["onednn"][1][i]), want, rtol=1e-4, atol=1e-4)
            if "ours" in ways:
                torch.testing.assert_close(
                    small(x, ways["ours"][1][i], None, raw[i].shape[0]), want, rtol=1e-4, atol=1e-4
                )
        for threads in (int(t) for t in a.threads.split(",")):
            torch.set_num_threads(threads)
            big.sum()
            t = time.perf_counter()
            big.sum()
            bandwidth = big.numel() * 4 / (time.perf_counter() - t)
            print(f"threads {threads} (torch.sum {bandwidth / 1e9:.0f} GB/s, weights {nbytes / 1e6:.0f} MB; "
                  f"memory bound {nbytes / bandwidth * 1e3:.1f} ms), load {os.getloadavg()[0]:.2f}", flush=True)
            for m in (int(v) for v in a.ms.split(",")):
                xs = {k: torch.randn(m, k) for k in {k for k, _ in shapes}}
                cells, times = [], {}
                for name, (fn, ws) in ways.items():
                    best = float("inf")
                    for _ in range(5):
                        t = time.perf_counter()
                        for (k, n), w in zip(shapes, ws, strict=True):
                            fn(xs[k], w) if name == "onednn" else fn(xs[k], w, n)
                        best = min(best, time.perf_counter() - t)
                    times[name] = best
                    cells.append(f"{name} {best * 1e3:.1f} ms ({nbytes / best / 1e9:.0f} GB/s, "
                                 f"{2 * m * nbytes / 4 / best / 1e9:.0f} GFLOP/s)")
                ratio = f"; ours {times['onednn'] / times['ours']:.2f}x onednn" if "ours" in times else ""
                print(f"  M={m}: " + "; ".join(cells) + ratio, flush=True)


if __name__ == "__main__":
    main()
