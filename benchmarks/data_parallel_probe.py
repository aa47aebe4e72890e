"""Would two single-threaded engine workers beat one engine with two threads? A probe for issue 15.

On the 2-core box, one engine at 2 torch threads runs the RL workload only 1.2-1.3x faster than at 1
thread: a decode step's matmuls are too small to split well. Two independent single-threaded
matmul loops in two processes do run at ~2x (`--matmul`). This probe runs the RL workload of
`benchmarks/throughput.py` (16 prompts x G=4) three ways, the same model (same seed) everywhere,
greedy, wall clock, medians of `--reps`:

  1t    one process, one EngineCore, 1 thread, all 64 requests
  2t    one process, one EngineCore, 2 threads, all 64 requests
  dp2   two processes started together, 1 thread each, each an EngineCore on half the groups
        (a group's G requests stay together, so each prompt is still prefilled once); the time is
        until both are done (started by a barrier after model build and warm-up)

It is a measurement, not an engine feature: a data-parallel engine would need shared-memory weights
(visible to the workers after in-place updates) and request routing by group.

    python benchmarks/data_parallel_probe.py [--reps 3] [--model 5m] [--matmul]

`--matmul` also times two 1-thread 256^3 matmul loops alone and together (is the second core there?)
and single decode-sized matmuls at 1 and 2 threads (how well torch splits one of them).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _engine_run(model, wl) -> tuple[float, list[list[int]]]:
    """A fresh EngineCore (default config) over `wl`: (wall seconds, generated tokens)."""
    from benchmarks.common import greedy_config, run_core
    from rollout import ContinuousBatchingConfig
    from rollout.engine.core import EngineCore

    _, wall, out = run_core(EngineCore(model, greedy_config(), ContinuousBatchingConfig()), wl)
    return wall, out


def _workload(model_name: str):
    from benchmarks.common import MODEL_SPECS, rl_workload

    return rl_workload(16, 4, MODEL_SPECS[model_name]["vocab_size"], (16, 160), (8, 128))


def _worker(rank: int, model_name: str, reps: int, barrier, queue) -> None:
    import torch

    torch.set_num_threads(1)
    from benchmarks.common import Workload, make_model

    model = make_model(model_name, "fp32")
    wl = _workload(model_name)
    groups = wl.num_requests // wl.group_size
    idx = [i for g in range(groups) if g % 2 == rank for i in range(g * wl.group_size, (g + 1) * wl.group_size)]
    half = Workload([wl.prompts[i] for i in idx], [wl.max_new[i] for i in idx], wl.group_size)
    _engine_run(model, half)  # NOTE: warm-up
    for _ in range(reps):
        barrier.wait()
        t0 = time.perf_counter()
        _, out = _engine_run(model, half)
        queue.put((rank, time.perf_counter() - t0, dict(zip(idx, out, strict=True))))


def _single(threads: int, model_name: str, reps: int) -> tuple[list[float], list[list[int]]]:
    import torch

    torch.set_num_threads(threads)
    from benchmarks.common import make_model

    model = make_model(model_name, "fp32")
    wl = _workload(model_name)
    _engine_run(model, wl)
    times, out = [], None
    for _ in range(reps):
        dt, out = _engine_run(model, wl)
        times.append(dt)
    return times, out


def _single_proc(threads, model_name, reps, queue):
    queue.put(_single(threads, model_name, reps))


def _matmul(n: int, seconds: float, queue) -> None:
    import torch

    torch.set_num_threads(1)
    a, b = torch.randn(n, n), torch.randn(n, n)
    for _ in range(10):
        a @ b
    t0, k = time.perf_counter(), 0
    while time.perf_counter() - t0 < seconds:
        a @ b
        k += 1
    queue.put(2 * n**3 * k / (time.perf_counter() - t0) / 1e9)


def _split_matmuls() -> list[str]:
    """One decode-sized matmul split by torch across 1 and 2 intra-op threads (us per call, median of 5 x 200)."""
    import torch

    lines = []
    for m, k, n in ((64, 256, 256), (64, 256, 768), (64, 256, 4096), (1024, 1024, 1024)):
        a, b = torch.randn(m, k), torch.randn(k, n)
        us = {}
        for threads in (1, 2):
            torch.set_num_threads(threads)
            calls = 200 if m < 1024 else 10
            for _ in range(10):
                a @ b
            reps = []
            for _ in range(5):
                t0 = time.perf_counter()
                for _ in range(calls):
                    a @ b
                reps.append((time.perf_counter() - t0) / calls * 1e6)
            us[threads] = statistics.median(reps)
        lines.append(f"torch.mm {m} x {k} x {n}: {us[1]:,.0f} us at 1 thread, {us[2]:,.0f} us at 2 "
                     f"({us[1] / us[2]:.2f}x)")
    return lines


def _split_matmuls_proc(queue) -> None:
    queue.put(_split_matmuls())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--model", default="5m")
    ap.add_argument("--matmul", action="store_true",
                    help="also: 1-thread 256^3 matmul loops, alone and two at once; one matmul at 1 and 2 threads")
    args = ap.parse_args()
    ctx = mp.get_context("spawn")
    print(f"load average {os.getloadavg()[0]:.2f}; model {args.model} fp32; reps {args.reps}", flush=True)
    if args.matmul:
        for procs in (1, 2):
            q = ctx.Queue()
            ps = [ctx.Process(target=_matmul, args=(256, 3.0, q)) for _ in range(procs)]
            [p.start() for p in ps]
            rates = [q.get() for _ in ps]
            [p.join() for p in ps]
            print(f"matmul 256^3, 1 thread, {procs} process(es) at once: {', '.join(f'{r:.1f}' for r in rates)} "
                  f"GFLOP/s (sum {sum(rates):.1f})", flush=True)
        q = ctx.Queue()
        p = ctx.Process(target=_split_matmuls_proc, args=(q,))
        p.start()
        print("\n".join(q.get()), flush=True)
        p.join()
    useful = _workload(args.model).useful_tokens
    results, outputs = {}, {}
    for threads in (1, 2):
        q = ctx.Queue()
        p = ctx.Process(target=_single_proc, args=(threads, args.model, args.reps, q))
        p.start()
        results[f"{threads}t"], outputs[f"{threads}t"] = q.get()
        p.join()
    q, barrier = ctx.Queue(), ctx.Barrier(2)
    ps = [ctx.Process(target=_worker, args=(r, args.model, args.reps, barrier, q)) for r in (0, 1)]
    [p.start() for p in ps]
    got = [q.get() for _ in range(2 * args.reps)]
    [p.join() for p in ps]
    per_rep: dict[int, list[float]] = {}
    merged: dict[int, list[int]] = {}
    for k, (_rank, dt, out) in enumerate(sorted(got, key=lambda x: x[0])):
        per_rep.setdefault(k % args.reps, []).append(dt)
        merged.update(out)
    results["dp2"] = [max(v) for v in per_rep.values()]
    outputs["dp2"] = [merged[i] for i in range(len(merged))]
    base = statistics.median(results["1t"])
    for name, times in results.items():
        med = statistics.median(times)
        print(f"{name:4s} wall {', '.join(f'{t:.2f}' for t in times)} s; median {med:.2f} s = {useful / med:,.0f} "
              f"useful tok/s = {base / med:.2f}x 1t", flush=True)
    same = all(outputs["dp2"][i] == outputs["1t"][i] == outputs["2t"][i] for i in range(len(outputs["1t"])))
    print(f"greedy outputs identical across 1t, 2t and dp2: {same}")


if __name__ == "__main__":
    main()
