"""The flags both GRPO recipes take (`grpo.py` in one process, `grpo_disagg.py` over rollout servers), with one
set of defaults, and the `GRPOConfig` fields they set. Each recipe adds its own flags beside them."""

from __future__ import annotations

import argparse

from _common import GRPO_WARM_START, REWARDS, add_overwrite_arg

STEPS = 200  # RL steps
PROMPTS_PER_STEP = 32  # per process
GROUP_SIZE = 8  # samples per prompt: 256 rollouts per step and process
TEMPERATURE = 1.2  # a little more exploration than 1.0: the reward rose further in the same 200 steps
LR = 5e-4  # the embedded model is tiny and trained from scratch; a hub model wants ~1e-6
LORA_ALPHA = 32.0
# NOTE: with --lora_rank and no --lr. The trainers' LoRA default (10x the full fine-tuning rate, LoRA Without Regret,
# trainers/lora.py) is for pretrained models; on this tiny model trained from scratch 10x (5e-3) lowered the
# held-out exact (0.281 -> 0.191 at rank 8) and 2x raised it (0.281 -> 0.549): docs/lora.md has the runs.
LORA_LR = 1e-3
ITERATIONS = 2  # passes over each rollout batch ...
MINIBATCHES = 2  # ... in 2 optimizer steps each: 4 AdamW steps per rollout batch
MAX_NEW_TOKENS = 5  # an answer has at most 4 digits, then eos
TRAIN_PROMPTS = 8192  # embedded dataset size (no prompt repeats within a default run)
WARM_START = GRPO_WARM_START  # seeded separately from the RL run (see recipes/_common.py)


def add_grpo_args(p: argparse.ArgumentParser, output_dir: str) -> None:
    """The task, algorithm, optimisation, warm-start and seed flags."""
    p.add_argument("--model", default=None, help="local path or hub id (default: the embedded warm start)")
    p.add_argument("--dataset", default=None, help="json/jsonl/parquet/csv, save_to_disk dir or hub id")
    p.add_argument("--dataset_split", default="train")
    p.add_argument("--reward", default="addition", choices=sorted(REWARDS))
    p.add_argument("--algorithm", default="grpo", choices=["grpo", "dr_grpo", "dapo"])
    p.add_argument("--steps", type=int, default=STEPS)
    p.add_argument("--prompts_per_step", type=int, default=PROMPTS_PER_STEP)
    p.add_argument("--group_size", type=int, default=GROUP_SIZE)
    p.add_argument("--temperature", type=float, default=TEMPERATURE)
    p.add_argument("--lr", type=float, default=None,
                   help=f"learning rate (default {LR}; {LORA_LR} with --lora_rank)")
    p.add_argument("--lora_rank", type=int, default=None, help="train a LoRA adapter of this rank (all linears)")
    p.add_argument("--lora_alpha", type=float, default=LORA_ALPHA, help="LoRA alpha (scale alpha / rank)")
    p.add_argument("--iterations", type=int, default=ITERATIONS, help="passes over each rollout batch")
    p.add_argument("--minibatches", type=int, default=MINIBATCHES, help="optimizer steps per pass")
    p.add_argument("--max_new_tokens", type=int, default=MAX_NEW_TOKENS)
    p.add_argument("--sft_target", type=float, default=WARM_START["target_exact"])
    p.add_argument("--sft_steps", type=int, default=WARM_START["max_sft_steps"])
    p.add_argument("--sft_seed", type=int, default=WARM_START["seed"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output_dir", default=output_dir)
    add_overwrite_arg(p)


def grpo_config_kwargs(args: argparse.Namespace) -> dict:
    """The `GRPOConfig` fields `add_grpo_args`' flags set."""
    return dict(
        output_dir=args.output_dir,
        algorithm=args.algorithm,
        max_steps=args.steps,
        prompts_per_step=args.prompts_per_step,
        group_size=args.group_size,
        temperature=args.temperature,
        max_new_tokens=args.max_new_tokens,
        learning_rate=args.lr if args.lr is not None else (LR if args.lora_rank is None else LORA_LR),
        lora_rank=args.lora_rank,
        lora_alpha=args.lora_alpha,
        num_iterations=args.iterations,
        num_minibatches=args.minibatches,
        seed=args.seed,
    )
