"""Lossless speculative decoding (issues 44, 60): the same engine with and without `speculative_method="ngram"`
(suffix drafts, the cost model's gate), tokens compared, on these workloads:

  tail     the long tail of an RL step: `--tail-rows` rows x `--tail-tokens` new tokens after `--prompt-len`-token
           random prompts (at `--init 0.02` the 5M model's text repeats in part: runs, short cycles, breaks)
  lognorm  `--prompts` prompts x G=`--group`, prompts 64-256 tokens, completion lengths log-normal (median
           `--median`, sigma `--sigma`, capped at `--cap`): a batch that drains into a long few-row tail
  large    `--large-rows` rows x `--large-tokens` tokens: a wide batch (at `--init 0.3` text that never repeats),
           where speculation must not cost

Each repeat draws new prompts (seed `--seed` + repeat) and runs both engines on them, built and warmed up once
outside the timing, in lockstep: one step of each in turn (which first alternates per repeat), every step timed, a
system's seconds the sum of its steps' (wall, and CPU of this process), so a shared box's drifting load weighs on
both alike. Rows are greedy,
or with `--temperature T` sampled with a seed each (tokens must then be identical too: one draw per emitted token).
Reported per run: wall and CPU seconds, the speedup, engine steps, drafted / accepted tokens, what transformers'
prompt lookup (a fixed n-gram drafter: how much the text repeats) would keep of it, tokens identical, the load
average; then the medians of the speedups. A run whose tokens part from plain decoding stops the benchmark, unless
every parting is an fp32 tie (`parted`: the two tokens the model's fp64 top two, less than 1e-5 apart), which is
printed and counted.

    python benchmarks/speculation.py --model 5m --init 0.02 --workloads tail --repeats 4
"""

from __future__ import annotations

import argparse
import copy
import math
import os
import random
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
from common import Workload, greedy_config, machine_info, make_model  # noqa: E402
from transformers import GenerationConfig  # noqa: E402

from rollout import ContinuousBatchingConfig  # noqa: E402
from rollout.engine.core import EngineCore  # noqa: E402


def engine(model, spec_k: int, temperature: float) -> EngineCore:
    extra = dict(speculative_method="ngram", num_speculative_tokens=spec_k) if spec_k else {}
    gc = greedy_config() if not temperature else GenerationConfig(do_sample=True, temperature=temperature,
                                                                  top_k=0, eos_token_id=None, pad_token_id=0)
    core = EngineCore(model, gc, ContinuousBatchingConfig(page_size=32, return_logprobs=True, **extra))
    for i in range(2):  # NOTE: warm-up outside the timing, as a persistent engine in a training loop is
        core.add(core.make_request([5 + i] * 16, request_id=f"warmup_{i}", max_new_tokens=8))
    while core.has_work():
        core.step()
    return core


def run_pair(cores: dict[int, EngineCore], wl: Workload, tag: str, seeded: bool, first: int) -> dict:
    """Both engines over `wl` in lockstep, one step of each in turn (`first` steps first), each step timed: a
    system's time is the sum of its own steps', so a load that drifts on a shared box weighs on both alike.
    Returns per system (wall s, CPU s of this process, tokens, counters: drafted / accepted / generated tokens,
    engine steps)."""
    before = {k: dict(c.cache_stats()) for k, c in cores.items()}
    reqs = {k: [c.make_request(p, request_id=f"{tag}_{i}", max_new_tokens=n, **({"seed": 1000 + i} if seeded else {}))
                for i, (p, n) in enumerate(zip(wl.prompts, wl.max_new, strict=True))] for k, c in cores.items()}
    for k, c in cores.items():
        for r in reqs[k]:
            c.add(r)
    wall, cpu, steps = dict.fromkeys(cores, 0.0), dict.fromkeys(cores, 0.0), dict.fromkeys(cores, 0)
    order = sorted(cores, key=lambda k: k != first)
    while any(c.has_work() for c in cores.values()):
        for k in order:
            if cores[k].has_work():
                c0, w0 = time.process_time(), time.perf_counter()
                cores[k].step()
                wall[k] += time.perf_counter() - w0
                cpu[k] += time.process_time() - c0
                steps[k] += 1
    out = {}
    for k, c in cores.items():
        st = c.cache_stats()
        delta = {n: st[n] - before[k][n] for n in ("spec_draft_tokens", "spec_accepted_tokens", "generated_tokens")}
        delta["steps"] = steps[k]
        out[k] = (wall[k], cpu[k], [r.generated for r in reqs[k]], delta)
    return out


