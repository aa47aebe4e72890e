"""Evaluate checkpoints on a dataset: temperatures x samples per prompt -> unbiased pass@k.

For every cell (checkpoint x temperature x n samples per prompt): generate n samples per prompt
with `rollout.RolloutEngine` (group_size = n, seeded), score each with the verifier (a sample is
correct when its reward is 1), and report pass@k for each k <= n with the unbiased estimator
1 - C(n-c, k) / C(n, k) (`trainers.passk`), averaged over prompts, plus the mean reward and the
mean response length. Outputs in OUTPUT_DIR: a table on stdout, sweep.csv (one row per cell)
and passk.png (pass@k vs temperature, one line per checkpoint, one panel per k).

Resumable: cells already in sweep.csv (keyed by checkpoint x temperature x n) are skipped, so an
interrupted or extended sweep only runs what is missing.

Defaults: the checkpoints the GRPO demo saved (runs/grpo/init = the warm start, runs/grpo/final
= after GRPO; if neither exists the warm-started model is built here instead), and the embedded
task's test split (200 problems from a fixed seed) written to OUTPUT_DIR/test.jsonl and loaded
back with `datasets.load_dataset("json", ...)`.

Launch:
    accelerate launch recipes/eval_sweep.py
    accelerate launch recipes/eval_sweep.py --checkpoints runs/grpo/init runs/grpo/final \\
        --temperatures 0.5 1.0 --samples 4 16 --ks 1 4 16
    accelerate launch --config_file recipes/accelerate/1gpu.yaml recipes/eval_sweep.py \\
        --checkpoints Qwen/Qwen2.5-0.5B-Instruct --dataset test.jsonl --reward exact_match --max_new_tokens 256
"""

# ruff: noqa: E402
from __future__ import annotations

import os

# NOTE: before torch loads OpenMP (see recipes/grpo.py): passive waiting keeps a busy 2-core box usable.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse
import csv
import time
from collections.abc import Iterable, Sequence

import numpy as np
import torch
from _common import REWARDS, build_warm_start, get_reward, load_prompts, write_jsonl
from tqdm.auto import tqdm
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.utils import logging as hf_logging

from rollout import ContinuousBatchingConfig, RolloutEngine
from trainers.passk import pass_at_k_array
from trainers.tasks import AdditionTask

# ----------------------------------------------------------------------------------- config
CHECKPOINTS = ("runs/grpo/init", "runs/grpo/final")  # what `accelerate launch recipes/grpo.py` saves
TEMPERATURES = (0.25, 0.5, 0.75, 1.0, 1.25)
SAMPLES = (4, 16)  # samples per prompt (n)
KS = (1, 2, 4, 8, 16)
NUM_TEST = 200  # embedded test problems
TEST_SEED = 777  # the embedded test split (training prompts use seeds 1000+)
MAX_NEW_TOKENS = 6
PAGE_SIZE = 16  # KV page size in tokens (the engine default, 256, suits long completions)
KEY_FIELDS = ("checkpoint", "temperature", "n")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--checkpoints", nargs="+", default=None, help="local paths or hub ids")
    p.add_argument("--dataset", default=None, help="json/jsonl/parquet/csv, save_to_disk dir or hub id")
    p.add_argument("--dataset_split", default="test")
    p.add_argument("--num_prompts", type=int, default=NUM_TEST, help="use the first N rows")
    p.add_argument("--reward", default="addition", choices=sorted(REWARDS))
    p.add_argument("--temperatures", nargs="+", type=float, default=list(TEMPERATURES))
    p.add_argument("--samples", nargs="+", type=int, default=list(SAMPLES))
    p.add_argument("--ks", nargs="+", type=int, default=list(KS))
    p.add_argument("--max_new_tokens", type=int, default=MAX_NEW_TOKENS)
    p.add_argument("--page_size", type=int, default=PAGE_SIZE)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output_dir", default="runs/eval_sweep")
    return p.parse_args(argv)


# ------------------------------------------------------------------------------- aggregation


