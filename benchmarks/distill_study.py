"""Why on-policy distillation does or does not pay on the embedded addition task (issue 41 item 6).

From the GRPO demo's warm start (the student), `recipes/distill.py`'s trainer is run against two teachers --
the GRPO demo's result (`--weak_teacher`, held-out exact ~0.5) and the same architecture supervised to ~0.9
(`build_warm_start(target_exact=0.9)`, built once into the warm-start cache) -- at several learning rates,
and GRPO (the demo's settings) from the same warm start for longer, all evaluated alike (greedy exact match on
the same 512 held-out problems every 10 steps). One plot (held-out exact against steps, teachers and 90% of
them as lines) and a summary: for each distillation run the first step at >= 90% of its teacher, and the step
GRPO first reaches the same exact match.

    python benchmarks/distill_study.py --weak_teacher runs/grpo/final --student runs/grpo/init \
        --output_dir runs/distill_study
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "recipes"))

import torch  # noqa: E402
from _common import build_warm_start, make_accelerator, warm_start_cache_dir  # noqa: E402
from distill import GRPO_SETTINGS, HELDOUT, DistillTrainer, GRPOBaseline, run  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from trainers.tasks import AdditionTask, greedy_accuracy  # noqa: E402

STRONG = dict(seed=0, target_exact=0.9, max_sft_steps=6000)


def strong_teacher() -> str:
    path = warm_start_cache_dir(**STRONG)
    if not os.path.exists(os.path.join(path, "config.json")):
        build_warm_start(path, **STRONG)
    return path


def first_at(curve, target):
    return next((s for s, e in curve if e >= target), None)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--weak_teacher", required=True, help="the GRPO demo's final/ (runs/grpo/final)")
    ap.add_argument("--student", required=True, help="the GRPO demo's warm start (runs/grpo/init)")
    ap.add_argument("--teachers", default="weak,strong")
    ap.add_argument("--lrs", default="5e-4,2e-3")
    ap.add_argument("--advantages", default="raw", help="comma-separated: raw, normalized, clipped, full_kl (the "
                    "exact reverse KL loss instead of sampled advantages)")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--grpo_steps", type=int, default=200)
    ap.add_argument("--prompts_per_step", type=int, default=32)
    ap.add_argument("--group_size", type=int, default=4)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--output_dir", default="runs/distill_study")
    ap.add_argument("--include", nargs="*", default=[],
                    help="earlier runs' summary.json files whose curves join this run's table and plot")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    os.makedirs(args.output_dir, exist_ok=True)
    accelerator = make_accelerator()
    tokenizer = AutoTokenizer.from_pretrained(args.student)
    task = AdditionTask(num_digits=3)
    dataset = task.to_dataset(8192, seed=1000 + args.seed)
    teachers = {"weak": args.weak_teacher, "strong": None}
    exact = {"student": greedy_accuracy(AutoModelForCausalLM.from_pretrained(args.student), tokenizer, task,
                                        n=HELDOUT)["exact"]}
    curves, walls = {}, {}
    for path in args.include:
        earlier = json.load(open(path))
        exact.update(earlier["exact"])
        curves.update({k: [tuple(p) for p in c] for k, c in earlier["curves"].items()})
        walls.update(earlier["wall_seconds"])
    for name in filter(None, args.teachers.split(",")):
        path = teachers[name] or strong_teacher()
        teacher = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        exact[name] = greedy_accuracy(teacher, tokenizer, task, n=HELDOUT)["exact"]
        print(f"teacher {name} ({path}): held-out exact {exact[name]:.3f}", flush=True)
        for lr, adv in [(lr, adv) for lr in args.lrs.split(",") for adv in args.advantages.split(",")]:
            run_args = argparse.Namespace(steps=args.steps, prompts_per_step=args.prompts_per_step,
                                          group_size=args.group_size, lr=float(lr), seed=args.seed)
            key = f"distill {name} lr {lr} {adv}"
            curves[key], walls[key] = run(DistillTrainer, accelerator, run_args, args.student, tokenizer, dataset,
                                          os.path.join(args.output_dir, key.replace(" ", "_")), teacher=teacher,
                                          advantages="raw" if adv == "full_kl" else adv,
                                          loss="full_kl" if adv == "full_kl" else "sampled")
            print(f"{key}: {' '.join(f'{s}:{e:.3f}' for s, e in curves[key])} ({walls[key]:.0f} s)", flush=True)
    if args.grpo_steps:
        run_args = argparse.Namespace(steps=args.grpo_steps, prompts_per_step=args.prompts_per_step,
                                      group_size=GRPO_SETTINGS["group_size"], lr=GRPO_SETTINGS["learning_rate"],
                                      seed=args.seed)
        curves["grpo"], walls["grpo"] = run(GRPOBaseline, accelerator, run_args, args.student, tokenizer, dataset,
                                            os.path.join(args.output_dir, "grpo"), settings=GRPO_SETTINGS)
        print(f"grpo: {' '.join(f'{s}:{e:.3f}' for s, e in curves['grpo'])} ({walls['grpo']:.0f} s)", flush=True)
    reach = {}
    for key, curve in curves.items():
        if key == "grpo":
            continue
        target = 0.9 * exact[key.split()[1]]
        reach[key] = dict(target=target, distill_step=first_at(curve, target),
                          grpo_step=first_at(curves.get("grpo", []), target))
        print(f"{key}: >= {target:.3f} (90% of its teacher) at step {reach[key]['distill_step']}; "
              f"GRPO at step {reach[key]['grpo_step']}", flush=True)
    with open(os.path.join(args.output_dir, "summary.json"), "w") as f:
        json.dump(dict(exact=exact, curves=curves, wall_seconds=walls, reach=reach, args=vars(args)), f, indent=1)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for key, c in curves.items():
        ax.plot([s for s, _ in c], [e for _, e in c], marker="o", ms=3, label=f"{key} ({walls[key]:.0f} s)",
                color="k" if key == "grpo" else None, lw=2 if key == "grpo" else 1)
    for i, name in enumerate(n for n in ("weak", "strong") if n in exact):
        ax.axhline(exact[name], color=f"C{7 + i}", ls="--", label=f"{name} teacher {exact[name]:.3f}")
        ax.axhline(0.9 * exact[name], color=f"C{7 + i}", ls=":", label=f"90% of the {name} teacher")
    ax.set(xlabel="step", ylabel=f"held-out greedy exact match ({HELDOUT} problems)",
           title="on-policy distillation vs GRPO from the same warm start")
    ax.legend(fontsize=7, loc="lower right")
    fig.savefig(os.path.join(args.output_dir, "exact_match.png"), dpi=120, bbox_inches="tight")
    print(f"plot: {os.path.join(args.output_dir, 'exact_match.png')}; {time.strftime('%T')}")


if __name__ == "__main__":
    main()
