"""Evaluate checkpoints on a dataset: temperatures x samples per prompt -> unbiased pass@k.

For every cell (checkpoint x temperature x n samples per prompt): generate n samples per prompt
with `rollout.RolloutEngine` (group_size = n, seeded), score each with the verifier (a sample is
correct when its reward is 1), and report pass@k for each k <= n with the unbiased estimator
1 - C(n-c, k) / C(n, k) (`trainers.passk`), averaged over prompts, plus the mean reward and the
mean response length. Outputs in OUTPUT_DIR: a table on stdout, sweep.csv (one row per cell)
and passk.png (pass@k vs temperature, one line per checkpoint, one panel per k).

Resumable: cells already in sweep.csv (keyed by checkpoint x temperature x n x dataset x reward x
max_new_tokens) are skipped, so an interrupted or extended sweep only runs what is missing.

Several processes (`accelerate launch --config_file recipes/accelerate/2cpu.yaml recipes/eval_sweep.py`)
split the prompts of every cell: each rank generates its contiguous share with its own engine, and
the main process gathers the rewards and writes the one CSV.

Defaults: the checkpoints the GRPO demo saved (runs/grpo/init = the warm start, runs/grpo/final
= after GRPO; if neither exists the warm-started model is built here instead), and the embedded
task's test split (200 problems from a fixed seed) written to OUTPUT_DIR/test.jsonl and loaded
back with `datasets.load_dataset("json", ...)`.

Launch:
    accelerate launch --config_file recipes/accelerate/local.yaml recipes/eval_sweep.py
    accelerate launch --config_file recipes/accelerate/local.yaml recipes/eval_sweep.py \\
        --checkpoints runs/grpo/init runs/grpo/final --temperatures 0.5 1.0 --samples 4 16 --ks 1 4 16
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
from _common import (
    REWARDS,
    add_overwrite_arg,
    build_warm_start,
    claim_output_dir,
    get_reward,
    load_prompts,
    make_accelerator,
    run_record,
    write_jsonl,
)
from accelerate.utils import gather_object
from tqdm.auto import tqdm
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.utils import logging as hf_logging

from rollout import ContinuousBatchingConfig, RolloutEngine
from trainers.passk import pass_at_k_array
from trainers.rewards import score_completions
from trainers.rollouts import encode_prompt
from trainers.tasks import AdditionTask

# ----------------------------------------------------------------------------------- config
# what `accelerate launch --config_file recipes/accelerate/local.yaml recipes/grpo.py` saves
CHECKPOINTS = ("runs/grpo/init", "runs/grpo/final")
TEMPERATURES = (0.25, 0.5, 0.75, 1.0, 1.25)
SAMPLES = (4, 16)  # samples per prompt (n)
KS = (1, 2, 4, 8, 16)
NUM_TEST = 200  # embedded test problems
TEST_SEED = 777  # the embedded test split (training prompts use seeds 1000+)
MAX_NEW_TOKENS = 6
PAGE_SIZE = 16  # KV page size in tokens (the engine default, 256, suits long completions)
KEY_FIELDS = ("checkpoint", "temperature", "n", "dataset", "reward", "max_new_tokens")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--checkpoints", nargs="+", default=None, help="local paths or hub ids")
    p.add_argument("--dataset", default=None, help="json/jsonl/parquet/csv, save_to_disk dir or hub id")
    p.add_argument("--dataset_split", default="test")
    p.add_argument("--dataset_config", default=None)
    p.add_argument("--prompt_column", default="prompt")
    p.add_argument("--answer_column", default="answer")
    p.add_argument("--chat_template", action="store_true", help="apply the chat template to text prompts")
    p.add_argument("--num_prompts", type=int, default=NUM_TEST, help="use the first N rows")
    p.add_argument("--reward", default="addition", choices=sorted(REWARDS))
    p.add_argument("--temperatures", nargs="+", type=float, default=list(TEMPERATURES))
    p.add_argument("--samples", nargs="+", type=int, default=list(SAMPLES))
    p.add_argument("--ks", nargs="+", type=int, default=list(KS))
    p.add_argument("--max_new_tokens", type=int, default=MAX_NEW_TOKENS)
    p.add_argument("--page_size", type=int, default=PAGE_SIZE)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output_dir", default="runs/eval_sweep")
    add_overwrite_arg(p)
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


def cell_key(
    checkpoint: str, temperature: float, n: int, dataset: str = "", reward: str = "", max_new_tokens: int = 0
) -> tuple[str, float, int, str, str, int]:
    """What makes two cells the same measurement (paths normalised, floats rounded)."""
    data = os.path.normpath(dataset) if dataset else ""
    return (os.path.normpath(checkpoint), round(float(temperature), 6), int(n), data, reward, int(max_new_tokens))


def row_key(row: dict) -> tuple:
    """`cell_key` of a CSV row."""
    return cell_key(
        row["checkpoint"], row["temperature"], row["n"],
        row.get("dataset") or "", row.get("reward") or "", int(row.get("max_new_tokens") or 0),
    )


def read_rows(path: str) -> list[dict]:
    if not os.path.exists(path):
        return []
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def done_cells(path: str) -> set[tuple]:
    """Keys of the cells already in the CSV at `path` (empty if it does not exist)."""
    return {row_key(r) for r in read_rows(path)}


def retire_old_csv(path: str) -> None:
    """A CSV written before the key grew (no dataset / reward / max_new_tokens columns) cannot
    say which measurement its rows are: move it aside to `path.old` and start a new one."""
    if os.path.exists(path) and os.path.getsize(path):
        with open(path, newline="") as f:
            header = next(csv.reader(f), [])
        if not set(KEY_FIELDS) <= set(header):
            os.replace(path, path + ".old")
            print(f"NOTE: {path} lacks the columns {KEY_FIELDS}; moved to {path}.old")


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


def find_checkpoints(args, main_process: bool) -> list[str]:
    """`--checkpoints`, else the GRPO demo's, else the embedded warm start (built here once)."""
    if args.checkpoints is not None:
        return args.checkpoints
    checkpoints = [c for c in CHECKPOINTS if os.path.exists(os.path.join(c, "config.json"))]
    if checkpoints:
        return checkpoints
    fallback = os.path.join(args.output_dir, "warm_start")
    print(
        f"NOTE: no GRPO demo checkpoint found at {' or '.join(CHECKPOINTS)} "
        "(run `accelerate launch --config_file recipes/accelerate/local.yaml recipes/grpo.py` first); evaluating the "
        f"embedded warm-started model instead, built into {fallback}"
    )
    if main_process and not os.path.exists(os.path.join(fallback, "config.json")):
        build_warm_start(fallback, seed=args.seed)
    return [fallback]