def cell_metrics(rewards: Sequence[float], lengths: Sequence[int], n: int, ks: Iterable[int]) -> dict:
    """Metrics of one cell from its `P x n` rewards and completion lengths (each prompt's n
    samples adjacent): `pass@k` for every k <= n (mean over prompts of the unbiased estimator,
    correct = reward 1), `reward_mean`, `response_length`."""
    rewards_pn = np.asarray(rewards, dtype=np.float64).reshape(-1, n)  # [P, n]
    correct = (rewards_pn >= 1.0 - 1e-9).sum(axis=1)  # [P]
    out = {"prompts": rewards_pn.shape[0], "reward_mean": float(rewards_pn.mean())}
    out["response_length"] = float(np.mean(lengths))
    for k in ks:
        out[f"pass@{k}"] = float(pass_at_k_array(n, correct, k).mean()) if k <= n else None
    return out


# ---------------------------------------------------------------------------------- the CSV


def cell_key(checkpoint: str, temperature: float, n: int) -> tuple[str, float, int]:
    return (os.path.normpath(checkpoint), round(float(temperature), 6), int(n))


def read_rows(path: str) -> list[dict]:
    if not os.path.exists(path):
        return []
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def done_cells(path: str) -> set[tuple[str, float, int]]:
    """Keys of the cells already in the CSV at `path` (empty if it does not exist)."""
    return {cell_key(r["checkpoint"], r["temperature"], r["n"]) for r in read_rows(path)}


def append_row(path: str, row: dict, fields: Sequence[str]) -> None:
    """Append one finished cell (header first if the file is new), flushed at once so an
    interrupted sweep keeps every finished cell."""
    new = not os.path.exists(path) or os.path.getsize(path) == 0
    if not new:  # NOTE: keep the existing header; columns it lacks are dropped
        with open(path, newline="") as f:
            fields = next(csv.reader(f))
    with open(path, "a", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(fields), extrasaction="ignore")
        if new:
            writer.writeheader()
        writer.writerow({k: "" if v is None else v for k, v in row.items()})


# ------------------------------------------------------------------------------ the outputs


def print_table(rows: list[dict], ks: Sequence[int]) -> None:
    cols = ["checkpoint", "temperature", "n", "reward_mean", "response_length"] + [f"pass@{k}" for k in ks]
    cells = [[_fmt(col, r.get(col)) for col in cols] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(cols)]
    print("  ".join(c.rjust(w) for c, w in zip(cols, widths, strict=True)))
    for row in cells:
        print("  ".join(v.rjust(w) for v, w in zip(row, widths, strict=True)))


def _fmt(column: str, value) -> str:
    if value in (None, ""):
        return "-"
    if column == "checkpoint":
        return str(value)
    if column == "n":
        return str(int(value))
    return f"{float(value):.3f}"


