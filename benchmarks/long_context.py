"""Long-context RL rollouts: ours vs vLLM-CPU vs padded `generate`, beside the memory-bandwidth bound.

For each G of `--groups`: `--requests` requests as P = requests / G prompts x G samples, prompt lengths
`--prompt-len` (default 500-1000) and per-sample completion lengths `--completion-len` (default 200-1000)
drawn at random, greedy, no EOS. Systems (`--systems`, interleaved per G so ratios survive a noisy box):

  ours          rollout's default engine (`EngineCore`, cpu backend: cascade decode attention, each group's
                shared prompt pages read once per step), built and warmed up before the timing as vLLM's is
                (`run_ours(warm=True)`: the same warm-up requests), as a persistent engine in a training loop
  ours_rowwise  the same engine with the per-row kernel (every row reads its own copy of the prompt's
                pages: the kernel before cascade), patched in for this benchmark only
  vllm          vLLM's CPU build in its own process (`benchmarks/vllm_cpu.py`; its prefix cache on)
  generate      one padded `model.generate` over all requests

Systems run in an order rotated per G. Greedy tokens are compared first (all systems against `ours`). The bandwidth
bound: the bytes an engine must read per step (every live row's K/V once, `kv_rowwise`; each group's shared full prompt
pages once, `kv_shared`; plus the weights once per step, the steps being the longest completion when every request fits
in one batch) over the machine's read bandwidth (a `torch.sum` over 256 MB at the same thread count, measured
here); a bound is useful tokens / that time, and a share = measured tok/s / a bound (both bounds printed for
every system: row-wise is what a per-row reader can reach, shared-once what a cascade reader can).

    python benchmarks/long_context.py --model 5m --groups 1,8,16 --requests 32 --threads 2
    python benchmarks/long_context.py --model 100m --groups 1,8,16 --requests 16 --systems ours,vllm
    # in a trainer's process
    python benchmarks/long_context.py --model 100m --requests 16 --systems ours,vllm --trainer-step
"""

from __future__ import annotations

import argparse
import math
import os
import random
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
from common import (  # noqa: E402
    SYSTEMS,
    compare,
    machine_info,
    make_model,
    rl_workload,
    rollout_version,
    run_ours,
    timed,
    training_step,
    vllm_available,
)

from rollout import ContinuousBatchingConfig
from rollout.attention.backends import cpu as cpu_backend  # noqa: E402
from rollout.kernels import cpu_kernels  # noqa: E402


def run_ours_rowwise(model, wl, cbc=None, warm=True):
    """`ours` with the per-row kernel: the cascade turned off for this call only."""
    original = cpu_backend.cpu_kernel
    cpu_backend.cpu_kernel = lambda dtype: cpu_kernels.paged_decode_attention() if dtype in cpu_backend.DTYPES else None
    try:
        r = run_ours(model, wl, cbc, warm=warm)
    finally:
        cpu_backend.cpu_kernel = original
    r.system = "ours_rowwise"
    return r


