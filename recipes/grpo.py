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

Launch (a tqdm bar shows the reward; times: README.md, "Quick start"). Each run writes its own --output_dir and
refuses one another run wrote (`rollout_run.json` names the recipe and flags there) unless given --overwrite:
    accelerate launch --config_file recipes/accelerate/local.yaml recipes/grpo.py --output_dir runs/grpo
    accelerate launch --config_file recipes/accelerate/local.yaml recipes/grpo.py --async_rollout --max_staleness 1 \
        --output_dir runs/grpo_async   # generation overlaps training
    accelerate launch --config_file recipes/accelerate/2cpu.yaml recipes/grpo.py --output_dir runs/grpo_2cpu   # 2 ranks
    torchrun --nproc-per-node 2 recipes/grpo.py --tp_size 2 --output_dir runs/grpo_tp2   # one policy over 2 ranks
    accelerate launch --config_file recipes/accelerate/local.yaml recipes/grpo.py --rollout_engines 1 --async_rollout \
        --output_dir runs/grpo_fleet   # rollouts from a Ray fleet (the [ray] extra): engine actors (docs/fleets.md)
    accelerate launch --config_file recipes/accelerate/local.yaml recipes/grpo.py --lora_rank 8 \\
        --output_dir runs/grpo_r8
        # a LoRA adapter (lr 1e-3 unless --lr: docs/lora.md); `rollout serve runs/grpo_r8/final` serves it on its base
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
    refuse,
    resolve_checkpoint,
    reward_span,
    run_engine_dtype,
    run_record,
    summarize,
    trainer_run_kwargs,
    write_json,
)
from _fleet import add_fleet_args, build_fleet
from _grpo_args import TRAIN_PROMPTS, add_grpo_args, grpo_config_kwargs
from _mode import mode_line, mode_name, mode_numbers
from _tp import add_tp_args, check_tp_args
from accelerate.utils import set_seed

from trainers import GRPOConfig, GRPOTrainer
from trainers.tasks import AdditionTask, greedy_accuracy
from trainers.tensor_parallel import unsharded_copy

# ----------------------------------------------------------------------------------- config
# The shared defaults (steps 200, 32 prompts x G=8 per step and process, T=1.2, lr 5e-4, 2 iterations x 2
# minibatches, 5 new tokens) are in recipes/_grpo_args.py, with the flags both GRPO recipes take.
HELDOUT = 512  # held-out problems for the greedy accuracy reported before and after RL
EMBEDDED_ENGINE = GRPO_EMBEDDED_ENGINE


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_grpo_args(p, output_dir="runs/grpo")
    p.add_argument("--beta", type=float, default=0.0, help="k3 KL weight to the initial policy")
    p.add_argument("--top_k", type=int, default=None, help="sampling top-k (the trainer scores under it too)")
    p.add_argument("--top_p", type=float, default=None, help="sampling top-p (the trainer scores under it too)")
    p.add_argument("--max_resample_rounds", type=int, default=0, help="dapo: rounds to refill dropped groups")
    p.add_argument("--overlong_buffer", type=int, default=0, help="soft overlong penalty buffer (tokens)")
    p.add_argument("--overlong_filter", action="store_true", help="leave truncated completions out of the loss")
    p.add_argument("--engine_dtype", default=None, help="run the engine on a cast copy, e.g. bfloat16")
    add_run_args(p)
    add_async_args(p)
    add_fleet_args(p)
    add_tp_args(p)
    return p.parse_args(argv)


def grpo_config(args: argparse.Namespace) -> GRPOConfig:
    return GRPOConfig(
        **grpo_config_kwargs(args),
        beta=args.beta,
        top_k=args.top_k,
        top_p=args.top_p,
        max_resample_rounds=args.max_resample_rounds,
        overlong_buffer=args.overlong_buffer,
        overlong_filter=args.overlong_filter,
        engine_dtype=run_engine_dtype(args),
        engine_config=None if args.model else EMBEDDED_ENGINE,
        log_stdout=False,  # the tqdm bar shows the reward; metrics.jsonl has everything
        **trainer_run_kwargs(args),
        **async_run_kwargs(args),
    )


