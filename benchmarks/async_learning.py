"""Does async GRPO (max_staleness 1) learn like synchronous GRPO? The embedded demo over several seeds (issue 47).

For each seed, `recipes/grpo.py` is run twice from the same warm start -- synchronous, and with
`--async_rollout --max_staleness 1` -- with any extra recipe flags (`--extra "--iterations 1 --minibatches 1"`)
given to both; runs already in `--runs_dir` are reused. Then one plot (reward per step, 25-step means; thin
lines per seed, thick the mean over seeds) and a table: reward first 5 / last 5 steps and their rise, the
mean of the last 50 steps, held-out greedy exact before / after, staleness, and the async - sync difference
per seed against the spread of the synchronous runs across seeds (the noise a difference is read against).

    python benchmarks/async_learning.py --seeds 0,1,2 --runs_dir runs/async_learning
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODES = {"sync": [], "async": ["--async_rollout", "--max_staleness", "1"]}
WINDOW = 25


def run_demo(out: str, seed: int, extra: list[str], mode: str) -> None:
    if os.path.exists(os.path.join(out, "summary.json")):
        return
    cmd = [os.path.join(os.path.dirname(sys.executable), "accelerate"), "launch", "--config_file",
           os.path.join(ROOT, "recipes/accelerate/local.yaml"), os.path.join(ROOT, "recipes/grpo.py"),
           "--seed", str(seed), "--output_dir", out, *MODES[mode], *extra]
    print("+", " ".join(cmd), flush=True)
    with open(out + ".log", "w") as log:
        subprocess.run(cmd, check=True, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)


def load(out: str) -> dict:
    records = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
    summary = json.load(open(os.path.join(out, "summary.json")))
    rewards = [r["reward_mean"] for r in records]
    return dict(rewards=rewards, first5=sum(rewards[:5]) / 5, last5=sum(rewards[-5:]) / 5,
                last50=sum(rewards[-50:]) / 50, rise=summary["reward_rise"],
                exact_before=summary["greedy_before"]["exact"], exact_after=summary["greedy_after"]["exact"],
                staleness=sum(r.get("staleness_mean", 0.0) for r in records) / len(records),
                approx_kl=sum(r.get("approx_kl", 0.0) for r in records) / len(records),
                wall=summary["wall_time_s"])


def windows(values: list[float]) -> list[float]:
    return [sum(values[i:i + WINDOW]) / len(values[i:i + WINDOW]) for i in range(0, len(values), WINDOW)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--runs_dir", default="runs/async_learning")
    ap.add_argument("--extra", default="", help="recipe flags for both modes, e.g. '--iterations 1 --minibatches 1'")
    ap.add_argument("--tag", default="", help="a name for this variant's runs and plot")
    args = ap.parse_args()
    seeds = [int(s) for s in args.seeds.split(",")]
    os.makedirs(args.runs_dir, exist_ok=True)
    results = {}
    for seed in seeds:
        for mode in MODES:
            out = os.path.join(args.runs_dir, f"{mode}{args.tag}_s{seed}")
            run_demo(out, seed, shlex.split(args.extra), mode)
            results[mode, seed] = load(out)
    print(f"{'run':>10} {'first5':>7} {'last5':>7} {'rise':>7} {'last50':>7} {'exact before->after':>20} "
          f"{'staleness':>9} {'approx_kl':>9} {'wall s':>7}")
    for (mode, seed), r in results.items():
        print(f"{mode + ' s' + str(seed):>10} {r['first5']:7.3f} {r['last5']:7.3f} {r['rise']:+7.3f} "
              f"{r['last50']:7.3f} {r['exact_before']:9.3f} -> {r['exact_after']:.3f} {r['staleness']:9.2f} "
              f"{r['approx_kl']:9.3f} {r['wall']:7.0f}")
    stats = {}
    for key in ("rise", "last50", "exact_after"):
        sync = [results["sync", s][key] for s in seeds]
        diff = [results["async", s][key] - results["sync", s][key] for s in seeds]
        sd = statistics.stdev(sync) if len(sync) > 1 else float("nan")
        stats[key] = dict(sync_mean=statistics.mean(sync), sync_sd_across_seeds=sd,
                          async_mean=statistics.mean(results["async", s][key] for s in seeds),
                          diff_per_seed=diff, diff_mean=statistics.mean(diff))
        print(f"{key}: sync {stats[key]['sync_mean']:.3f} (sd across seeds {sd:.3f}), async "
              f"{stats[key]['async_mean']:.3f}; async - sync per seed {' '.join(f'{d:+.3f}' for d in diff)} "
              f"(mean {stats[key]['diff_mean']:+.3f})")
    with open(os.path.join(args.runs_dir, f"summary{args.tag}.json"), "w") as f:
        json.dump(dict(args=vars(args), stats=stats,
                       runs={f"{m}_s{s}": {k: v for k, v in r.items() if k != "rewards"}
                             for (m, s), r in results.items()}), f, indent=1)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for i, mode in enumerate(MODES):
        curves = [windows(results[mode, s]["rewards"]) for s in seeds]
        x = [WINDOW * (k + 0.5) for k in range(len(curves[0]))]
        for c in curves:
            ax.plot(x, c, color=f"C{i}", lw=0.7, alpha=0.5)
        mean = [statistics.mean(v) for v in zip(*curves, strict=False)]
        label = "synchronous" if mode == "sync" else "async, max_staleness 1"
        ax.plot(x, mean, color=f"C{i}", lw=2.5, marker="o", label=f"{label} (mean of {len(seeds)} seeds)")
    ax.set(xlabel="step", ylabel=f"reward ({WINDOW}-step mean)",
           title=f"embedded GRPO demo, sync vs async {args.extra}".strip())
    ax.legend()
    path = os.path.join(args.runs_dir, f"reward_sync_vs_async{args.tag}.png")
    fig.savefig(path, dpi=120, bbox_inches="tight")
    print(f"plot: {path}")


if __name__ == "__main__":
    main()
