"""How far suffix drafts can take a tail at most (issue 60): the text's own limit, before any verification cost.

A tail lasts as long as its slowest row. This generates the tail of `benchmarks/speculation.py` (the same workload
and seeds: `--rows` rows x `--tokens` greedy tokens after `--prompt-len`-token prompts, `--prompt-kind`) with the
plain engine, then replays each row's text through `rollout.sampling.drafts.Drafter` as the speculator would
call it (the row's own tokens as its source: these rows have no siblings and no earlier rollouts), with
**free verification**: every drafted token checked, up to `--k` a step, no cost model. Reported per row:

  steps      steps the row would take with every draft verified for free (the plain engine takes `--tokens`)
  kept       drafted tokens kept / drafted
  next-hit   the share of positions whose next token is the one that followed the longest earlier match of the
             context (any length up to 32, the row's own text): what any drafter reading this text could hope for
  distinct   distinct ids among the generated tokens

and per seed the bound on the tail's speedup, `--tokens` / the slowest row's steps: no lossless suffix drafter
over this text, at any verification cost, does better than that on this tail. With `--price C`, also the tail's
speedup if each drafted token cost C of a step (lockstep: a step costs 1 + C x the tokens drafted in it), for drafts
cut at k tokens and at estimates below a floor (`--ks`, `--min-probs`): what drafting could win at that price,
before the speculative step's own overhead. With `--overhead F` too, the speculator's own planning
(`planned`): the rows in lockstep through `Speculator.plan` itself (its drafter, idle spells, per-row
calibration and `StepCost.plan`, with the fit fixed at a drafted token = C of a step and a speculative step's own
cost F), a step costing 1, or 1 + F + C x the tokens it verifies: the tail's speedup the engine would reach if
those were the step's true costs (on this box the online fit settles near C = 0.028, F = 0.05-0.10 at 4 rows of
the 5M model) -- the quick way to judge a drafter or planning change before an engine run.

    python benchmarks/draft_bound.py --model 100m --init 0.025 --prompt-kind partial --seeds 722,723
    python benchmarks/draft_bound.py --seeds 600,601,602,603 --price 0.028 --overhead 0.05 --ks 8 --min-probs 0
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from types import SimpleNamespace

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import speculation  # noqa: E402
import torch  # noqa: E402
from common import machine_info, make_model, step_to_end  # noqa: E402

from rollout.sampling.drafts import DEFAULT_NGRAM, Drafter  # noqa: E402


def replay(prompt: list[int], gen: list[int], k: int, min_prob: float = 0.0) -> list[tuple[int, int]]:
    """(drafted, kept) of each step of one row replayed with every draft verified for free; drafts stop at `k`
    tokens or where the drafter's estimate falls below `min_prob` (as the speculator's cost model cuts them)."""
    t, out = 0, []
    drafter = Drafter()
    while t < len(gen):
        row = SimpleNamespace(request_id="row", prompt_ids=prompt, token_ids=prompt + gen[:t], generated=gen[:t])
        toks, _ = drafter.draft(row, min(k, len(gen) - t - 1), DEFAULT_NGRAM, min_prob)
        drafter.own.clear()  # NOTE: the row's tokens list is rebuilt each step: index it afresh
        drafter.groups.clear()
        n = 0
        while n < len(toks) and toks[n] == gen[t + n]:
            n += 1
        out.append((len(toks), n))
        t += 1 + n
    return out


def free_verify(prompt: list[int], gen: list[int], k: int) -> tuple[int, int, int]:
    """(steps, drafted, kept) of one row replayed with every draft verified for free."""
    steps = replay(prompt, gen, k)
    return len(steps), sum(d for d, _ in steps), sum(n for _, n in steps)


def priced(rows: list[list[tuple[int, int]]], tokens: int, price: float) -> float:
    """The tail's speedup when a step costs 1 + `price` x the tokens drafted in it (all rows), lockstep: `tokens`
    plain steps against the replayed ones."""
    cost = sum(1 + price * sum(r[j][0] for r in rows if j < len(r)) for j in range(max(map(len, rows))))
    return tokens / cost


def planned(rows: list[tuple[list[int], list[int]]], price: float, overhead: float, k: int) -> tuple[float, int, int]:
    """(the tail's speedup, tokens drafted, tokens kept) with the speculator's own planning over `rows` ((prompt,
    greedy text) each, in lockstep): `Speculator.plan` on request-like rows, its cost model's fit fixed (a drafted
    token `price` of a plain step, a speculative step's own cost `overhead`), each row's calibration recorded by
    `Speculator.calibrate`, as a verifying step does. A step costs 1, or 1 + `overhead` + `price` x the tokens it
    verifies."""
    from rollout.engine.speculation import Calibration, Speculator, StepCost

    spec = object.__new__(Speculator)  # NOTE: its planning state only: no engine, no model
    spec.k, spec.max_rows, spec.drafter, spec.calibration = k, None, Drafter(), Calibration()
    spec.steps, spec.width, spec.idle, spec.estimates, spec.room = 0, 0, {}, [], None
    spec.native_plan = False  # NOTE: the Python planning (the C++ one proposes the same drafts)
    spec.cost = StepCost(1.0, 0.0)
    spec.cost.share = lambda _rows: price
    spec.cost.c0, spec.cost.c1 = 1.0 + overhead, 1.0
    sampling = SimpleNamespace(prompt_lookup_num_tokens=None, max_matching_ngram_size=None)
    reqs = [SimpleNamespace(request_id=f"row{i}", prompt_ids=list(p), token_ids=list(p), generated=[], routes=None,
                            max_new_tokens=len(g), sampling=sampling) for i, (p, g) in enumerate(rows)]
    cost, drafted, kept = 0.0, 0, 0
    while live := [i for i, r in enumerate(reqs) if len(r.generated) < len(rows[i][1])]:
        spec.steps += 1
        drafts = spec.plan([reqs[i] for i in live])
        n = sum(map(len, drafts)) if drafts is not None else 0
        cost += 1.0 + (overhead + price * n if n else 0.0)
        drafted += n
        if not n:
            drafts = [[] for _ in live]
        taken = []
        for i, d in zip(live, drafts, strict=True):
            req, gen = reqs[i], rows[i][1]
            at, m = len(req.generated), 0
            while m < len(d) and at + m < len(gen) - 1 and d[m] == gen[at + m]:
                m += 1
            new = gen[at : at + m + 1]
            req.token_ids += new  # NOTE: in place: the drafter's index reads this list
            req.generated += new
            taken.append(m)
        if n:
            spec.calibrate([reqs[i] for i in live], drafts, taken)
        kept += sum(taken)
    return max(len(g) for _, g in rows) / cost, drafted, kept


def next_hit(prompt: list[int], gen: list[int], longest: int = 32) -> float:
    """Share of generated positions whose token followed the latest longest earlier match of its context."""
    ctx, hits = prompt + gen, 0
    for t in range(len(prompt), len(ctx)):
        for n in range(min(longest, t - 1), 0, -1):
            suffix = ctx[t - n : t]
            follow = next((ctx[p] for p in range(t - 1, n - 1, -1) if ctx[p - n : p] == suffix), None)
            if follow is not None:
                hits += follow == ctx[t]
                break
    return hits / len(gen)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="5m")
    ap.add_argument("--init", type=float, default=0.02)
    ap.add_argument("--prompt-kind", choices=("random", "partial"), default="random")
    ap.add_argument("--seeds", default="102,103,104")
    ap.add_argument("--rows", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=400)
    ap.add_argument("--prompt-len", type=int, default=200)
    ap.add_argument("--k", type=int, default=8)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--price", type=float, default=0.0,
                    help="also print the tail's speedup when each drafted token costs this share of a step (e.g. 0.03: "
                         "a 4-row 5M step on this CPU), for every --ks x --min-probs")
    ap.add_argument("--overhead", type=float, default=None,
                    help="with --price: also the speedup with the speculator's own planning, a speculative step "
                         "costing 1 + this + price x its drafted tokens (e.g. 0.05)")
    ap.add_argument("--ks", default="2,4,8")
    ap.add_argument("--min-probs", default="0,0.4,0.5")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    model = make_model(a.model, initializer_range=a.init)
    print(machine_info())
    print(f"model {a.model} (initializer_range {a.init}), prompts {a.prompt_kind}, {a.rows} rows x {a.tokens} tokens, "
          f"k={a.k}, free verification", flush=True)
    core = speculation.engine(model, 0, 0.0)
    args = SimpleNamespace(prompt_kind=a.prompt_kind, tail_rows=a.rows, tail_tokens=a.tokens, prompt_len=a.prompt_len)
    plans = []
    for seed in (int(s) for s in a.seeds.split(",")):
        wl = speculation.workload("tail", args, model.config.vocab_size, seed)
        reqs = [core.make_request(p, request_id=f"s{seed}_{i}", max_new_tokens=n)
                for i, (p, n) in enumerate(zip(wl.prompts, wl.max_new, strict=True))]
        step_to_end(core, reqs)
        worst = 0
        for i, (p, r) in enumerate(zip(wl.prompts, reqs, strict=True)):
            steps, drafted, kept = free_verify(list(p), list(r.generated), a.k)
            worst = max(worst, steps)
            print(f"  seed {seed} row {i}: steps {steps}, kept {kept} / {drafted} ({kept / max(1, drafted):.0%}), "
                  f"next-hit {next_hit(list(p), list(r.generated)):.0%}, distinct {len(set(r.generated))}", flush=True)
        print(f"seed {seed}: slowest row {worst} steps: the tail's bound {a.tokens / worst:.2f}x", flush=True)
        if a.price:
            rows = [(list(p), list(r.generated)) for p, r in zip(wl.prompts, reqs, strict=True)]
            for k in (int(x) for x in a.ks.split(",")):
                line = [f"{priced([replay(p, g, k, m) for p, g in rows], a.tokens, a.price):.2f}x at p >= {m}"
                        for m in (float(x) for x in a.min_probs.split(","))]
                print(f"  priced {a.price} a drafted token, k={k}: " + ", ".join(line), flush=True)
                if a.overhead is not None:
                    x, drafted, kept = planned(rows, a.price, a.overhead, k)
                    plans.append(x)
                    print(f"  planned as the speculator plans (price {a.price}, overhead {a.overhead}), k={k}: "
                          f"{x:.2f}x, kept {kept} / {drafted} ({kept / max(1, drafted):.0%})", flush=True)
    if plans:
        print(f"planned: median of {len(plans)} {statistics.median(plans):.2f}x (min {min(plans):.2f}x)")


if __name__ == "__main__":
    main()