def partly_repeating(p: list[int], rng: random.Random, vocab: int, tail: int = 100, alphabet: int = 11) -> list[int]:
    """`p` with its last `tail` tokens (at most half of it) replaced by text that repeats only in part: pieces
    drawn from `alphabet` ids, each a run of one token (2-6), a short cycle (2-4 ids, 2-3 times) or a break
    (1-4 ids at random)."""
    ids = [rng.randrange(1, vocab) for _ in range(alphabet)]
    n = min(tail, len(p) // 2)
    out: list[int] = []
    while len(out) < n:
        kind = rng.random()
        if kind < 0.35:
            out += [rng.choice(ids)] * rng.randint(2, 6)
        elif kind < 0.7:
            out += [rng.choice(ids) for _ in range(rng.randint(2, 4))] * rng.randint(2, 3)
        else:
            out += [rng.choice(ids) for _ in range(rng.randint(1, 4))]
    return p[: len(p) - n] + out[:n]


def workload(name: str, args, vocab: int, seed: int) -> Workload:
    rng = random.Random(seed)

    def prompt(lo: int, hi: int) -> list[int]:
        p = [rng.randrange(1, vocab) for _ in range(rng.randint(lo, hi))]
        return p if args.prompt_kind == "random" else partly_repeating(p, rng, vocab)

    if name == "tail":
        n = args.tail_rows
        return Workload([prompt(args.prompt_len, args.prompt_len) for _ in range(n)], [args.tail_tokens] * n)
    if name == "lognorm":
        prompts, new = [], []
        for _ in range(args.prompts):
            p = prompt(64, 256)
            prompts += [p] * args.group
            new += [max(8, min(args.cap, round(rng.lognormvariate(math.log(args.median), args.sigma))))
                    for _ in range(args.group)]
        return Workload(prompts, new, args.group)
    if name == "large":
        return Workload([prompt(32, 64) for _ in range(args.large_rows)], [args.large_tokens] * args.large_rows)
    raise SystemExit(f"unknown workload {name!r}")


def part(a: list[int], b: list[int]) -> int | None:
    """The first token where `a` and `b` differ (None: none within the shorter)."""
    return next((j for j, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), None)


TIE = 1e-5  # NOTE: a gap between two logits (fp64) that fp32's rounding along a forward can reverse


@torch.inference_mode()
def parted(model, wl: Workload, plain: list[list[int]], spec: list[list[int]]) -> bool:
    """Where each differing row's speculative and plain tokens part, and the model's own top two logits there
    (a teacher-forced forward over the plain row, in fp64): a tie, or a gap of a rounding step, is numerics, not a
    bug. True when every parting is such a tie: the two tokens are the fp64 top two, less than `TIE` apart (on AMD
    EPYC family 26, a 100M fp32 tail's plain 4-row step took the second of two logits 2.9e-6 apart, which the plain
    engine alone, fp64 and the speculative step all ranked the other way)."""
    ref, ties = copy.deepcopy(model).double(), True
    for i, (a, b) in enumerate(zip(plain, spec, strict=True)):
        at = part(a, b)
        if at is None:
            continue
        logits = ref(torch.tensor([wl.prompts[i] + a[:at]], device=model.device)).logits[0, -1]
        top = logits.topk(2)
        gap = abs(logits[a[at]] - logits[b[at]]).item()
        tie = set(top.indices.tolist()) == {a[at], b[at]} and gap < TIE
        ties &= tie
        print(f"  row {i} parts at token {at}: plain {a[at]}, speculative {b[at]}; the model's top two (fp64) "
              f"{top.indices.tolist()}, gap {gap:.2e} at logit {top.values[0].item():.3f}"
              f"{': a tie at fp32 rounding' if tie else ''}", flush=True)
    del ref
    return ties


def prompt_lookup_kept(prompts: list[list[int]], outputs: list[list[int]], k: int = 10, n: int = 2) -> tuple[int, int]:
    """How much of this text transformers' own n-gram drafter would keep: (drafted, kept) over the rows when
    `PromptLookupCandidateGenerator` (prompt lookup, its defaults k 10, n 2: the first earlier occurrence of the
    longest suffix) drafts at each verifying step and greedy verification keeps the drafted tokens up to the first
    that differs from the plain output, then one token more, as assisted generation does. A measure of how much
    the text repeats, the same for every engine: a fixed drafter's acceptance, not the engine's."""
    from transformers.generation.candidate_generator import PromptLookupCandidateGenerator

    drafted = kept = 0
    for p, out in zip(prompts, outputs, strict=True):
        seq, end = p + out, len(p) + len(out)
        gen = PromptLookupCandidateGenerator(num_output_tokens=k, max_matching_ngram_size=n, max_length=end)
        at = len(p)
        while at < end:
            cand, _ = gen.get_candidates(torch.tensor([seq[:at]]))
            draft = cand[0, at:].tolist()[: end - at - 1]  # NOTE: the last token is the model's own
            m = part(draft, seq[at:])
            m = len(draft) if m is None else m
            drafted, kept, at = drafted + len(draft), kept + m, at + m + 1
    return drafted, kept


def load() -> str:
    return "load " + " ".join(f"{x:.1f}" for x in os.getloadavg())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="5m")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    ap.add_argument("--k", type=int, default=8, help="num_speculative_tokens")
    ap.add_argument("--tail-rows", type=int, default=4)
    ap.add_argument("--tail-tokens", type=int, default=400)
    ap.add_argument("--prompt-len", type=int, default=200)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--median", type=float, default=120)
    ap.add_argument("--sigma", type=float, default=0.8)
    ap.add_argument("--cap", type=int, default=800)
    ap.add_argument("--large-rows", type=int, default=32)
    ap.add_argument("--large-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--workloads", default="tail,lognorm,large")
    ap.add_argument("--seed", type=int, default=100)
    ap.add_argument("--prompt-kind", choices=("random", "partial"), default="random",
                    help="partial: each prompt's last 100 tokens repeat in part (`partly_repeating`)")
    ap.add_argument("--temperature", type=float, default=0.0, help="0: greedy; else sampled rows, seeded")
    ap.add_argument("--init", type=float, default=0.3,
                    help="initializer_range of the random model: 0.3 (the benchmarks' peaked logits) never repeats "
                         "itself; 0.02 (transformers' default) repeats in part at 5M and loops at 100M")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model = make_model(args.model, dtype=args.dtype, initializer_range=args.init)
    print(machine_info())
    print(f"model {args.model} {args.dtype} (initializer_range {args.init}), {args.threads} threads, k={args.k}, "
          f"prompts {args.prompt_kind}, "
          f"temperature {args.temperature}, seeds {args.seed}..{args.seed + args.repeats - 1}", flush=True)
    cores = {0: engine(model, 0, args.temperature), args.k: engine(model, args.k, args.temperature)}
    for name in args.workloads.split(","):
        wall_x, cpu_x, ties = [], [], 0
        for rep in range(args.repeats):
            wl = workload(name, args, model.config.vocab_size, args.seed + rep)
            results = run_pair(cores, wl, f"{name}{rep}", bool(args.temperature), 0 if rep % 2 == 0 else args.k)
            (w0, c0, out0, st0), (w1, c1, out1, st) = results[0], results[args.k]
            same = out0 == out1
            rate = st["spec_accepted_tokens"] / max(1, st["spec_draft_tokens"])
            ref_d, ref_k = prompt_lookup_kept(wl.prompts, out0)
            wall_x.append(w0 / w1)
            cpu_x.append(c0 / c1)
            print(f"{name} seed {args.seed + rep} [{wl.describe()}]: plain {w0:.2f} s ({c0:.2f} cpu s, "
                  f"{wl.useful_tokens / w0:.1f} tok/s), speculative {w1:.2f} s ({c1:.2f} cpu s, "
                  f"{wl.useful_tokens / w1:.1f} tok/s): {w0 / w1:.2f}x wall, {c0 / c1:.2f}x cpu; steps "
                  f"{st0['steps']} -> {st['steps']}; drafted {st['spec_draft_tokens']}, accepted "
                  f"{st['spec_accepted_tokens']} ({rate:.0%}); transformers' prompt lookup would keep {ref_k} of "
                  f"{ref_d} ({ref_k / max(1, ref_d):.0%}); tokens identical: {same}; {load()}", flush=True)
            if not same:
                if not parted(model, wl, out0, out1):
                    raise SystemExit(f"{name}: speculative tokens differ from plain decoding")
                ties += 1
        tied = f"; {ties} run(s) parted from plain decoding at an fp32 tie, tokens otherwise identical" if ties else ""
        print(f"{name}: median of {args.repeats}: {statistics.median(wall_x):.2f}x wall "
              f"(min {min(wall_x):.2f}), {statistics.median(cpu_x):.2f}x cpu (min {min(cpu_x):.2f}){tied}", flush=True)


if __name__ == "__main__":
    main()
