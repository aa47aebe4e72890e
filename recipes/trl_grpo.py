"""TRL's own `GRPOTrainer` with rollout as its generation backend (`rollout_func=make_rollout_func()`).

With no arguments this is the embedded CPU demo of recipes/grpo.py, trained by TRL instead of `trainers/`:
  1. the same warm start: a character-level addition tokenizer and a small Qwen3 model (hidden 128,
     3 layers) trained by SFT to ~30% greedy exact match, saved to OUTPUT_DIR/init and loaded back
     with `from_pretrained` (recipes/_common.py; the same settings give the same checkpoint);
  2. `trl.GRPOTrainer(..., rollout_func=make_rollout_func(config))`: one `RolloutEngine` per process,
     built on first use on the trainer's own model (no copy), its policy version bumped at every
     optimizer step; TRL itself does everything else (rewards, advantages, loss, optimizer, logging);
  3. per rollout batch: 32 prompts x 8 samples at temperature 1.2 (per process), reward = the exact
     addition verifier with per-digit partial credit in [0, 1], TRL's `loss_type="grpo"` (per-sequence
     token mean, clip 0.2), advantages scaled by the group std, no KL; 2 minibatches x 2 passes
     (`steps_per_generation=2`, `num_iterations=2`: 4 AdamW steps per rollout batch, lr 5e-4 constant);
     fp32 throughout (`bf16=False`; TRL's CPU default would autocast the loss pass to bf16);
  4. the rollout-vs-TRL logprob probe on (`logprob_probe=True`: TRL's own recomputation of every rollout
     token, logged as `sampling/sampling_logp_difference/{mean,max}`);
  5. OUTPUT_DIR/metrics.jsonl (one record per rollout batch: TRL's logs plus `step`, `reward_mean`),
     reward.png, final/ (save_pretrained) and summary.json (first-5 / last-5 reward, wall time,
     held-out greedy exact match before and after).

Launch (the default, 60 rollout batches, took 5 min 7 s on 2 shared CPU cores, plus the warm start the
first time: 1-2.5 min; reward 0.552 -> 0.681 first 5 -> last 5 batches; 2 ranks: 5 min 44 s, 0.554 -> 0.742):
    accelerate launch --config_file recipes/accelerate/local.yaml recipes/trl_grpo.py
    accelerate launch --config_file recipes/accelerate/2cpu.yaml recipes/trl_grpo.py   # 2 CPU ranks
    accelerate launch --multi_gpu --num_processes 2 recipes/trl_grpo.py                # the same, inline
`--model`, `--dataset`, `--reward` as in recipes/grpo.py; a dataset whose `prompt` column holds chat
messages goes through the tokenizer's chat template.
"""

# ruff: noqa: E402
from __future__ import annotations

import os

# NOTE: set before torch loads OpenMP (see recipes/grpo.py): busy-waiting threads make a shared
# 2-core machine many times slower on this model's small matrices.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")  # rollout_func is marked experimental in TRL 1.16

import argparse
import json
import time

import torch
import trl
from _common import (
    GRPO_EMBEDDED_ENGINE,
    GRPO_WARM_START,
    REWARDS,
    add_overwrite_arg,
    fresh_output_dir,
    get_reward,
    load_policy_and_prompts,
    make_accelerator,
    plot_rewards,
    reward_span,
    run_record,
    summarize,
    write_json,
)
from transformers import TrainerCallback
from transformers.trainer_callback import ProgressCallback

from rollout.integrations.trl import make_rollout_func
from trainers.tasks import AdditionTask, greedy_accuracy