def this_ranks_rows(args, accelerator) -> tuple[str, list[dict]]:
    """(the dataset's path, this rank's contiguous share of its first `--num_prompts` rows)."""
    if args.dataset:
        data_path = args.dataset
    else:
        data_path = os.path.join(args.output_dir, "test.jsonl")
        if accelerator.is_main_process:
            write_jsonl(AdditionTask(num_digits=3).sample(args.num_prompts, seed=TEST_SEED), data_path)
    accelerator.wait_for_everyone()
    dataset = load_prompts(
        data_path, args.dataset_split, args.dataset_config, args.prompt_column, args.answer_column
    )
    dataset = dataset.select(range(min(args.num_prompts, len(dataset))))
    share = np.array_split(np.arange(len(dataset)), accelerator.num_processes)[accelerator.process_index].tolist()
    return data_path, [dict(dataset[i]) for i in share]


def run_cell(engine, prompts, rows, reward_fn, temperature: float, n: int, args, rank: int):
    """One (temperature, n) cell on every rank: (all ranks' rewards, all ranks' lengths, the slowest rank's s)."""
    start = time.perf_counter()
    batch = engine.generate(
        prompts,
        temps=temperature,
        group_size=n,
        max_new_tokens=args.max_new_tokens,
        seed=args.seed + 1_000_003 * rank,
    ) if rows else None
    seconds = time.perf_counter() - start
    local_rewards, local_lengths = [], []
    if batch is not None:
        # NOTE: reward functions are called as TRL calls them (by keyword, None allowed)
        scores, _ = score_completions([reward_fn], rows, batch.completions_text, n)
        local_rewards = scores.nan_to_num(0.0).tolist()
        local_lengths = batch.completion_lengths.tolist()
    return gather_object(local_rewards), gather_object(local_lengths), max(gather_object([seconds]))