def write_outputs(args, accelerator, policy, tokenizer, summary: dict, history: list, heldout: dict) -> None:
    """Rank 0: the final checkpoint, the reward plot, summary.json and the two summary lines."""
    if not accelerator.is_main_process:
        return
    final = os.path.join(args.output_dir, "final")
    policy.save_pretrained(final)  # NOTE: gathered by gather_policy() on every rank (FSDP, TP: a full copy)
    tokenizer.save_pretrained(final)
    first, last = summary["reward_first5"], summary["reward_last5"]
    title = (f"{args.algorithm}, {mode_name(args)}, on {summary['model']}, T={args.temperature}: reward {first:.3f} -> "
             f"{last:.3f}")
    plot_rewards(history, os.path.join(args.output_dir, "reward.png"), title)
    write_json(summary, os.path.join(args.output_dir, "summary.json"))
    print(
        f"{reward_span(summary)} in "
        f"{summary['steps']} steps on {accelerator.num_processes} process(es), {summary['wall_time_s']:.0f}s "
        f"(warm start {summary['warm_start_s']:.0f}s), {summary['rollout_tokens_per_s']:.0f} rollout tok/s; "
        f"outputs in {args.output_dir}"
    )
    print(mode_line(args, history))
    if heldout:
        before, after = heldout["greedy_before"], heldout["greedy_after"]
        print(
            f"held-out greedy exact match {before['exact']:.3f} -> {after['exact']:.3f}, "
            f"reward {before['reward']:.3f} -> {after['reward']:.3f} ({HELDOUT} problems)"
        )


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    accelerator = make_accelerator(bf16=args.bf16, report_to=args.report_to)
    try:
        check_tp_args(args, accelerator)  # --tp_size: the launch and the flags it combines with
    except ValueError as error:
        raise refuse(f"recipes/grpo.py: {error}") from None
    set_seed(args.seed)
    resume = resolve_checkpoint(args.output_dir, args.resume_from_checkpoint)
    fresh_output_dir(accelerator, args.output_dir, checkpoint_step(resume) if resume else None,
                     record=run_record("recipes/grpo.py", args), overwrite=args.overwrite)
    if args.report_to:
        accelerator.init_trackers("rollout-grpo", config=vars(args))
    start = time.perf_counter()

    # 1-2. the policy (a hub / local checkpoint, or the embedded model warm-started and saved here)
    # and the prompts, as a datasets.Dataset
    model_path, tokenizer, model, dataset, warm_start_s = load_policy_and_prompts(
        accelerator, args, TRAIN_PROMPTS, sft_seed=args.sft_seed
    )
    heldout = {}  # greedy accuracy on held-out problems, before and after RL (embedded task only)
    if not args.dataset:
        plain = unsharded_copy(model) if args.tp_size > 1 else model  # NOTE: TP: collective, then rank 0 alone
        if accelerator.is_main_process:
            heldout["greedy_before"] = greedy_accuracy(plain, tokenizer, AdditionTask(num_digits=3), n=HELDOUT)

    # 3. GRPO
    config = grpo_config(args)
    fleet = build_fleet(args, model_path, tokenizer, config.engine_config, accelerator)  # --rollout_engines N
    trainer = GRPOTrainer(model, tokenizer, get_reward(args.reward), dataset, config, accelerator=accelerator,
                          rollout=fleet)
    with trainer:
        if resume:
            trainer.load_checkpoint(resume)
        trainer.train()
    history = read_metrics(args.output_dir) if accelerator.is_main_process else []
    wall = time.perf_counter() - start

    # 4. outputs: final checkpoint, plot, summary
    accelerator.wait_for_everyone()
    policy = trainer.gather_policy()  # NOTE: under FSDP or TP every rank gathers the shards
    if heldout:
        heldout["greedy_after"] = greedy_accuracy(policy, tokenizer, AdditionTask(num_digits=3), n=HELDOUT)
    summary = summarize(
        history,
        wall,
        warm_start_s=warm_start_s,
        num_processes=accelerator.num_processes,
        tp_size=args.tp_size,
        model=model_path,
        algorithm=args.algorithm,
        mode=mode_name(args),
        **mode_numbers(history),
        **heldout,
    )
    write_outputs(args, accelerator, policy, tokenizer, summary, history, heldout)
    accelerator.end_training()
    return summary


if __name__ == "__main__":
    main()