# ----------------------------------------------------------------------------------- config
STEPS = 60  # rollout batches (each is STEPS_PER_GENERATION x ITERATIONS optimizer steps)
PROMPTS_PER_STEP = 32  # per process
GROUP_SIZE = 8  # samples per prompt: 256 rollouts per batch and process
TEMPERATURE = 1.2
LR = 5e-4
STEPS_PER_GENERATION = 2  # minibatches per rollout batch ...
ITERATIONS = 2  # ... and passes over it: 4 AdamW steps per rollout batch, as in recipes/grpo.py
MAX_NEW_TOKENS = 5
TRAIN_PROMPTS = 8192
HELDOUT = 512
WARM_START = GRPO_WARM_START  # recipes/grpo.py's: the same checkpoint
EMBEDDED_ENGINE = GRPO_EMBEDDED_ENGINE


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="local path or hub id (default: the embedded warm start)")
    p.add_argument("--dataset", default=None, help="json/jsonl/parquet/csv, save_to_disk dir or hub id")
    p.add_argument("--dataset_split", default="train")
    p.add_argument("--reward", default="addition", choices=sorted(REWARDS))
    p.add_argument("--steps", type=int, default=STEPS, help="rollout batches")
    p.add_argument("--prompts_per_step", type=int, default=PROMPTS_PER_STEP, help="per process")
    p.add_argument("--group_size", type=int, default=GROUP_SIZE)
    p.add_argument("--temperature", type=float, default=TEMPERATURE)
    p.add_argument("--lr", type=float, default=LR)
    p.add_argument("--steps_per_generation", type=int, default=STEPS_PER_GENERATION)
    p.add_argument("--iterations", type=int, default=ITERATIONS)
    p.add_argument("--max_new_tokens", type=int, default=MAX_NEW_TOKENS)
    p.add_argument("--no_probe", action="store_true", help="skip the rollout-vs-TRL logprob probe")
    p.add_argument("--sft_target", type=float, default=WARM_START["target_exact"])
    p.add_argument("--sft_steps", type=int, default=WARM_START["max_sft_steps"])
    p.add_argument("--sft_seed", type=int, default=WARM_START["seed"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output_dir", default="runs/trl_grpo")
    add_overwrite_arg(p)
    return p.parse_args(argv)


class MetricsFile(TrainerCallback):
    """One JSON line per rollout batch in metrics.jsonl (TRL's logs, plus `step` and `reward_mean` as
    in the other recipes) and a one-line bar with the reward, instead of TRL printing every log dict."""

    def __init__(self, path: str, is_main: bool) -> None:
        from tqdm.auto import tqdm

        self.path, self.history = path, []
        self.bar = tqdm(desc="trl grpo", unit="batch", disable=not is_main)

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not logs or "reward" not in logs:
            return
        record = {"step": len(self.history) + 1, "global_step": state.global_step,
                  "reward_mean": logs["reward"], "time": time.time(), **logs}
        self.history.append(record)
        if state.is_world_process_zero:
            with open(self.path, "a") as f:
                f.write(json.dumps(record) + "\n")
        self.bar.update(1)
        self.bar.set_postfix(reward=f"{logs['reward']:.3f}")

    def on_train_end(self, args, state, control, **kwargs):
        self.bar.close()


def trl_config(args) -> tuple[trl.GRPOConfig, int]:
    """TRL's config for the run, and the optimizer steps per rollout batch."""
    rows = args.prompts_per_step * args.group_size  # per process and rollout batch
    if rows % args.steps_per_generation:
        raise ValueError(f"prompts_per_step x group_size ({rows}) must divide into {args.steps_per_generation} "
                         "minibatches")
    every = args.steps_per_generation * args.iterations  # optimizer steps per rollout batch
    config = trl.GRPOConfig(
        output_dir=args.output_dir,
        max_steps=args.steps * every,
        per_device_train_batch_size=rows // args.steps_per_generation,
        steps_per_generation=args.steps_per_generation,
        num_iterations=args.iterations,
        num_generations=args.group_size,
        max_completion_length=args.max_new_tokens,
        temperature=args.temperature,
        learning_rate=args.lr,
        lr_scheduler_type="constant",
        loss_type="grpo",
        beta=0.0,
        bf16=False,
        gradient_checkpointing=False,
        use_cpu=not torch.cuda.is_available(),
        logging_steps=every,  # one log per rollout batch: its rewards and the mean of its 4 losses
        save_strategy="no",
        report_to=[],
        seed=args.seed,
    )
    return config, every


def write_outputs(args, accelerator, policy, tokenizer, summary: dict, history: list, heldout: dict) -> None:
    """Rank 0: the final checkpoint, the reward plot, summary.json and the summary lines."""
    if not accelerator.is_main_process:
        return
    wall, warm_start_s = summary["wall_time_s"], summary["warm_start_s"]
    final = os.path.join(args.output_dir, "final")
    policy.save_pretrained(final)
    tokenizer.save_pretrained(final)
    first, last = summary["reward_first5"], summary["reward_last5"]
    title = f"TRL GRPOTrainer + rollout, {accelerator.num_processes} process(es): reward {first:.3f} -> {last:.3f}"
    plot_rewards(history, os.path.join(args.output_dir, "reward.png"), title)
    write_json(summary, os.path.join(args.output_dir, "summary.json"))
    print(
        f"{reward_span(summary)} in {summary['steps']} rollout "
        f"batches on {accelerator.num_processes} process(es), {wall:.0f}s (warm start {warm_start_s:.0f}s, "
        f"generation {summary['time_generate_s']:.0f}s); logprob gap max {summary['logprob_gap_max']}; "
        f"outputs in {args.output_dir}"
    )
    for i, r in enumerate(summary["ranks"]):
        print(
            f"rank {i}: its engine at policy version {r['engine_policy_version']}, parameter sum {r['param_sum']:.6f}"
        )
    if heldout:
        before, after = heldout["greedy_before"], heldout["greedy_after"]
        print(f"held-out greedy exact match {before['exact']:.3f} -> {after['exact']:.3f} ({HELDOUT} problems)")


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    accelerator = make_accelerator()  # NOTE: cpu=True on a CPU machine, so a 2-process launch runs 2 real ranks
    fresh_output_dir(accelerator, args.output_dir, record=run_record("recipes/trl_grpo.py", args),
                     overwrite=args.overwrite)
    metrics_path = os.path.join(args.output_dir, "metrics.jsonl")
    start = time.perf_counter()

    # 1. the policy and the prompts (recipes/grpo.py's warm start and dataset)
    model_path, tokenizer, model, dataset, warm_start_s = load_policy_and_prompts(
        accelerator, args, TRAIN_PROMPTS, sft_seed=args.sft_seed
    )
    heldout = {}
    if not args.dataset and accelerator.is_main_process:
        heldout["greedy_before"] = greedy_accuracy(model, tokenizer, AdditionTask(num_digits=3), n=HELDOUT)

    # 2. TRL's GRPOTrainer with rollout generating
    config, every = trl_config(args)
    rollout_func = make_rollout_func(None if args.model else EMBEDDED_ENGINE, logprob_probe=not args.no_probe)
    trainer = trl.GRPOTrainer(
        model=model,
        reward_funcs=get_reward(args.reward),
        args=config,
        train_dataset=dataset,
        processing_class=tokenizer,
        rollout_func=rollout_func,
    )
    trainer.remove_callback(ProgressCallback)
    metrics = MetricsFile(metrics_path, accelerator.is_main_process)
    trainer.add_callback(metrics)
    trainer.train()
    wall = time.perf_counter() - start
    # each rank's own engine (its policy version = optimizer steps seen) and its weights: DDP keeps them equal
    policy = trainer.accelerator.unwrap_model(trainer.model)
    mine = torch.tensor(
        [[float(rollout_func.engine.policy_version), sum(p.double().sum() for p in policy.parameters())]]
    )
    ranks = trainer.accelerator.gather(mine.to(trainer.accelerator.device)).cpu().tolist()  # [W, 2]
    rollout_func.close()

    # 3. outputs: final checkpoint, plot, summary
    accelerator.wait_for_everyone()
    history = [{**h, "time_generate": h.get("rollout/generate_s", 0.0), "time_train": h.get("step_time", 0.0) * every,
                "rollout_tokens_per_s": h.get("rollout/tokens_per_s", 0.0)} for h in metrics.history]
    if heldout:
        heldout["greedy_after"] = greedy_accuracy(policy, tokenizer, AdditionTask(num_digits=3), n=HELDOUT)
    gaps = [h["sampling/sampling_logp_difference/max"] for h in history if "sampling/sampling_logp_difference/max" in h]
    summary = summarize(history, wall, warm_start_s=warm_start_s, num_processes=accelerator.num_processes,
                        model=model_path, backend="rollout (TRL rollout_func)",
                        logprob_gap_max=max(gaps) if gaps else None,
                        ranks=[{"engine_policy_version": int(v), "param_sum": w} for v, w in ranks], **heldout)
    write_outputs(args, accelerator, policy, tokenizer, summary, history, heldout)
    return summary


if __name__ == "__main__":
    main()