def main(argv: list[str] | None = None) -> list[dict]:
    args = parse_args(argv)
    hf_logging.disable_progress_bar()  # NOTE: per-checkpoint loading bars would break up the sweep's bar
    accelerator = make_accelerator()
    rank, main_process = accelerator.process_index, accelerator.is_main_process
    # NOTE: the recipe alone, not its flags: a widened grid adds its cells to the same sweep.csv
    claim_output_dir(accelerator, args.output_dir, run_record("recipes/eval_sweep.py"), args.overwrite)
    csv_path = os.path.join(args.output_dir, "sweep.csv")
    reward_fn = get_reward(args.reward)

    # 1. checkpoints: the given ones, else the GRPO demo's, else a warm start built here
    checkpoints = find_checkpoints(args, main_process)

    # 2. prompts and references, through `datasets`; this rank's contiguous share
    data_path, rows = this_ranks_rows(args, accelerator)
    ks = sorted(set(args.ks))
    fields = [*KEY_FIELDS, "prompts", "reward_mean", "response_length", *(f"pass@{k}" for k in ks)]
    fields += ["seconds", "tokens_per_s"]
    tag = dict(dataset=data_path, reward=args.reward, max_new_tokens=args.max_new_tokens)

    # 3. the sweep, skipping finished cells
    if main_process:
        retire_old_csv(csv_path)
    accelerator.wait_for_everyone()
    cells = [(c, t, n) for c in checkpoints for t in args.temperatures for n in sorted(set(args.samples))]
    done = done_cells(csv_path)
    accelerator.wait_for_everyone()  # NOTE: every rank decides on the same CSV before any row is added
    todo = [cell for cell in cells if cell_key(*cell, **tag) not in done]
    if main_process:
        print(f"{len(cells)} cells, {len(cells) - len(todo)} already in {csv_path}, {len(todo)} to run")
    bar = tqdm(
        total=len(cells), initial=len(cells) - len(todo), desc="sweep", unit="cell", dynamic_ncols=True,
        disable=not main_process,
    )
    for checkpoint in dict.fromkeys(c for c, _, _ in todo):
        tokenizer = AutoTokenizer.from_pretrained(checkpoint)
        model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
        model = model.to(accelerator.device).eval()
        config = ContinuousBatchingConfig(page_size=args.page_size)
        prompts = [encode_prompt(tokenizer, r["prompt"], args.chat_template) for r in rows]
        with RolloutEngine(model, tokenizer=tokenizer, config=config) as engine:
            for _, temperature, n in [cell for cell in todo if cell[0] == checkpoint]:
                rewards, lengths, seconds = run_cell(engine, prompts, rows, reward_fn, temperature, n, args, rank)
                if main_process:
                    row = {"checkpoint": checkpoint, "temperature": temperature, "n": n, **tag}
                    row.update(cell_metrics(rewards, lengths, n, ks))
                    row.update(seconds=round(seconds, 3), tokens_per_s=round(sum(lengths) / seconds, 1))
                    append_row(csv_path, row, fields)
                    shown = {f"pass@{ks[0]}": f"{row[f'pass@{ks[0]}']:.3f}"} if ks[0] <= n else {}
                    bar.set_postfix(ckpt=os.path.basename(checkpoint), T=temperature, n=n, **shown)
                bar.update(1)
        del model
    bar.close()
    accelerator.wait_for_everyone()

    # 4. report every requested cell (fresh or read back)
    wanted = {cell_key(*cell, **tag) for cell in cells}
    rows = [r for r in read_rows(csv_path) if row_key(r) in wanted]
    if main_process:
        print_table(rows, ks)
        png = plot_passk(rows, ks, os.path.join(args.output_dir, "passk.png"))
        print(f"wrote {csv_path} and {png}")
    accelerator.end_training()
    return rows


if __name__ == "__main__":
    main()
