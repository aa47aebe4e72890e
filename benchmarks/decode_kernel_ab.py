"""Decode attention kernel A/B on cold pages: the live `rollout/kernels/csrc` against the same sources at a git
revision, built side by side, interleaved in one process.

Each of `--layers` layers has its own K/V cache (so every call reads its pages from memory, as in a real step,
unlike `decode_kernel.py`, which repeats one warm call), `--rows` decode rows of `--keys` keys (minus 0-199
at random) over scattered `--page-size` pages, `--heads` query heads on `--kv-heads` KV heads, head size
`--head-dim`; with `--group G`, rows in groups of G share their first `--shared-pages` pages (a GRPO group's
prompt: the cascade path). With `--verify Q`, each row is a verifying row of a speculative step: Q queries, the
j-th reading keys up to the row's end + j (the engine hands the kernel a row's draft tokens this way; its cascade
reads the row's keys once for all Q). Both builds run the same calls in turns (`--reps`); prints the median time
per layer, the K/V bytes the rows name over that time, and the largest difference between the two outputs.

    python benchmarks/decode_kernel_ab.py --against b42072b~1                                  # 5M layer, 64 rows
    python benchmarks/decode_kernel_ab.py --against b42072b~1 --rows 32 --heads 12 --kv-heads 4  # 100M layer
    python benchmarks/decode_kernel_ab.py --against b42072b~1 --rows 16 --heads 12 --kv-heads 4 --group 16
    python benchmarks/decode_kernel_ab.py --against HEAD~1 --rows 4 --keys 570 --verify 9    # a 5M tail's drafts
"""

from __future__ import annotations

import argparse
import atexit
import hashlib
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
from torch.utils import cpp_extension  # noqa: E402

from rollout.kernels import cpu_kernels  # noqa: E402

REPO = Path(__file__).resolve().parent.parent


# NOTE: the revision's decode_attention.cpp alone, bound by this file: the whole module's other classes (the suffix
# drafts' index) cannot be registered twice in one process
BINDING = """#include <torch/extension.h>
void cascade_decode_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& table,
                              const at::Tensor& row, const at::Tensor& start, const at::Tensor& end,
                              int64_t page_size, double scale, double softcap, at::Tensor& out,
                              const c10::optional<at::Tensor>& alias);
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("cascade_decode_attention", &cascade_decode_attention, pybind11::arg("q"), pybind11::arg("k"),
        pybind11::arg("v"), pybind11::arg("table"), pybind11::arg("row"), pybind11::arg("start"), pybind11::arg("end"),
        pybind11::arg("page_size"), pybind11::arg("scale"), pybind11::arg("softcap"), pybind11::arg("out"),
        pybind11::arg("alias") = pybind11::none(), pybind11::call_guard<pybind11::gil_scoped_release>());
}
"""


def build_at(rev: str):
    """`cascade_decode_attention` of the kernel source at git revision `rev`, built in a temporary directory."""
    out = Path(tempfile.mkdtemp(prefix="rollout_kernel_ab_"))
    atexit.register(shutil.rmtree, out, ignore_errors=True)  # NOTE: the loaded library needs no file once mapped
    src = out / "decode_attention.cpp"
    src.write_bytes(subprocess.run(["git", "-C", str(REPO), "show", f"{rev}:rollout/kernels/csrc/decode_attention.cpp"],
                                   check=True, capture_output=True).stdout)
    (out / "binding.cpp").write_text(BINDING)
    digest = hashlib.sha1(src.read_bytes() + BINDING.encode()).hexdigest()[:10]
    mod = cpp_extension.load(name=f"rollout_ab_{digest}", sources=[str(src), str(out / "binding.cpp")],
                             extra_cflags=list(cpu_kernels.CFLAGS), extra_ldflags=list(cpu_kernels.LDFLAGS),
                             build_directory=str(out), verbose=False)
    return mod.cascade_decode_attention


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--against", required=True, help="git revision whose kernel sources are the baseline")
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--keys", type=int, default=1070)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--page-size", type=int, default=256)
    ap.add_argument("--group", type=int, default=1)
    ap.add_argument("--shared-pages", type=int, default=2)
    ap.add_argument("--verify", type=int, default=1, help="queries per row (a verifying row's tokens)")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--reps", type=int, default=12)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    kernels = {"live": cpu_kernels.cascade_decode_attention(), a.against: build_at(a.against)}
    if kernels["live"] is None:
        raise SystemExit("the live kernel is unavailable here (no compiler or ROLLOUT_CPU_KERNELS=0)")
    ps, pages = a.page_size, (a.keys + a.verify + a.page_size - 1) // a.page_size
    blocks = a.rows * pages + 8
    caches = [(torch.randn(a.kv_heads, blocks * ps, a.head_dim), torch.randn(a.kv_heads, blocks * ps, a.head_dim))
              for _ in range(a.layers)]
    perm = list(range(blocks))
    random.Random(0).shuffle(perm)
    table = torch.tensor(perm[: a.rows * pages], dtype=torch.int32).view(a.rows, pages).contiguous()
    if a.group > 1:
        for r in range(a.rows):
            table[r, : a.shared_pages] = table[(r // a.group) * a.group, : a.shared_pages]
    rows = torch.arange(a.rows).repeat_interleave(a.verify)
    start = torch.zeros(len(rows), dtype=torch.long)
    ends = [a.keys - random.Random(r).randrange(0, 200) for r in range(a.rows)]
    end = torch.tensor([e + j for e in ends for j in range(a.verify)], dtype=torch.long)
    q = torch.randn(len(rows), a.heads, a.head_dim)
    outs = {name: torch.empty_like(q) for name in kernels}
    scale = a.head_dim ** -0.5

    def run(name: str) -> float:
        t0 = time.perf_counter()
        for kc, vc in caches:
            kernels[name](q, kc, vc, table, rows, start, end, ps, scale, 0.0, outs[name], None)
        return time.perf_counter() - t0

    times = {name: [] for name in kernels}
    for name in kernels:
        run(name)
    for _ in range(a.reps):
        for name in kernels:
            times[name].append(run(name))
    nbytes = int(end.sum()) * a.kv_heads * a.head_dim * 4 * 2 * a.layers
    print(f"rows {a.rows} x ~{a.keys} keys, {a.verify} queries a row, {a.heads} heads / {a.kv_heads} KV heads x "
          f"{a.head_dim}, page {ps}, group {a.group}, {a.layers} cold layers, {a.threads} threads, "
          f"load {os.getloadavg()[0]:.2f}")
    med = {name: statistics.median(t) for name, t in times.items()}
    for name in kernels:
        diff = float((outs[name] - outs["live"]).abs().max())
        print(f"  {name:14s} {med[name] / a.layers * 1e3:7.3f} ms a layer  {nbytes / med[name] / 1e9:5.1f} GB/s of K/V "
              f"named  max |diff| vs live {diff:.1e}")
    print(f"  live / {a.against}: {med[a.against] / med['live']:.2f}x")


if __name__ == "__main__":
    main()
