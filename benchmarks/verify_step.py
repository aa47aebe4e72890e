"""What a speculative step's verification costs against a plain decode step of the same rows (issue 60).

A verifying step runs each of B rows' last token and its k drafted tokens, B (1 + k) tokens, and keeps every
position's logits; on a weight-bound model it should cost little more than the plain step's B tokens. This
times, on one engine in one state (B rows decoding after `--prompt-len`-token prompts), interleaved round after
round (the order rotating), the step's forward and its sampler call (greedy, as the engine's greedy verification
makes it: one call over every position):

  plain        the decode-only step (B tokens: the paged kernel, the small-M linears)
  verify-old   B x (1 + k) tokens as before issue 60's second session: attention through sdpa's segments
               (`VERIFY_MAX_TOKENS = 0`), linears on oneDNN above `SMALL_ROWS = 32` tokens
  verify       B x (1 + k) tokens now: every token a query of the paged kernel (`verify_group`), linears on the
               small-M kernel up to `rollout.kernels.linear.SMALL_ROWS` tokens

Reported per (model, B, k): the median of each variant's wall and CPU times (ms; at 1 thread the CPU time is the
measure a shared box disturbs least), its ratio to plain's, and the load average. `--split` then runs plain and
verify again under cProfile and prints where a step's time goes by kernel (attention: the paged kernel; linears:
the small-M kernel, oneDNN and MKL calls; the other C++ kernels; the rest: Python and torch glue), per step and, for
verify, per drafted token above plain (cProfile slows the Python, so the rest reads high; the kernels' own times
do not move).
The steps write their K/V past each row's computed tokens and change no request, so the same state is timed
again and again (the draft tokens are random).

    python benchmarks/verify_step.py --model 100m --rows 4 --ks 2,4,8 --rounds 20
    python benchmarks/verify_step.py --model 5m --rows 4 --ks 1,4,8 --prompt-len 600 --split
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import random
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
from common import greedy_config, make_model  # noqa: E402

from rollout import ContinuousBatchingConfig  # noqa: E402
from rollout.attention.backends import cpu as cpu_backend  # noqa: E402
from rollout.engine.core import EngineCore  # noqa: E402
from rollout.kernels import linear  # noqa: E402
from rollout.scheduling.stages import ScheduledRequest, SchedulerOutput  # noqa: E402

OLD = {"VERIFY_MAX_TOKENS": 0, "SMALL_ROWS": 32}


def load() -> str:
    return " ".join(f"{x:.1f}" for x in os.getloadavg())


def decoding_core(model, rows: int, prompt_len: int, max_k: int, seed: int) -> EngineCore:
    """An engine with `rows` rows decoding (prompts computed, a few tokens generated), pages for `max_k` more."""
    core = EngineCore(model, greedy_config(), ContinuousBatchingConfig(page_size=32, return_logprobs=True))
    rng = random.Random(seed)
    vocab = model.config.vocab_size
    for i in range(rows):
        core.add(core.make_request([rng.randrange(1, vocab) for _ in range(prompt_len)], request_id=f"r{i}",
                                   max_new_tokens=1000))
    for _ in range(200):
        core.step()
        running = core.scheduler.running
        if len(running) == rows and all(len(r.generated) >= 4 for r in running):
            break
    tables = core.scheduler.tables
    for r in core.scheduler.running:
        tables.grow(r, r.num_computed_tokens + 1 + max_k)
    return core


def timed_step(core: EngineCore, drafts: list[list[int]] | None) -> tuple[float, float]:
    """(wall seconds, CPU seconds of this process) of one step's forward and sampler call."""
    reqs = list(core.scheduler.running)
    cfg = core.config
    t0, c0 = time.perf_counter(), time.process_time()
    if drafts is None:
        out = SchedulerOutput([ScheduledRequest(r, 1) for r in reqs], decode_only=True)
        logits = core.runner.execute(out)[0]
        per = reqs
    else:
        out = SchedulerOutput([ScheduledRequest(r, 1 + len(d)) for r, d in zip(reqs, drafts, strict=True)])
        logits = core.runner.execute(out, drafts)[0]
        per = [r for r, d in zip(reqs, drafts, strict=True) for _ in range(1 + len(d))]
    core.sampler(logits, [r.sampling for r in per], [r.request_id for r in per], cfg.logprobs_mode, requests=per,
                 top_mode=cfg.logprobs_mode)
    return time.perf_counter() - t0, time.process_time() - c0


KERNELS = {"attention": ("cascade_decode_attention", "paged_decode_attention", "decode_attention"),
           "linears": ("small_linear", "small_linears", "_C._nn.linear", "_linear_pointwise")}


