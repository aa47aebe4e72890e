"""What the static decode step buys on a CPU: eager (the default) vs `default_compile_level=1` (the dynamic
whole-forward graph) vs `decode_compile_config=CompileConfig(fullgraph=True, dynamic=False)` (one inductor graph
per row bucket, `rollout.model.static_decode`).

Decode-heavy: N distinct prompts that all decode the same number of tokens (one bucket), greedy; each engine is
warmed on another draw of the same shapes first (its compiles excluded), then timed; repetitions interleaved.
Tokens are checked identical across systems before any speed is printed.

    python benchmarks/static_decode_cpu.py --model 5m --rows 16 --new 64 --reps 3
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
from transformers import CompileConfig  # noqa: E402

from benchmarks.common import decode_workload, greedy_config, make_model  # noqa: E402
from rollout import ContinuousBatchingConfig  # noqa: E402
from rollout.engine.core import EngineCore  # noqa: E402

SYSTEMS = {
    "eager": {},
    "compile_level_1": {"default_compile_level": 1},
    "static_inductor": {"decode_compile_config": CompileConfig(fullgraph=True, dynamic=False)},
}


def run(core: EngineCore, wl) -> tuple[float, list[list[int]]]:
    reqs = [core.make_request(p, request_id=f"q{time.monotonic_ns()}_{i}", max_new_tokens=n)
            for i, (p, n) in enumerate(zip(wl.prompts, wl.max_new, strict=True))]
    t0 = time.perf_counter()
    for r in reqs:
        core.add(r)
    while core.has_work():
        core.step()
    return time.perf_counter() - t0, [r.generated for r in reqs]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="5m")
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model = make_model(args.model)
    vocab = model.config.vocab_size
    warm, timed = (decode_workload(args.rows, vocab, 32, args.new, seed=s) for s in (1, 2))
    cores = {}
    for name, fields in SYSTEMS.items():
        t0 = time.perf_counter()
        cores[name] = EngineCore(model, greedy_config(), ContinuousBatchingConfig(**fields))
        run(cores[name], warm)
        print(f"{name}: warm-up (compiles) {time.perf_counter() - t0:.1f} s", flush=True)
    times = {name: [] for name in SYSTEMS}
    outputs = {}
    for rep in range(args.reps):
        order = list(SYSTEMS)[rep % len(SYSTEMS):] + list(SYSTEMS)[: rep % len(SYSTEMS)]
        for name in order:
            dt, out = run(cores[name], timed)
            times[name].append(dt)
            outputs.setdefault(name, out)
    same = {name: outputs[name] == outputs["eager"] for name in SYSTEMS}
    print("greedy identical to eager:", same)
    tokens = sum(timed.max_new)
    for name, ts in times.items():
        best = min(ts)
        print(f"{name:>16}: best {best:.3f} s, {tokens / best:,.0f} tok/s, {min(times['eager']) / best:.2f}x eager "
              f"(all: {', '.join(f'{t:.3f}' for t in ts)})")


if __name__ == "__main__":
    main()
