"""GRPO on a verifiable task with one persistent rollout engine per process.

With no arguments this is the embedded CPU demo, end to end and offline:
  1. a character-level tokenizer built with `tokenizers`, wrapped as a transformers fast tokenizer;
  2. a small Qwen3 model (hidden 128, 3 layers) built from scratch and warm-started by supervised
     training on 3-digit additions ("123+456=" -> "579") until greedy exact match reaches ~30%
     (a partly trained policy leaves RL room), saved with `save_pretrained` to OUTPUT_DIR/init;
  3. model and tokenizer loaded back with `from_pretrained` (the same code path as `--model`);
  4. training prompts generated with a seed and materialised as a `datasets.Dataset`;
  5. GRPO (`trainers.GRPOTrainer`), 200 steps: per step 32 prompts x 8 samples at temperature 1.2;
     reward = the exact addition verifier with per-digit partial credit in [0, 1]; advantages =
     (r - group mean) / group std; the clipped surrogate (clip 0.2) averaged per sequence, then
     over sequences; 2 passes over each rollout batch in 2 minibatches (4 AdamW steps at lr 5e-4);
     no KL term. `--algorithm dr_grpo` (no std scaling, Dr. GRPO's length-free sum) and `dapo`
     (token mean, clip-higher 0.28, constant-reward groups dropped) swap those choices;
  6. OUTPUT_DIR/metrics.jsonl (one record per step), reward.png (reward per step, smoothed),
     final/ (save_pretrained) and summary.json (first-5 / last-5 mean reward, wall time, rollout
     tokens/s, greedy exact match on 512 held-out problems before and after).

Launch (a tqdm bar shows the reward; the default took 175-190 s on 2 CPU cores, clean clone, 2026-12-02):
    accelerate launch recipes/grpo.py
    accelerate launch recipes/grpo.py --async_rollout --max_staleness 1   # generation overlaps training
    accelerate launch --config_file recipes/accelerate/2cpu.yaml recipes/grpo.py      # 2 CPU ranks
    accelerate launch --config_file recipes/accelerate/1gpu.yaml recipes/grpo.py \\
        --model Qwen/Qwen2.5-0.5B-Instruct --dataset data.jsonl --reward exact_match \\
        --max_new_tokens 256 --lr 1e-6 --output_dir runs/grpo_qwen

A real model on a real dataset (GSM8K: `question` / `answer` "... #### 72", scored by the final
number; `--chat_template` wraps each question as a user message of the model's chat template):
    accelerate launch --config_file recipes/accelerate/1gpu.yaml recipes/grpo.py \
        --model Qwen/Qwen2.5-0.5B-Instruct --dataset openai/gsm8k --dataset_config main \
        --prompt_column question --answer_column answer --reward math --chat_template \
        --max_new_tokens 512 --lr 1e-6 --bf16 --gradient_checkpointing --gradient_accumulation_steps 4 \
        --save_steps 50 --save_total_limit 2 --report_to tensorboard --output_dir runs/grpo_gsm8k
    (rerun with --resume_from_checkpoint latest to continue; metrics.jsonl is appended)

`--dataset` is a local json/jsonl/parquet/csv file, a `save_to_disk` directory or a hub id; its
prompt column holds text or chat messages (a list of {"role", "content"} dicts, always templated),
and the other columns reach the reward (`answer` for the built-in rewards). Rewards are TRL-style
functions (`trainers.rewards`).
"""

# ruff: noqa: E402
from __future__ import annotations

import os

# NOTE: set before torch loads OpenMP. Busy-waiting worker threads make a 2-core machine that is
# also running anything else up to ~20x slower on this model's small matrices. Passive waiting is not
# free on larger models: a 100M engine's decode step wakes the team ~100 times, and ran ~1.5x slower
# with PASSIVE on an idle box (benchmarks/RESULTS.md, issue 26): export OMP_WAIT_POLICY=ACTIVE there.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse
import time

