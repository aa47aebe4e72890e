"""Lossless n-gram speculative decoding (issue 44): the same engine with and without
`speculative_method="ngram"`, greedy tokens compared, on three workloads:

  tail    the long tail of an RL step: `--tail-rows` rows x `--tail-tokens` new tokens (short prompts), the
          decode batch small and memory-bound: where speculation pays
  rl      `--prompts` prompts x G=`--group` samples, prompt 64-256 tokens, completions 64-`--tail-tokens`, run
          twice on one persistent engine (two epochs of the same prompts: the second also drafts from the
          first's rollouts); the batch drains into a tail
  large   `--large-rows` rows x 64 tokens: a batch past the cost model's bound, where speculation must stay off
          (no slowdown)

Each engine is built and warmed up outside the timing; systems alternate per repeat. Reported: wall seconds and
CPU seconds of this process, tok/s, the speedup (wall and CPU), the engine steps (forwards) of each, drafted /
accepted tokens, greedy identical. On a box shared with other jobs the steps are the stable figure.

    python benchmarks/speculation.py --model 100m --threads 2
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
from common import Workload, greedy_config, machine_info, make_model  # noqa: E402

from rollout import ContinuousBatchingConfig  # noqa: E402
from rollout.engine.core import EngineCore  # noqa: E402


def engine(model, spec_k: int) -> EngineCore:
    extra = dict(speculative_method="ngram", num_speculative_tokens=spec_k) if spec_k else {}
    core = EngineCore(model, greedy_config(), ContinuousBatchingConfig(page_size=32, **extra))
    for i in range(2):  # NOTE: warm-up outside the timing, as a persistent engine in a training loop is
        core.add(core.make_request([5 + i] * 16, request_id=f"warmup_{i}", max_new_tokens=8))
    while core.has_work():
        core.step()
    return core


def run(core: EngineCore, wl: Workload, tag: str) -> tuple[float, float, list[list[int]], dict]:
    """(wall s, CPU s of this process, tokens, counters: drafted / accepted / generated tokens, engine steps)."""
    before = dict(core.cache_stats())
    reqs = [core.make_request(p, request_id=f"{tag}_{i}", max_new_tokens=n)
            for i, (p, n) in enumerate(zip(wl.prompts, wl.max_new, strict=True))]
    c0, w0 = time.process_time(), time.perf_counter()
    for r in reqs:
        core.add(r)
    steps = 0
    while core.has_work():
        core.step()
        steps += 1
    wall, cpu = time.perf_counter() - w0, time.process_time() - c0
    st = core.cache_stats()
    delta = {k: st[k] - before[k] for k in ("spec_draft_tokens", "spec_accepted_tokens", "generated_tokens")}
    delta["steps"] = steps
    return wall, cpu, [r.generated for r in reqs], delta


def workloads(args, vocab: int) -> dict[str, list[Workload]]:
    rng = random.Random(args.seed)

    def prompt(lo: int, hi: int) -> list[int]:
        return [rng.randrange(1, vocab) for _ in range(rng.randint(lo, hi))]

    tail = Workload([prompt(32, 64) for _ in range(args.tail_rows)], [args.tail_tokens] * args.tail_rows)
    rl_prompts, rl_new = [], []
    for _ in range(args.prompts):
        p = prompt(64, 256)
        rl_prompts += [p] * args.group
        rl_new += [rng.randint(64, args.tail_tokens) for _ in range(args.group)]
    rl = Workload(rl_prompts, rl_new, args.group)
    large = Workload([prompt(32, 64) for _ in range(args.large_rows)], [64] * args.large_rows)
    return {"tail": [tail], "rl": [rl, rl], "large": [large]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="100m")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    ap.add_argument("--tail-rows", type=int, default=4)
    ap.add_argument("--tail-tokens", type=int, default=400)
    ap.add_argument("--prompts", type=int, default=2)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--large-rows", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--workloads", default="tail,rl,large")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--init", type=float, default=0.3,
                    help="initializer_range of the random model: 0.3 (the benchmarks' peaked logits) never repeats "
                         "itself; 0.02 (transformers' default, what from_config gives a new user) falls into loops")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model = make_model(args.model, initializer_range=args.init)
    print(machine_info())
    print(f"model {args.model} (initializer_range {args.init}), {args.threads} threads, k={args.k}")
    wls = workloads(args, model.config.vocab_size)
    for name in args.workloads.split(","):
        for rep in range(args.repeats):
            order = (0, args.k) if rep % 2 == 0 else (args.k, 0)
            results = {}
            for k in order:
                core = engine(model, k)
                epochs = [run(core, wl, f"{name}{e}") for e, wl in enumerate(wls[name])]
                results[k] = epochs
                del core
            for e, wl in enumerate(wls[name]):
                (w0, c0, out0, st0), (w1, c1, out1, st) = results[0][e], results[args.k][e]
                same = out0 == out1
                rate = st["spec_accepted_tokens"] / max(1, st["spec_draft_tokens"])
                print(f"{name}{'' if len(wls[name]) == 1 else f' epoch {e + 1}'} [{wl.describe()}]: "
                      f"plain {w0:.2f} s ({c0:.2f} cpu s, {wl.useful_tokens / w0:.1f} tok/s), "
                      f"speculative {w1:.2f} s ({c1:.2f} cpu s, {wl.useful_tokens / w1:.1f} tok/s): "
                      f"{w0 / w1:.2f}x wall, {c0 / c1:.2f}x cpu; steps {st0['steps']} -> {st['steps']}; drafted {st['spec_draft_tokens']}, accepted "
                      f"{st['spec_accepted_tokens']} ({rate:.0%}); greedy identical: {same}", flush=True)
                if not same:
                    raise SystemExit(f"{name}: speculative greedy tokens differ from plain decoding")


if __name__ == "__main__":
    main()
