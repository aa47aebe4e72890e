"""Does ONE fullgraph `torch.compile` of the engine view's forward pay on this CPU? Measured.

`benchmarks/compile_levels.py` compiled the view with our paged attention excluded
(`torch.compiler.disable`): 12 graphs and 14 graph breaks per forward, no win. This one runs
`ContinuousBatchingConfig(default_compile_level=1)`, i.e. `rollout/model/compiled.py`: one graph per forward,
no graph break (the paged attention and the packed oneDNN linears are custom ops), dynamic token count.

It runs the RL workload of `throughput.py` through `EngineCore` (one engine per mode, kept alive across
runs as in RL training, the modes interleaved), checks greedy outputs of the compiled engine against
eager, and prints the first run (compilation included), the median of the timed runs, the graphs
compiled and the recompilations.

    python benchmarks/compile_fullgraph.py --model 5m --threads 1,2 --trainer-step
    python benchmarks/compile_fullgraph.py --model 100m --threads 2
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from common import (  # noqa: E402
    greedy_config,
    make_model,
    rl_workload,
    run_core,
    run_vllm,
    training_step,
    vllm_available,
)


def build(model, compiled: bool):
    from rollout import ContinuousBatchingConfig
    from rollout.engine.core import EngineCore

    return EngineCore(model, greedy_config(), ContinuousBatchingConfig(default_compile_level=int(compiled)))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="5m", choices=["5m", "100m"])
    p.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    p.add_argument("--threads", default="1,2")
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--group", type=int, default=4)
    p.add_argument("--prompt-len", type=int, nargs=2, default=[16, 160])
    p.add_argument("--completion-len", type=int, nargs=2, default=[8, 128])
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--trainer-step", action="store_true", help="deep copy + a training step first (throughput.py)")
    p.add_argument("--vllm", action="store_true", help="also vLLM-CPU in each rep (own process; common.run_vllm)")
    a = p.parse_args()
    from torch._dynamo.utils import counters

    threads = [int(t) for t in a.threads.split(",")]
    if a.vllm and not vllm_available():
        raise SystemExit("--vllm: vLLM-CPU's venv not found (common.VLLM_PYTHON)")
    model = make_model(a.model, a.dtype)
    wl = rl_workload(a.prompts, a.group, model.config.vocab_size, tuple(a.prompt_len), tuple(a.completion_len), seed=0)
    print(f"torch {torch.__version__}, {a.model} {a.dtype}, threads {threads}, {wl.describe()}", flush=True)
    if a.trainer_step:
        torch.set_num_threads(max(threads))
        print(f"trainer step: {training_step(model):.1f} s", flush=True)
    cores = {}
    outs = {}
    for t in threads:  # NOTE: inductor's C++ kernels are built for the thread count: one warm-up per count
        torch.set_num_threads(t)
        for mode in ("eager", "compiled"):
            counters.clear()
            if mode not in cores:
                cores[mode] = build(model, mode == "compiled")
            cpu, wall, out = run_core(cores[mode], wl)
            outs.setdefault(mode, out)
            graphs = counters["stats"].get("unique_graphs", 0)
            print(f"{mode:8s} first run at {t} thread(s) {wall:6.1f} s wall ({cpu:6.1f} s CPU); graphs compiled "
                  f"{graphs}, graph breaks {sum(counters['graph_break'].values())}", flush=True)
    same = sum(x == y for x, y in zip(outs["eager"], outs["compiled"], strict=True))
    print(f"greedy compiled == eager: {same}/{len(outs['eager'])}", flush=True)
    counters.clear()
    times: dict[tuple[str, int], list[float]] = {}
    for rep in range(a.reps):
        for t in (threads if rep % 2 == 0 else threads[::-1]):
            torch.set_num_threads(t)
            for mode in (("eager", "compiled") if rep % 2 == 0 else ("compiled", "eager")):
                _, wall, out = run_core(cores[mode], wl)
                times.setdefault((mode, t), []).append(wall)
                ok = out == outs["eager"]
                print(f"  rep {rep} {mode:8s} {t} thr wall {wall:6.2f} s ({wl.useful_tokens / wall:6.0f} tok/s) "
                      f"greedy {'same' if ok else 'DIFFERENT'} load {os.getloadavg()[0]:.2f}", flush=True)
            if a.vllm and t == max(threads):
                r = run_vllm(model, wl)
                times.setdefault(("vllm", t), []).append(r.seconds)
                same = sum(x == y for x, y in zip(r.outputs, outs["eager"], strict=True))
                print(f"  rep {rep} vllm     {t} thr wall {r.seconds:6.2f} s ({wl.useful_tokens / r.seconds:6.0f} "
                      f"tok/s) greedy == ours {same}/{len(r.outputs)} load {os.getloadavg()[0]:.2f}", flush=True)
    late = counters["stats"].get("unique_graphs", 0)
    print(f"graphs compiled during the timed runs (recompilations): {late}")
    print("\nmode     | threads | tok/s (median) | vs eager same threads | vs eager 1 thread")
    for (mode, t), ws in sorted(times.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        med = statistics.median(ws)
        e = statistics.median(times[("eager", t)])
        e1 = statistics.median(times[("eager", min(threads))]) if mode != "vllm" else float("nan")
        print(f"{mode:8s} | {t:7d} | {wl.useful_tokens / med:14.0f} | {e / med:20.2f}x | {e1 / med:.2f}x")
    for t in threads:
        if ("vllm", t) in times:
            v = statistics.median(times[("vllm", t)])
            print(f"{t} thread(s): ours / vLLM-CPU (medians): eager {v / statistics.median(times[('eager', t)]):.2f}x, "
                  f"compiled {v / statistics.median(times[('compiled', t)]):.2f}x")


if __name__ == "__main__":
    main()