from _common import (
    GRPO_EMBEDDED_ENGINE,
    GRPO_WARM_START,
    REWARDS,
    add_async_args,
    add_run_args,
    async_run_kwargs,
    checkpoint_step,
    fresh_output_dir,
    get_reward,
    load_policy_and_prompts,
    make_accelerator,
    plot_rewards,
    read_metrics,
    resolve_checkpoint,
    run_engine_dtype,
    summarize,
    trainer_run_kwargs,
    write_json,
)
from accelerate.utils import set_seed

from trainers import GRPOConfig, GRPOTrainer
from trainers.tasks import AdditionTask, greedy_accuracy

# ----------------------------------------------------------------------------------- config
STEPS = 200  # RL steps
PROMPTS_PER_STEP = 32  # per process
GROUP_SIZE = 8  # samples per prompt: 256 rollouts per step and process
TEMPERATURE = 1.2  # a little more exploration than 1.0: the reward rose further in the same 200 steps
LR = 5e-4  # the embedded model is tiny and trained from scratch; a hub model wants ~1e-6
ITERATIONS = 2  # passes over each rollout batch ...
MINIBATCHES = 2  # ... in 2 optimizer steps each: 4 AdamW steps per rollout batch
MAX_NEW_TOKENS = 5  # an answer has at most 4 digits, then eos
TRAIN_PROMPTS = 8192  # embedded dataset size (no prompt repeats within a default run)
HELDOUT = 512  # held-out problems for the greedy accuracy reported before and after RL
WARM_START = GRPO_WARM_START  # seeded separately from the RL run (see recipes/_common.py)
EMBEDDED_ENGINE = GRPO_EMBEDDED_ENGINE


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="local path or hub id (default: the embedded warm start)")
    p.add_argument("--dataset", default=None, help="json/jsonl/parquet/csv, save_to_disk dir or hub id")
    p.add_argument("--dataset_split", default="train")
    p.add_argument("--reward", default="addition", choices=sorted(REWARDS))
    p.add_argument("--algorithm", default="grpo", choices=["grpo", "dr_grpo", "dapo"])
    p.add_argument("--steps", type=int, default=STEPS)
    p.add_argument("--prompts_per_step", type=int, default=PROMPTS_PER_STEP)
    p.add_argument("--group_size", type=int, default=GROUP_SIZE)
    p.add_argument("--temperature", type=float, default=TEMPERATURE)
    p.add_argument("--lr", type=float, default=LR)
    p.add_argument("--iterations", type=int, default=ITERATIONS, help="passes over each rollout batch")
    p.add_argument("--minibatches", type=int, default=MINIBATCHES, help="optimizer steps per pass")
    p.add_argument("--max_new_tokens", type=int, default=MAX_NEW_TOKENS)
    p.add_argument("--beta", type=float, default=0.0, help="k3 KL weight to the initial policy")
    p.add_argument("--top_k", type=int, default=None, help="sampling top-k (the trainer scores under it too)")
    p.add_argument("--top_p", type=float, default=None, help="sampling top-p (the trainer scores under it too)")
    p.add_argument("--max_resample_rounds", type=int, default=0, help="dapo: rounds to refill dropped groups")
    p.add_argument("--overlong_buffer", type=int, default=0, help="soft overlong penalty buffer (tokens)")
    p.add_argument("--overlong_filter", action="store_true", help="leave truncated completions out of the loss")
    p.add_argument("--engine_dtype", default=None, help="run the engine on a cast copy, e.g. bfloat16")
    p.add_argument("--sft_target", type=float, default=WARM_START["target_exact"])
    p.add_argument("--sft_steps", type=int, default=WARM_START["max_sft_steps"])
    p.add_argument("--sft_seed", type=int, default=WARM_START["seed"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output_dir", default="runs/grpo")
    add_run_args(p)
    add_async_args(p)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    accelerator = make_accelerator(bf16=args.bf16, report_to=args.report_to)
    set_seed(args.seed)
    resume = resolve_checkpoint(args.output_dir, args.resume_from_checkpoint)
    fresh_output_dir(accelerator, args.output_dir, checkpoint_step(resume) if resume else None)
    if args.report_to:
        accelerator.init_trackers("rollout-grpo", config=vars(args))
    start = time.perf_counter()

    # 1-2. the policy (a hub / local checkpoint, or the embedded model warm-started and saved here)
    # and the prompts, as a datasets.Dataset
    model_path, tokenizer, model, dataset, warm_start_s = load_policy_and_prompts(
        accelerator, args, TRAIN_PROMPTS, sft_seed=args.sft_seed
    )
    heldout = {}  # greedy accuracy on held-out problems, before and after RL (embedded task only)
    if not args.dataset and accelerator.is_main_process:
        heldout["greedy_before"] = greedy_accuracy(model, tokenizer, AdditionTask(num_digits=3), n=HELDOUT)

    # 3. GRPO
    config = GRPOConfig(
        output_dir=args.output_dir,
        algorithm=args.algorithm,
        max_steps=args.steps,
        prompts_per_step=args.prompts_per_step,
        group_size=args.group_size,
        temperature=args.temperature,
        max_new_tokens=args.max_new_tokens,
        learning_rate=args.lr,
        num_iterations=args.iterations,
        num_minibatches=args.minibatches,
        beta=args.beta,
        top_k=args.top_k,
        top_p=args.top_p,
        max_resample_rounds=args.max_resample_rounds,
        overlong_buffer=args.overlong_buffer,
        overlong_filter=args.overlong_filter,
        engine_dtype=run_engine_dtype(args),
        engine_config=None if args.model else EMBEDDED_ENGINE,
        seed=args.seed,
        log_stdout=False,  # the tqdm bar shows the reward; metrics.jsonl has everything
        **trainer_run_kwargs(args),
        **async_run_kwargs(args),
    )
    trainer = GRPOTrainer(model, tokenizer, get_reward(args.reward), dataset, config, accelerator=accelerator)
    with trainer:
        if resume:
            trainer.load_checkpoint(resume)
        trainer.train()
    history = read_metrics(args.output_dir) if accelerator.is_main_process else []
    wall = time.perf_counter() - start

    # 4. outputs: final checkpoint, plot, summary
    accelerator.wait_for_everyone()
    if heldout:
        heldout["greedy_after"] = greedy_accuracy(
            trainer.policy, tokenizer, AdditionTask(num_digits=3), n=HELDOUT
        )
    summary = summarize(
        history,
        wall,
        warm_start_s=warm_start_s,
        num_processes=accelerator.num_processes,
        model=model_path,
        algorithm=args.algorithm,
        **heldout,
    )
    if accelerator.is_main_process:
        final = os.path.join(args.output_dir, "final")
        trainer.policy.save_pretrained(final)
        tokenizer.save_pretrained(final)
        first, last = summary["reward_first5"], summary["reward_last5"]
        title = f"{args.algorithm} on {model_path}, T={args.temperature}: reward {first:.3f} -> {last:.3f}"
        plot_rewards(history, os.path.join(args.output_dir, "reward.png"), title)
        write_json(summary, os.path.join(args.output_dir, "summary.json"))
        print(
            f"reward first5 {first:.3f} -> last5 {last:.3f} (rise {last - first:+.3f}) in "
            f"{summary['steps']} steps on {accelerator.num_processes} process(es), {wall:.0f}s "
            f"(warm start {warm_start_s:.0f}s), {summary['rollout_tokens_per_s']:.0f} rollout tok/s; outputs in {args.output_dir}"
        )
        if heldout:
            before, after = heldout["greedy_before"], heldout["greedy_after"]
            print(
                f"held-out greedy exact match {before['exact']:.3f} -> {after['exact']:.3f}, "
                f"reward {before['reward']:.3f} -> {after['reward']:.3f} ({HELDOUT} problems)"
            )
    accelerator.end_training()
    return summary


if __name__ == "__main__":
    main()
