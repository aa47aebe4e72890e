"""PPO with a value head on a verifiable task, one persistent rollout engine per process.

With no arguments: the same embedded CPU task as recipes/grpo.py (a small Qwen3 warm-started on
3-digit additions and saved to OUTPUT_DIR/init, loaded back with `from_pretrained`, prompts as a
`datasets.Dataset`, reward = exact verifier with per-digit partial credit), trained with
`trainers.PPOTrainer`:
  - 100 steps of 128 prompts, one sample each (no groups), temperature 1.2;
  - a linear value head on the policy's last hidden state, trained with the policy as one module;
  - the reward sits on the last completion token; GAE (gamma 1, lambda 0.95) gives per-token
    advantages, whitened over the batch, and returns;
  - the clipped surrogate (clip 0.2, token mean) + 0.5 x the clipped value loss, 2 epochs of
    2 minibatches per rollout batch (4 AdamW steps at lr 5e-4); no KL penalty (`--kl_coef` adds
    one to a frozen reference).
Writes OUTPUT_DIR/metrics.jsonl, reward.png, final/ (the policy via save_pretrained, plus
value_head.pt) and summary.json.

Launch:
    accelerate launch --config_file recipes/accelerate/local.yaml recipes/ppo.py
    accelerate launch --config_file recipes/accelerate/2cpu.yaml recipes/ppo.py
    accelerate launch --config_file recipes/accelerate/1gpu.yaml recipes/ppo.py \\
        --model Qwen/Qwen2.5-0.5B-Instruct --dataset data.jsonl --reward exact_match --lr 1e-6
"""

# ruff: noqa: E402
from __future__ import annotations

import os

# NOTE: before torch loads OpenMP (see recipes/grpo.py): passive waiting keeps a busy 2-core box usable.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse
import time

import torch
from _common import (
    REWARDS,
    add_overwrite_arg,
    add_run_args,
    checkpoint_step,
    fresh_output_dir,
    get_reward,
    load_policy_and_prompts,
    make_accelerator,
    plot_rewards,
    read_metrics,
    resolve_checkpoint,
    reward_span,
    run_engine_dtype,
    run_record,
    summarize,
    trainer_run_kwargs,
    write_json,
)
from accelerate.utils import set_seed

from rollout import ContinuousBatchingConfig
from trainers import PPOConfig, PPOTrainer
from trainers.sharding import full_state