def split(core: EngineCore, drafts: list[list[int]] | None, rounds: int) -> dict[str, float]:
    """Seconds a step by kernel family (`KERNELS`, then every other C++ builtin, then the rest), over `rounds`
    profiled steps."""
    for _ in range(3):  # NOTE: the variant's first calls (another route's threads and caches) outside the profile
        timed_step(core, drafts)
    prof = cProfile.Profile()
    t0 = time.perf_counter()
    prof.enable()
    for _ in range(rounds):
        timed_step(core, drafts)
    prof.disable()
    total = time.perf_counter() - t0
    out = dict.fromkeys([*KERNELS, "other kernels"], 0.0)
    for (_, _, name), (_, _, tottime, _, _) in ((key, value[:5]) for key, value in pstats.Stats(prof).stats.items()):
        fam = next((f for f, keys in KERNELS.items() if any(k in name for k in keys)), None)
        if fam is not None:
            out[fam] += tottime
        elif "rollout_cpu" in name:
            out["other kernels"] += tottime
    out["rest"] = total - sum(out.values())
    return {k: v / rounds for k, v in out.items()}


def set_path(values: dict) -> dict:
    old = {"VERIFY_MAX_TOKENS": cpu_backend.VERIFY_MAX_TOKENS, "SMALL_ROWS": linear.SMALL_ROWS}
    cpu_backend.VERIFY_MAX_TOKENS = values["VERIFY_MAX_TOKENS"]
    linear.SMALL_ROWS = values["SMALL_ROWS"]
    return old


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="100m")
    ap.add_argument("--init", type=float, default=0.02)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rows", default="4")
    ap.add_argument("--ks", default="2,4,8")
    ap.add_argument("--prompt-len", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--small-rows", type=int, default=0, help="also time verify with this SMALL_ROWS")
    ap.add_argument("--split", action="store_true", help="then where the time goes, by kernel (cProfile)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model = make_model(args.model, initializer_range=args.init)
    ks = [int(k) for k in args.ks.split(",")]
    new = {"VERIFY_MAX_TOKENS": cpu_backend.VERIFY_MAX_TOKENS, "SMALL_ROWS": linear.SMALL_ROWS}
    print(f"model {args.model}, {args.threads} threads, prompts {args.prompt_len}, rounds {args.rounds}; "
          f"verify: VERIFY_MAX_TOKENS={new['VERIFY_MAX_TOKENS']} SMALL_ROWS={new['SMALL_ROWS']}; load {load()}",
          flush=True)
    rng = random.Random(args.seed)
    for rows in [int(b) for b in args.rows.split(",")]:
        core = decoding_core(model, rows, args.prompt_len, max(ks), args.seed)
        variants = [("plain", None, new)]
        for k in ks:
            variants += [(f"verify-old k={k}", k, OLD), (f"verify k={k}", k, new)]
            if args.small_rows:
                variants.append((f"verify small{args.small_rows} k={k}", k, dict(new, SMALL_ROWS=args.small_rows)))
        times: dict[str, list[tuple[float, float]]] = {name: [] for name, _, _ in variants}
        for _, k, path in variants:  # NOTE: warm-up: panels, packed weights, first calls
            set_path(path)
            drafts = None if k is None else [[rng.randrange(1, 100) for _ in range(k)] for _ in range(rows)]
            timed_step(core, drafts)
        for rnd in range(args.rounds):
            order = variants[rnd % len(variants):] + variants[: rnd % len(variants)]
            for name, k, path in order:
                set_path(path)
                drafts = None if k is None else [[rng.randrange(1, 100) for _ in range(k)] for _ in range(rows)]
                times[name].append(timed_step(core, drafts))
        set_path(new)
        def med(name: str, i: int, times=times) -> float:
            return statistics.median(t[i] for t in times[name])

        base, base_cpu = med("plain", 0), med("plain", 1)
        line = [f"B={rows}: plain {base * 1e3:.1f} ms ({base_cpu * 1e3:.1f} cpu)"]
        for name, _, _ in variants[1:]:
            m, c = med(name, 0), med(name, 1)
            line.append(f"{name} {m * 1e3:.1f} ms ({m / base:.2f}x; cpu {c * 1e3:.1f}, {c / base_cpu:.2f}x)")
        print("; ".join(line) + f"; load {load()}", flush=True)
        if args.split:
            split(core, None, args.rounds)  # NOTE: once to settle the threads after the timed rounds' other routes
            base = split(core, None, args.rounds)
            print(f"  B={rows} plain, us a step: " + ", ".join(f"{n} {v * 1e6:.0f}" for n, v in base.items()))
            for k in ks:
                drafts = [[rng.randrange(1, 100) for _ in range(k)] for _ in range(rows)]
                got = split(core, drafts, args.rounds)
                print(f"  B={rows} verify k={k}, us a step (a drafted token): " + ", ".join(
                    f"{n} {v * 1e6:.0f} ({(v - base[n]) * 1e6 / (rows * k):+.1f})" for n, v in got.items()), flush=True)


if __name__ == "__main__":
    main()
