"""The CPU attention backends on the RL workload: `attn_backend` = cpu vs sdpa vs flex, one process.

Same model object and requests for each (benchmarks/throughput.py's RL shape: P prompts x G, prompts
16-160 tokens, completions 8-128 drawn per request, greedy, no EOS). Each backend first runs a
two-request warm-up (for flex that is the first compile: measured, with inductor's on-disk cache in
a fresh directory unless --warm-cache); the timed runs are interleaved (cpu, sdpa, flex, then
rotated) because the machine is shared. Greedy outputs are compared across backends first.

    python benchmarks/backends.py                     # 5M fp32, 16 prompts x G=4, 2 repetitions
    python benchmarks/backends.py --dtype bf16 --reps 1
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="5m")
    ap.add_argument("--dtype", default="fp32")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--group", type=int, default=4)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--backends", default="cpu,sdpa,flex")
    ap.add_argument("--warm-cache", action="store_true", help="keep inductor's on-disk cache (no cold compile)")
    ap.add_argument("--out", default=None, help="JSON results")
    args = ap.parse_args()
    if not args.warm_cache:  # NOTE: an entry point: set before torch is imported
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="inductor_")

    import torch

    from benchmarks.common import compare, make_model, rl_workload, run_ours
    from rollout import ContinuousBatchingConfig

    model = make_model(args.model, args.dtype)
    vocab = model.config.vocab_size
    wl = rl_workload(args.prompts, args.group, vocab, prompt_len=(16, 160), completion_len=(8, 128))
    names = args.backends.split(",")
    print(f"{args.model} {args.dtype}, {torch.get_num_threads()} threads: {wl.describe()}", flush=True)

    def run(name, workload):
        return run_ours(model, workload, ContinuousBatchingConfig(attn_backend=name))

    warm = {}
    for name in names:
        t0 = time.perf_counter()
        run(name, wl.subset([0, 1]))
        warm[name] = time.perf_counter() - t0
        print(f"warm-up {name}: {warm[name]:.1f} s", flush=True)
    times: dict[str, list[float]] = {n: [] for n in names}
    outputs = {}
    for rep in range(args.reps):
        order = names[rep % len(names):] + names[: rep % len(names)]
        for name in order:
            r = run(name, wl)
            times[name].append(r.seconds)
            outputs[name] = r.outputs
            print(f"rep {rep} {name}: {r.seconds:.2f} s, {wl.useful_tokens / r.seconds:.0f} tok/s", flush=True)
    base = names[0]
    result = {"model": args.model, "dtype": args.dtype, "threads": torch.get_num_threads(),
              "workload": wl.describe(), "warmup_seconds": warm, "backends": {}}
    for name in names:
        best = min(times[name])
        result["backends"][name] = {
            "seconds": times[name], "best_tokens_per_s": round(wl.useful_tokens / best, 1),
            "median_tokens_per_s": round(wl.useful_tokens / statistics.median(times[name]), 1),
            "vs_" + base: round(min(times[base]) / best, 3),
            "greedy_match_vs_" + base: compare(outputs[name], outputs[base])[0],
        }
    print(json.dumps(result, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