# ----------------------------------------------------------------------------------- config
STEPS = 100
PROMPTS_PER_STEP = 128  # per process, one sample each
TEMPERATURE = 1.2  # as in recipes/grpo.py
LR = 5e-4
EPOCHS = 2  # passes over each rollout batch
MINIBATCHES = 2  # optimizer steps per pass
VF_COEF = 0.5
MAX_NEW_TOKENS = 6
TRAIN_PROMPTS = 4096
WARM_START = dict(target_exact=0.3, max_sft_steps=1000, seed=0)  # NOTE: its own seed (--sft_seed)
EMBEDDED_ENGINE = ContinuousBatchingConfig(page_size=16, num_blocks=512, max_batch_tokens=1024)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="local path or hub id (default: the embedded warm start)")
    p.add_argument("--dataset", default=None, help="json/jsonl/parquet/csv, save_to_disk dir or hub id")
    p.add_argument("--dataset_split", default="train")
    p.add_argument("--reward", default="addition", choices=sorted(REWARDS))
    p.add_argument("--steps", type=int, default=STEPS)
    p.add_argument("--prompts_per_step", type=int, default=PROMPTS_PER_STEP)
    p.add_argument("--group_size", type=int, default=1)
    p.add_argument("--temperature", type=float, default=TEMPERATURE)
    p.add_argument("--lr", type=float, default=LR)
    p.add_argument("--epochs", type=int, default=EPOCHS)
    p.add_argument("--minibatches", type=int, default=MINIBATCHES)
    p.add_argument("--vf_coef", type=float, default=VF_COEF)
    p.add_argument("--kl_coef", type=float, default=0.0)
    p.add_argument("--max_new_tokens", type=int, default=MAX_NEW_TOKENS)
    p.add_argument("--engine_dtype", default=None, help="run the engine on a cast copy, e.g. bfloat16")
    p.add_argument("--sft_target", type=float, default=WARM_START["target_exact"])
    p.add_argument("--sft_steps", type=int, default=WARM_START["max_sft_steps"])
    # NOTE: the warm start's own seed, as grpo.py's: --seed 1 as the warm start's seed never reached the band
    # (held-out 0.043 after 1,000 SFT steps, issue 62), so --seed varies the RL run only
    p.add_argument("--sft_seed", type=int, default=WARM_START["seed"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output_dir", default="runs/ppo")
    add_overwrite_arg(p)
    add_run_args(p)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    accelerator = make_accelerator(bf16=args.bf16, report_to=args.report_to)
    set_seed(args.seed)
    resume = resolve_checkpoint(args.output_dir, args.resume_from_checkpoint)
    fresh_output_dir(accelerator, args.output_dir, checkpoint_step(resume) if resume else None,
                     record=run_record("recipes/ppo.py", args), overwrite=args.overwrite)
    if args.report_to:
        accelerator.init_trackers("rollout-ppo", config=vars(args))
    start = time.perf_counter()

    # 1-2. the policy (a hub / local checkpoint, or the embedded model warm-started and saved here)
    # and the prompts, as a datasets.Dataset
    model_path, tokenizer, model, dataset, warm_start_s = load_policy_and_prompts(
        accelerator, args, TRAIN_PROMPTS, sft_seed=args.sft_seed
    )

    # 3. PPO (the trainer wraps the model with a value head)
    config = PPOConfig(
        output_dir=args.output_dir,
        max_steps=args.steps,
        prompts_per_step=args.prompts_per_step,
        group_size=args.group_size,
        temperature=args.temperature,
        max_new_tokens=args.max_new_tokens,
        learning_rate=args.lr,
        num_iterations=args.epochs,
        num_minibatches=args.minibatches,
        vf_coef=args.vf_coef,
        kl_coef=args.kl_coef,
        engine_dtype=run_engine_dtype(args),
        engine_config=None if args.model else EMBEDDED_ENGINE,
        seed=args.seed,
        log_stdout=False,
        **trainer_run_kwargs(args),
    )
    trainer = PPOTrainer(model, tokenizer, get_reward(args.reward), dataset, config, accelerator=accelerator)
    with trainer:
        if resume:  # NOTE: the value head is part of the prepared model, so its state comes back too
            trainer.load_checkpoint(resume)
        trainer.train()
    history = read_metrics(args.output_dir) if accelerator.is_main_process else []
    wall = time.perf_counter() - start

    # 4. outputs: final policy (+ value head), plot, summary
    accelerator.wait_for_everyone()
    summary = summarize(
        history,
        wall,
        warm_start_s=warm_start_s,
        num_processes=accelerator.num_processes,
        model=model_path,
        algorithm="ppo",
    )
    policy = trainer.gather_policy()  # NOTE: under FSDP every rank gathers the shards
    value_head = full_state(trainer.value_model.value_head)
    if accelerator.is_main_process:
        final = os.path.join(args.output_dir, "final")
        policy.save_pretrained(final)
        tokenizer.save_pretrained(final)
        torch.save(value_head, os.path.join(final, "value_head.pt"))
        first, last = summary["reward_first5"], summary["reward_last5"]
        title = f"ppo on {model_path}, T={args.temperature}: reward {first:.3f} -> {last:.3f}"
        plot_rewards(history, os.path.join(args.output_dir, "reward.png"), title)
        write_json(summary, os.path.join(args.output_dir, "summary.json"))
        print(
            f"{reward_span(summary)} in "
            f"{summary['steps']} steps on {accelerator.num_processes} process(es), {wall:.0f}s "
            f"(warm start {warm_start_s:.0f}s), outputs in {args.output_dir}"
        )
    accelerator.end_training()
    return summary


if __name__ == "__main__":
    main()
