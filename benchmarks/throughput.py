"""Throughput: ours vs transformers' continuous batching vs padded `model.generate`, one process.

Same model object, same RL-like workload (P prompts x group G, prompt lengths and per-request completion
lengths drawn at random, no EOS: each request stops at its own max_new_tokens), greedy everywhere.
Before any speed is printed, the greedy outputs are checked against each other and against unbatched
`model.generate` on a subset (the match rate is printed). Only useful tokens count: a padded
`generate` row that runs past its own length earns nothing for those steps.

Runs are interleaved (ours, hf_cb, generate, then the next repetition in a rotated order) because
the machine is shared and noisy: read the ratios, not the absolute numbers.

Matmul FLOP/s (stated formula):
    useful FLOP = 2 * (P_body * sum_r (prompt_r + completion_r - 1) + P_head * sum_r completion_r)
with P_body the weights of every Linear inside the decoder layers and P_head the LM head's (it runs on
one row per sampled token). Attention score FLOPs are not counted. "executed" uses the tokens a system
actually ran (padding included for `generate`, prefix-cache hits excluded for ours). The peak is the
best `torch.matmul` 2048^3 in the same process, same thread count.

Examples:
    python benchmarks/throughput.py                      # quick: 5M fp32 G=4, < 2 min
    python benchmarks/throughput.py --model 5m --dtype bf16 --group 8
    python benchmarks/throughput.py --model 100m --prompts 4 --group 4
    python benchmarks/throughput.py --scaling            # ours: tok/s vs concurrency 1..256
    python benchmarks/throughput.py --hf-tune            # grid of transformers CB page/budget first
    python benchmarks/throughput.py --penalty-cost 1.1 --reps 3   # ours: repetition_penalty on every row vs none
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
import time
import warnings

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from benchmarks.common import (  # noqa: E402
    DTYPES,
    LABELS,
    SYSTEMS,
    VLLM_PYTHON,
    compare,
    decode_workload,
    divergence_margins,
    fp32_greedy_agreement,
    generate_one,
    machine_info,
    make_model,
    matmul_params,
    matmul_peak,
    num_params,
    rl_workload,
    rollout_version,
    run_hf_cb,
    timed,
    training_step,
    vllm_available,
)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=["5m", "100m"], default="5m")
    p.add_argument("--dtype", choices=list(DTYPES), default="fp32")
    p.add_argument("--group", type=int, default=4, help="G: samples per prompt")
    p.add_argument("--prompts", type=int, default=8, help="P: distinct prompts")
    p.add_argument("--prompt-len", type=int, nargs=2, default=(16, 512), metavar=("MIN", "MAX"))
    p.add_argument("--completion-len", type=int, nargs=2, default=(8, 256), metavar=("MIN", "MAX"))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--init-range", type=float, default=0.3, help="initializer_range (peaked logits, stable greedy)")
    p.add_argument("--systems", default="ours,hf_cb,generate")
    p.add_argument("--reps", type=int, default=1, help="timed repetitions of each system (interleaved)")
    p.add_argument("--threads", default="1",
                   help="torch intra-op threads, or a comma list (e.g. 1,2): every system runs at each count, "
                        "interleaved, and ratios compare systems at the same count; 0 = torch's default")
    p.add_argument("--trainer-step", action="store_true",
                   help="first, as a trainer's process has: deep-copy the model and run a training step "
                        "(forward, backward, AdamW) on the main thread, at the highest thread count")
    p.add_argument("--hf-page-size", type=int, default=32)
    p.add_argument("--hf-max-batch-tokens", type=int, default=512)
    p.add_argument("--hf-tune", action="store_true",
                   help="time transformers CB on a grid of page_size x max_batch_tokens first, keep the best")
    p.add_argument("--oracle", type=int, default=6, help="requests checked against unbatched generate")
    p.add_argument("--penalty-cost", type=float, default=None, metavar="PENALTY",
                   help="ours only: the RL workload with repetition_penalty=PENALTY on every row vs without")
    p.add_argument("--scaling", action="store_true", help="ours: tok/s vs concurrent requests (decode-heavy)")
    p.add_argument("--levels", default="1,4,16,64,256")
    p.add_argument("--scaling-prompt-len", type=int, default=32)
    p.add_argument("--scaling-new-tokens", type=int, default=128)
    p.add_argument("--scaling-systems", default="ours", help="comma list, e.g. ours,generate")
    p.add_argument("--json", help="write the results here")
    return p.parse_args(argv)


def quiet() -> None:
    warnings.filterwarnings("ignore")
    for name in ("transformers", "rollout", "ContinuousBatchingLogger"):
        logging.getLogger(name).setLevel(logging.ERROR)
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
    except Exception:
        pass


def fmt_rate(x: float) -> str:
    return f"{x:,.0f}"


def warmup(model, systems, hf_kwargs) -> None:
    """One tiny run of each system (first-call costs: allocator, oneDNN kernels, lazy imports)."""
    wl = rl_workload(2, 2, model.config.vocab_size, (16, 64), (4, 8), seed=123)
    for name in systems:
        if name == "vllm":  # NOTE: its own process, warmed up inside every run
            continue
        if name == "hf_cb":
            run_hf_cb(model, wl, **hf_kwargs)
        else:
            SYSTEMS[name](model, wl)


def tune_hf(model, wl, grid_pages=(16, 32, 64), grid_budget=(256, 512, 1024)) -> dict:
    """Time transformers CB on a small grid; returns the fastest {page_size, max_batch_tokens}."""
    best, best_kw = None, None
    for ps in grid_pages:
        for mbt in grid_budget:
            r = run_hf_cb(model, wl, page_size=ps, max_batch_tokens=mbt)
            rate = wl.useful_tokens / r.seconds
            print(f"  hf_cb page_size={ps:3d} max_batch_tokens={mbt:5d}: {fmt_rate(rate)} tok/s", flush=True)
            if best is None or rate > best:
                best, best_kw = rate, dict(page_size=ps, max_batch_tokens=mbt)
    print(f"  -> best {best_kw}", flush=True)
    return best_kw


def check_outputs(model, wl, results: dict, n_oracle: int) -> dict:
    """Match rates between systems (all requests) and against unbatched generate (a subset)."""
    names = list(results)
    report = {}
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            exact, prefix = compare(results[a].outputs, results[b].outputs)
            report[f"{a} vs {b}"] = (exact, prefix, wl.num_requests)
            if exact < 1 and b == "generate":
                report[f"{a} vs {b}: first divergences"] = divergence_margins(
                    model, wl, results[a].outputs, results[b].outputs)
    if next(model.parameters()).dtype != torch.float32:
        import copy

        ref = copy.deepcopy(model).float()
        for name in names:
            report[f"{name}: fp32 greedy agreement"] = fp32_greedy_agreement(model, wl, results[name].outputs, ref)
        del ref
    if n_oracle > 0:
        # distinct prompts first (one per group), then the shortest completions
        step = max(1, wl.group_size)
        idx = list(range(0, wl.num_requests, step))[:n_oracle]
        sub = wl.subset(idx)
        oracle = [generate_one(model, p, n) for p, n in zip(sub.prompts, sub.max_new, strict=True)]
        for name in names:
            got = [results[name].outputs[i] for i in idx]
            exact, prefix = compare(got, oracle)
            report[f"{name} vs unbatched generate"] = (exact, prefix, len(idx))
    return report


def thread_counts(args) -> list[int]:
    return [int(t) for t in str(args.threads).split(",") if t.strip()]


def key(name: str, threads: int, counts: list[int]) -> str:
    return name if len(counts) == 1 else f"{name}@{threads}"


def main_throughput(args, model) -> dict:
    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    if "vllm" in systems and not vllm_available():
        print(f"vllm: {VLLM_PYTHON} not found, system skipped", flush=True)
        systems.remove("vllm")
    counts = thread_counts(args)
    wl = rl_workload(args.prompts, args.group, model.config.vocab_size, tuple(args.prompt_len),
                     tuple(args.completion_len), seed=args.seed)
    print(f"workload: {wl.describe()}", flush=True)
    hf_kwargs = dict(page_size=args.hf_page_size, max_batch_tokens=args.hf_max_batch_tokens)
    if "hf_cb" in systems and args.hf_tune:
        print("tuning transformers CB on this workload:", flush=True)
        hf_kwargs = tune_hf(model, wl)
    if args.trainer_step:
        if max(counts):
            torch.set_num_threads(max(counts))
        print(f"trainer step on the main thread ({torch.get_num_threads()} threads): deep copy + "
              f"forward/backward/AdamW {training_step(model):.1f} s", flush=True)
    for t in counts:
        if t:
            torch.set_num_threads(t)
        warmup(model, systems, hf_kwargs)

    runs: dict[str, list] = {key(s, t, counts): [] for t in counts for s in systems}
    for rep in range(args.reps):
        order = systems[rep % len(systems):] + systems[: rep % len(systems)]
        for t in (counts if rep % 2 == 0 else counts[::-1]):
            if t:
                torch.set_num_threads(t)
            for name in order:
                r = timed(run_hf_cb, model, wl, **hf_kwargs) if name == "hf_cb" else timed(SYSTEMS[name], model, wl)
                k = key(name, t, counts)
                runs[k].append(r)
                print(f"  rep {rep} {k:16s} wall {r.seconds:7.2f} s ({fmt_rate(wl.useful_tokens / r.seconds)} useful "
                      f"tok/s)  cpu {r.cpu_seconds:7.2f} s ({fmt_rate(wl.useful_tokens / r.cpu_seconds)} useful tok/s) "
                      f" load {os.getloadavg()[0]:.2f}", flush=True)

    last = {name: rs[-1] for name, rs in runs.items()}
    checks = check_outputs(model, wl, last, args.oracle)
    return dict(workload=wl, runs=runs, checks=checks, hf_kwargs=hf_kwargs, systems=systems, counts=counts)


def print_throughput(res: dict, args, model, peaks: dict) -> list[dict]:
    wl, runs, checks = res["workload"], res["runs"], res["checks"]
    body, head = matmul_params(model)
    useful_flop = 2 * (
        body * sum(len(p) + n - 1 for p, n in zip(wl.prompts, wl.max_new, strict=True)) + head * wl.useful_tokens
    )
    peak_wall, peak_cpu = peaks[args.dtype]

    print(
        "\ngreedy output check (exact = whole completion identical; prefix = mean share before the first difference):"
    )
    for k, v in checks.items():
        if k.endswith("fp32 greedy agreement"):
            print(f"  {k}: {v['agree']:.2%} of {v['tokens']} tokens are the fp32 argmax given their own prefix; "
                  f"where not ({v['n_off']}), the fp32 logit gap is median {v['gap_median']:.3f}, max "
                  f"{v['gap_max']:.3f}")
            continue
        if k.endswith("first divergences"):
            print(f"    {k}: {v['n']} re-scored in fp32: |logit gap between the two tokens| median "
                  f"{v['gap_median']:.3f}, max {v['gap_max']:.3f} (median top-1 - top-2 margin over those sequences' "
                  f"positions {v['top2_gap_median']:.3f}); fp32 sides with the first system in "
                  f"{v['fp32_prefers_first']}/{v['n']}")
            continue
        exact, prefix, n = v
        print(f"  {k:34s} exact {exact:6.1%}  prefix {prefix:6.1%}  ({n} requests)")

    rows = []
    for name, rs in runs.items():
        wall = statistics.median(r.seconds for r in rs)
        cpu = statistics.median(r.cpu_seconds for r in rs)
        r = rs[-1]
        executed = None
        if r.executed_body_tokens is not None:
            executed = 2 * (body * r.executed_body_tokens + head * r.executed_head_rows) / cpu
        rows.append(
            dict(
                system=name,
                wall_s=wall,
                cpu_s=cpu,
                tok_s_wall=wl.useful_tokens / wall,
                tok_s_cpu=wl.useful_tokens / cpu,
                best_tok_s_wall=wl.useful_tokens / min(r.seconds for r in rs),
                useful_flops_cpu=useful_flop / cpu,
                useful_flops_wall=useful_flop / wall,
                executed_flops_cpu=executed,
                extra=r.extra,
            )
        )
    ref_name = res["systems"][0]  # NOTE: the first system is "ours" for the ratios
    counts = res["counts"]
    print(f"\n{args.model} {args.dtype}, G={args.group}: {wl.describe()}")
    print(f"matmul params: body {body:,} + head {head:,} (all params {num_params(model):,}); torch.matmul 2048^3 "
          f"{args.dtype} peak: {peak_cpu / 1e9:.1f} GFLOP/s per CPU-second ({peak_wall / 1e9:.1f} by wall clock)")
    print("tok/s = useful tokens / time; 'cpu' uses this process's CPU time (robust on a busy box), 'wall' the wall "
          "clock;\nGFLOP/s and % peak use CPU time; medians over --reps.")
    hdr = (f"{'system':36s} {'wall s':>7s} {'cpu s':>7s} {'tok/s wall':>10s} {'tok/s cpu':>10s} {'x ours wall':>11s} "
           f"{'x ours cpu':>10s} {'useful GFLOP/s':>14s} {'% peak':>7s} {'exec GFLOP/s':>12s}")
    print(hdr)
    print("-" * len(hdr))
    by_key = {row["system"]: row for row in rows}

    def ref_of(k: str) -> dict:
        t = k.split("@")[1] if "@" in k else None
        return by_key[ref_name if t is None else f"{ref_name}@{t}"]

    def label(k: str) -> str:
        name, _, t = k.partition("@")
        return LABELS[name] + (f" @{t}t" if t else "")

    for row in rows:
        ours = ref_of(row["system"])
        row["vs_ours_wall"] = row["tok_s_wall"] / ours["tok_s_wall"]
        row["vs_ours_cpu"] = row["tok_s_cpu"] / ours["tok_s_cpu"]
        row["pct_peak_cpu"] = row["useful_flops_cpu"] / peak_cpu
        ex = f"{row['executed_flops_cpu'] / 1e9:.2f}" if row["executed_flops_cpu"] else "-"
        print(f"{label(row['system']):36s} {row['wall_s']:7.2f} {row['cpu_s']:7.2f} {fmt_rate(row['tok_s_wall']):>10s} "
              f"{fmt_rate(row['tok_s_cpu']):>10s} {row['vs_ours_wall']:11.2f} {row['vs_ours_cpu']:10.2f} "
              f"{row['useful_flops_cpu'] / 1e9:14.2f} {row['pct_peak_cpu']:7.2%} {ex:>12s}")
    for row in rows:
        ours = ref_of(row["system"])
        if row is not ours:
            print(f"{ours['system']} / {row['system']}: {ours['tok_s_wall'] / row['tok_s_wall']:.2f}x (wall), "
                  f"{ours['tok_s_cpu'] / row['tok_s_cpu']:.2f}x (cpu time)")
    if len(counts) > 1:
        for name in res["systems"]:
            lo, hi = by_key[key(name, counts[0], counts)], by_key[key(name, counts[-1], counts)]
            print(f"{name} at {counts[-1]} threads / at {counts[0]}: {hi['tok_s_wall'] / lo['tok_s_wall']:.2f}x (wall)")
    return rows


def main_scaling(args, model, peaks) -> list[dict]:
    systems = [s.strip() for s in args.scaling_systems.split(",") if s.strip()]
    levels = [int(x) for x in args.levels.split(",")]
    body, head = matmul_params(model)
    warmup(model, systems, dict(page_size=args.hf_page_size, max_batch_tokens=args.hf_max_batch_tokens))
    print(f"\nscaling (decode-heavy): prompt {args.scaling_prompt_len} tokens, {args.scaling_new_tokens} new tokens "
          f"per request, all requests submitted at once")
    print("tok/s by CPU time (wall clock in brackets); GFLOP/s and % peak by CPU time")
    hdr = (f"{'concurrent':>10s} " + " ".join(f"{s + ' tok/s':>22s}" for s in systems)
           + f" {'ours GFLOP/s':>13s} {'% peak':>7s}")
    print(hdr)
    print("-" * len(hdr))
    out = []
    for c in levels:
        wl = decode_workload(
            c, model.config.vocab_size, args.scaling_prompt_len, args.scaling_new_tokens, seed=args.seed
        )
        flop = 2 * (
            body * sum(len(p) + n - 1 for p, n in zip(wl.prompts, wl.max_new, strict=True)) + head * wl.useful_tokens
        )
        row = dict(concurrency=c)
        for name in systems:
            r = (timed(run_hf_cb, model, wl, page_size=args.hf_page_size, max_batch_tokens=args.hf_max_batch_tokens)
                 if name == "hf_cb" else timed(SYSTEMS[name], model, wl))
            row[name] = wl.useful_tokens / r.cpu_seconds
            row[name + "_wall"] = wl.useful_tokens / r.seconds
            if name == "ours":
                row["ours_flops"] = flop / r.cpu_seconds
        out.append(row)
        f = row.get("ours_flops")
        print(
            f"{c:10d} "
            + " ".join(f"{fmt_rate(row[s]) + ' (' + fmt_rate(row[s + '_wall']) + ')':>22s}" for s in systems)
            + (f" {f / 1e9:13.2f} {f / peaks[args.dtype][1]:7.2%}" if f else ""),
            flush=True,
        )
    return out


def main(argv=None) -> None:
    args = parse_args(argv)
    quiet()
    counts = thread_counts(args)
    if counts[0]:
        torch.set_num_threads(counts[0])
    t_start = time.perf_counter()
    print(f"machine: {machine_info()}; load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    print(f"command: python benchmarks/throughput.py {' '.join(sys.argv[1:] if argv is None else argv)}")
    print(f"ours: {rollout_version()}")
    peaks = {"fp32": matmul_peak(torch.float32), "bf16": matmul_peak(torch.bfloat16)}
    print(f"torch.matmul 2048^3 peak (per CPU-second / by wall clock): fp32 {peaks['fp32'][1] / 1e9:.1f} / "
          f"{peaks['fp32'][0] / 1e9:.1f} GFLOP/s, bf16 {peaks['bf16'][1] / 1e9:.1f} / {peaks['bf16'][0] / 1e9:.1f} "
          "GFLOP/s",
          flush=True)
    model = make_model(args.model, args.dtype, seed=args.seed, initializer_range=args.init_range)
    print(f"model: Qwen3-arch {args.model} {args.dtype}, {num_params(model):,} params", flush=True)
    result: dict = dict(args=vars(args), machine=machine_info())
    if args.scaling:
        result["scaling"] = main_scaling(args, model, peaks)
    elif args.penalty_cost is not None:
        result["penalty_cost"] = main_penalty_cost(args, model)
    else:
        res = main_throughput(args, model)
        result["hf_kwargs"] = res["hf_kwargs"]
        result["checks"] = res["checks"]
        # NOTE: measure the peak again after the runs and keep the best (the box is shared).
        for k, dt in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
            again = matmul_peak(dt)
            peaks[k] = (max(peaks[k][0], again[0]), max(peaks[k][1], again[1]))
        result["rows"] = print_throughput(res, args, model, peaks)
    result["peaks"] = peaks
    print(f"\ntotal wall time {time.perf_counter() - t_start:.0f} s; load average "
          f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1, default=str)


def _run_core(model, wl, **processors) -> tuple[float, int]:
    """ours on `wl` (greedy, per-request budgets) with the given logits processors: (wall s, tokens)."""
    from benchmarks.common import greedy_config
    from rollout import ContinuousBatchingConfig
    from rollout.engine.core import EngineCore

    t0 = time.perf_counter()
    core = EngineCore(model, greedy_config(), ContinuousBatchingConfig())
    for i, (ids, n) in enumerate(zip(wl.prompts, wl.max_new, strict=True)):
        core.add(core.make_request(ids, request_id=f"req_{i}", max_new_tokens=n, **processors))
    while core.has_work():
        core.step()
    return time.perf_counter() - t0, core.cache_stats()["generated_tokens"]


def main_penalty_cost(args, model) -> dict:
    """The cost of the device-side penalty path: every row with `repetition_penalty` vs the default path,
    interleaved repetitions, best tok/s of each."""
    wl = rl_workload(args.prompts, args.group, model.config.vocab_size, tuple(args.prompt_len),
                     tuple(args.completion_len), seed=args.seed)
    print(f"workload: {wl.describe()}", flush=True)
    _run_core(model, wl)  # warm-up
    runs: dict[str, list[float]] = {"plain": [], "penalty": []}
    for _ in range(max(1, args.reps)):
        for name, kw in (("plain", {}), ("penalty", {"repetition_penalty": args.penalty_cost})):
            dt, tokens = _run_core(model, wl, **kw)
            runs[name].append(tokens / dt)
            print(f"  {name:8s} {tokens / dt:9.1f} tok/s ({dt:.2f} s)", flush=True)
    paired = statistics.median(p / q for p, q in zip(runs["penalty"], runs["plain"], strict=True))
    best = max(runs["penalty"]) / max(runs["plain"])
    print(f"repetition_penalty={args.penalty_cost} on every row (vocab {model.config.vocab_size}): {paired:.3f}x the "
          f"default path's tok/s (median of {len(runs['plain'])} adjacent pairs), {best:.3f}x best to best")
    return {"runs": runs, "paired_median": paired, "best_ratio": best}


if __name__ == "__main__":
    main()