def read_bandwidth(mb: int = 256, reps: int = 5) -> float:
    """Bytes per second of a `torch.sum` over `mb` MB of fp32 at the current thread count (best of `reps`)."""
    x = torch.ones(mb * 2**20 // 4)
    x.sum()
    best = min(_timed_sum(x) for _ in range(reps))
    return x.numel() * 4 / best


def _timed_sum(x: torch.Tensor) -> float:
    t0 = time.perf_counter()
    x.sum()
    return time.perf_counter() - t0


def kv_bytes(wl, model, page_size: int) -> tuple[int, int, int]:
    """(K/V bytes read row-wise, with each group's shared full prompt pages read once, decode steps): every
    request decodes from the start in one batch (all fit), a group's members in lockstep."""
    cfg = model.config
    per_token = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * getattr(cfg, "head_dim", None) * \
        next(model.parameters()).element_size()
    rowwise = shared = 0
    G = wl.group_size
    for g0 in range(0, wl.num_requests, G):
        plen = len(wl.prompts[g0])
        news = wl.max_new[g0:g0 + G]
        full = (plen - 1) // page_size * page_size  # NOTE: a fork shares the leader's full prompt pages
        for t in range(1, max(news)):  # NOTE: decode step t reads plen + t keys per live row
            live = sum(n > t for n in news)
            rowwise += live * (plen + t)
            shared += live * (plen + t) - (live - 1) * full if live > 1 else live * (plen + t)
    return rowwise * per_token, shared * per_token, max(wl.max_new)


def lognormal_lengths(wl, median: float, sigma: float, bounds: tuple[int, int], seed: int):
    """`wl` with each request's completion length drawn log-normally (median, sigma), clipped to `bounds`."""
    rng = random.Random(seed + 1)
    lo, hi = bounds
    wl.max_new = [max(lo, min(hi, round(rng.lognormvariate(math.log(median), sigma)))) for _ in wl.max_new]
    return wl


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=["5m", "100m"], default="5m")
    p.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    p.add_argument("--groups", default="1,8,16")
    p.add_argument("--requests", type=int, default=32, help="requests per G (P = requests / G prompts)")
    p.add_argument("--prompt-len", type=int, nargs=2, default=(500, 1000))
    p.add_argument("--completion-len", type=int, nargs=2, default=(200, 1000))
    p.add_argument("--systems", default="ours,ours_rowwise,vllm,generate")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--page-size", type=int, default=None, help="ours: tokens per KV page (default: the engine's)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--lognormal", type=float, nargs=2, default=None, metavar=("MEDIAN", "SIGMA"),
                   help="completion lengths log-normal (median, sigma), clipped to --completion-len: a long tail")
    p.add_argument("--trainer-step", action="store_true",
                   help="first, as a trainer's process has: deep-copy the model and run a training step (forward, "
                        "backward, AdamW) on this thread, then generate in the same process")
    p.add_argument("--repeats", type=int, default=1,
                   help="rounds of every system per G, the order rotated each round; tok/s is the median round "
                        "(this shared box's speed drifts 10-30%% within minutes)")
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    model = make_model(a.model, a.dtype)
    systems = [s for s in a.systems.split(",") if s]
    if "vllm" in systems and not vllm_available():
        print("vllm: not installed, skipped", flush=True)
        systems.remove("vllm")
    cbc = ContinuousBatchingConfig() if a.page_size is None else ContinuousBatchingConfig(page_size=a.page_size)
    page_size = cbc.page_size
    runners = {
        "ours": lambda m, w: run_ours(m, w, cbc, warm=True),
        "ours_rowwise": lambda m, w: run_ours_rowwise(m, w, cbc),
        "vllm": SYSTEMS["vllm"],
        "generate": SYSTEMS["generate"],
    }
    print(f"rollout: {rollout_version()}\nmachine: {machine_info()}\nmodel {a.model} {a.dtype}, page size {page_size}, "
          f"threads {a.threads}, load {os.getloadavg()[0]:.2f}", flush=True)
    if a.trainer_step:
        print(f"trainer step on the main thread ({torch.get_num_threads()} threads): deep copy + "
              f"forward/backward/AdamW {training_step(model):.1f} s", flush=True)
    bw = read_bandwidth()
    weights = sum(t.numel() * t.element_size() for t in model.parameters())
    print(f"read bandwidth (torch.sum, 256 MB): {bw / 1e9:.1f} GB/s; weights {weights / 1e6:.0f} MB", flush=True)
    run_ours(model, rl_workload(2, 2, model.config.vocab_size, (16, 64), (4, 8), seed=123), cbc)  # NOTE: warm-up
    rows = []
    for G in [int(x) for x in a.groups.split(",")]:
        wl = rl_workload(max(1, a.requests // G), G, model.config.vocab_size, tuple(a.prompt_len),
                         tuple(a.completion_len), seed=a.seed)
        if a.lognormal:
            wl = lognormal_lengths(wl, *a.lognormal, tuple(a.completion_len), a.seed)
        kv_row, kv_shared, steps = kv_bytes(wl, model, page_size)
        bound_row = wl.useful_tokens / ((kv_row + steps * weights) / bw)
        bound_shared = wl.useful_tokens / ((kv_shared + steps * weights) / bw)
        print(f"\nG={G}: {wl.describe()}; K/V read row-wise {kv_row / 1e9:.2f} GB, shared pages once "
              f"{kv_shared / 1e9:.2f} GB; bound {bound_row:,.0f} / {bound_shared:,.0f} tok/s", flush=True)
        res, times = {}, {name: [] for name in systems}
        for rnd in range(max(1, a.repeats)):
            # NOTE: a rotated order per G and per round: no system always first
            k = (len(rows) // max(1, len(systems)) + rnd) % len(systems)
            for name in systems[k:] + systems[:k]:
                r = timed(runners[name], model, wl)
                res.setdefault(name, r)
                times[name].append(r.seconds)
                cpu = r.extra.get("cpu_timed")
                cpu = "" if cpu is None else f"  cpu {cpu:6.2f} s ({cpu / r.seconds:.2f} cores)"
                print(f"  {name:13s} {r.seconds:7.2f} s  {wl.useful_tokens / r.seconds:8,.0f} tok/s{cpu}  "
                      f"load {os.getloadavg()[0]:.2f}", flush=True)
        for name, ts in times.items():  # NOTE: the median round's time (the upper median of an even count)
            res[name].seconds = sorted(ts)[len(ts) // 2]
        if a.repeats > 1:
            print("  median of " + str(a.repeats) + " rounds: " + ", ".join(
                f"{name} {wl.useful_tokens / res[name].seconds:,.0f} tok/s" for name in systems), flush=True)
        ref = "ours" if "ours" in res else systems[0]
        for name in res:
            if name != ref:
                exact, prefix = compare(res[ref].outputs, res[name].outputs)
                print(f"  greedy {ref} vs {name}: {exact:.0%} identical, mean prefix {prefix:.1%}", flush=True)
        for name, r in res.items():
            rate = wl.useful_tokens / r.seconds
            rows.append((a.model, G, name, rate, bound_row, bound_shared,
                         rate / (wl.useful_tokens / res["vllm"].seconds) if "vllm" in res else float("nan")))
    print("\n| model | G | system | tok/s | bound row-wise / shared-once tok/s | share of row-wise / shared bound "
          "| vs vLLM |\n|---|---|---|---|---|---|---|")
    for m, G, name, rate, b_row, b_shared, vs in rows:
        print(f"| {m} | {G} | {name} | {rate:,.0f} | {b_row:,.0f} / {b_shared:,.0f} | {rate / b_row:.0%} / "
              f"{rate / b_shared:.0%} | {vs:.2f}x |")
    print(f"load at the end {os.getloadavg()[0]:.2f}", flush=True)


if __name__ == "__main__":
    main()