def plot_passk(rows: list[dict], ks: Sequence[int], path: str) -> str:
    """pass@k vs temperature, one line per checkpoint, one panel per k (largest n per point)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(ks), figsize=(3.2 * len(ks), 3.2), dpi=100, squeeze=False, sharey=True)
    for ax, k in zip(axes[0], ks, strict=True):
        for checkpoint in dict.fromkeys(r["checkpoint"] for r in rows):
            best: dict[float, tuple[int, float]] = {}  # temperature -> (n, pass@k)
            for r in rows:
                value = r.get(f"pass@{k}")
                if r["checkpoint"] == checkpoint and value not in (None, ""):
                    t, n = float(r["temperature"]), int(r["n"])
                    if t not in best or n > best[t][0]:
                        best[t] = (n, float(value))
            if best:
                temps = sorted(best)
                ax.plot(temps, [best[t][1] for t in temps], "o-", label=checkpoint)
        ax.set_title(f"pass@{k}")
        ax.set_xlabel("temperature")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("unbiased pass@k")
    axes[0][0].legend(fontsize=7, loc="best")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


# ----------------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> list[dict]:
    args = parse_args(argv)
    hf_logging.disable_progress_bar()  # NOTE: per-checkpoint loading bars would break up the sweep's bar
    os.makedirs(args.output_dir, exist_ok=True)
    csv_path = os.path.join(args.output_dir, "sweep.csv")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    reward_fn = get_reward(args.reward)

    # 1. checkpoints: the given ones, else the GRPO demo's, else a warm start built here
    checkpoints = args.checkpoints
    if checkpoints is None:
        checkpoints = [c for c in CHECKPOINTS if os.path.exists(os.path.join(c, "config.json"))]
        if not checkpoints:
            fallback = os.path.join(args.output_dir, "warm_start")
            print(
                f"NOTE: no GRPO demo checkpoint found at {' or '.join(CHECKPOINTS)} "
                f"(run `accelerate launch recipes/grpo.py` first); evaluating the embedded "
                f"warm-started model instead, built into {fallback}"
            )
            if not os.path.exists(os.path.join(fallback, "config.json")):
                build_warm_start(fallback, seed=args.seed)
            checkpoints = [fallback]

    # 2. prompts and references, through `datasets`
    if args.dataset:
        data_path = args.dataset
    else:
        rows = AdditionTask(num_digits=3).sample(args.num_prompts, seed=TEST_SEED)
        data_path = write_jsonl(rows, os.path.join(args.output_dir, "test.jsonl"))
    dataset = load_prompts(data_path, args.dataset_split)
    dataset = dataset.select(range(min(args.num_prompts, len(dataset))))
    prompts = dataset["prompt"]
    columns = {c: dataset[c] for c in dataset.column_names if c != "prompt"}
    ks = sorted(set(args.ks))
    fields = [*KEY_FIELDS, "prompts", "reward_mean", "response_length", *(f"pass@{k}" for k in ks)]
    fields += ["seconds", "tokens_per_s", "dataset"]

    # 3. the sweep, skipping finished cells
    cells = [(c, t, n) for c in checkpoints for t in args.temperatures for n in sorted(set(args.samples))]
    done = done_cells(csv_path)
    todo = [cell for cell in cells if cell_key(*cell) not in done]
    print(f"{len(cells)} cells, {len(cells) - len(todo)} already in {csv_path}, {len(todo)} to run")
    bar = tqdm(
        total=len(cells), initial=len(cells) - len(todo), desc="sweep", unit="cell", dynamic_ncols=True
    )
    for checkpoint in dict.fromkeys(c for c, _, _ in todo):
        tokenizer = AutoTokenizer.from_pretrained(checkpoint)
        model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).to(device).eval()
        config = ContinuousBatchingConfig(page_size=args.page_size)
        with RolloutEngine(model, tokenizer=tokenizer, config=config) as engine:
            for _, temperature, n in [cell for cell in todo if cell[0] == checkpoint]:
                start = time.perf_counter()
                batch = engine.generate(
                    prompts,
                    temps=temperature,
                    group_size=n,
                    max_new_tokens=args.max_new_tokens,
                    seed=args.seed,
                )
                seconds = time.perf_counter() - start
                # every reward column repeated n times, aligned with the grouped samples
                expanded = {c: [v for v in values for _ in range(n)] for c, values in columns.items()}
                rewards = reward_fn(
                    [p for p in prompts for _ in range(n)], batch.completions_text, **expanded
                )
                lengths = batch.completion_lengths.tolist()
                row = {"checkpoint": checkpoint, "temperature": temperature, "n": n}
                row.update(cell_metrics(rewards, lengths, n, ks))
                row.update(seconds=round(seconds, 3), tokens_per_s=round(sum(lengths) / seconds, 1))
                row["dataset"] = data_path
                append_row(csv_path, row, fields)
                shown = {f"pass@{ks[0]}": f"{row[f'pass@{ks[0]}']:.3f}"} if ks[0] <= n else {}
                bar.set_postfix(ckpt=os.path.basename(checkpoint), T=temperature, n=n, **shown)
                bar.update(1)
        del model
    bar.close()

    # 4. report every requested cell (fresh or read back)
    wanted = {cell_key(*cell) for cell in cells}
    rows = [r for r in read_rows(csv_path) if cell_key(r["checkpoint"], r["temperature"], r["n"]) in wanted]
    print_table(rows, ks)
    png = plot_passk(rows, ks, os.path.join(args.output_dir, "passk.png"))
    print(f"wrote {csv_path} and {png}")
    return rows


if __name__ == "__main__":
    main()
