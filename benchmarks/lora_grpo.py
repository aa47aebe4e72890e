"""Does LoRA GRPO learn like the full fine-tune? The embedded GRPO demo's reward curves, one figure, one table.

Reads each run directory's `metrics.jsonl` (and `summary.json` when there) written by `recipes/grpo.py`, and plots
`reward_mean` per RL step (EMA 0.2, the recipes' smoothing; raw values faint) for every run in one figure:

    accelerate launch --config_file recipes/accelerate/local.yaml recipes/grpo.py --output_dir runs/grpo
    accelerate launch --config_file recipes/accelerate/local.yaml recipes/grpo.py --lora_rank 1 \\
        --output_dir runs/grpo_r1
    accelerate launch --config_file recipes/accelerate/local.yaml recipes/grpo.py --lora_rank 8 \\
        --output_dir runs/grpo_r8
    python benchmarks/lora_grpo.py full=runs/grpo "LoRA r=1=runs/grpo_r1" "LoRA r=8=runs/grpo_r8" \\
        --out benchmarks/logs/lora/grpo_demo.png

Prints one row per run: first-5 / last-5 mean reward, the best smoothed reward, held-out greedy exact match before
and after, the learning rate, trainable bytes synced per step (`sync_bytes`, LoRA only), wall time.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "recipes"))
from _common import smooth  # noqa: E402


def read_run(path: str) -> tuple[list[dict], dict]:
    with open(os.path.join(path, "metrics.jsonl")) as f:
        history = [json.loads(line) for line in f if line.strip()]
    summary_path = os.path.join(path, "summary.json")
    summary = json.load(open(summary_path)) if os.path.exists(summary_path) else {}
    return history, summary


def row(label: str, history: list[dict], summary: dict) -> str:
    rewards = [h["reward_mean"] for h in history]
    first, last = sum(rewards[:5]) / len(rewards[:5]), sum(rewards[-5:]) / len(rewards[-5:])
    greedy = ""
    if "greedy_before" in summary:
        greedy = f"{summary['greedy_before']['exact']:.3f} -> {summary['greedy_after']['exact']:.3f}"
    sync = history[-1].get("sync_bytes")
    sync_text = f"{sync / 1024:.1f} KiB" if sync is not None else "- (shared weights)"
    wall = f"{summary['wall_time_s']:.0f}" if "wall_time_s" in summary else "?"
    return (
        f"| {label} | {len(history)} | {history[0]['lr']:g} | {first:.3f} -> {last:.3f} ({last - first:+.3f}) | "
        f"{max(smooth(rewards)):.3f} | {greedy} | {sync_text} | {wall} |"
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("runs", nargs="+", help="LABEL=RUN_DIR (the label may contain '=': the last one splits)")
    p.add_argument("--out", default="lora_grpo.png")
    p.add_argument("--title", default="embedded GRPO demo: LoRA against the full fine-tune")
    args = p.parse_args()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4), dpi=100)
    print(
        "| run | steps | lr | reward first5 -> last5 | best smoothed | held-out greedy exact | sync / step | wall s |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for i, spec in enumerate(args.runs):
        label, path = spec.rsplit("=", 1)
        history, summary = read_run(path)
        steps, rewards = [h["step"] for h in history], [h["reward_mean"] for h in history]
        color = f"C{i}"
        ax.plot(steps, rewards, color=color, alpha=0.15, linewidth=1)
        ax.plot(steps, smooth(rewards), color=color, linewidth=2, label=f"{label} (lr {history[0]['lr']:g})")
        print(row(label, history, summary))
    ax.set_xlabel("RL step")
    ax.set_ylabel("mean reward (EMA 0.2)")
    ax.set_title(args.title)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(args.out)
    print(f"figure: {args.out}")


if __name__ == "__main__":
    main()
