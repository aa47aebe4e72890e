"""Agentic GRPO: a policy learns to call a calculator tool over multi-turn episodes.

With no arguments this is the embedded CPU demo, end to end and offline:
  1. a character-level tokenizer with a chat template (`<|user|>`, `<|assistant|>`, `<|tool|>` turns) and a
     `<tool_call>` token (`trainers.calculator`);
  2. a small Qwen3 (hidden 64, 2 layers) built from scratch and warm-started by SFT on episodes of 4-digit
     additions ("4821+0377"): half the demos call the calculator (`<tool_call>4821+0377`, the tool answers
     `5198`, the model copies it) and half answer directly (a tiny model cannot add 4-digit numbers, so
     those are mostly wrong); the call token is labelled so the policy starts calling the tool ~15% of the
     time. Saved with `save_pretrained` to OUTPUT_DIR/init and loaded back with `from_pretrained`;
  3. GRPO over episodes (`trainers.AgentGRPOTrainer`, `rollout.agents.run_episodes`): per step 16 problems
     x 8 episodes of at most 2 model turns at temperature 1; reward 1 for the exact sum in the final answer;
     advantages (r - group mean) / group std; the loss counts the model's tokens only (the tool's turn is
     masked out); 1 pass, 1 AdamW step at lr 1e-3 per batch; no KL term;
  4. OUTPUT_DIR/metrics.jsonl (reward_mean, tool_use_rate, num_turns, response_length = model tokens, ...),
     reward.png (reward and tool-use rate per step), summary.json (first-5 / last-5 reward and tool-use
     rate, wall time, greedy held-out accuracy and tool use before and after), final/ (save_pretrained),
     and a few sampled trajectories printed.

Launch (the default took 106 s on 2 CPU cores shared with other jobs, load ~9: warm start 64 s, 50 RL steps ~40 s;
the warm start is reused by later runs in the same OUTPUT_DIR):
    accelerate launch --config_file recipes/accelerate/local.yaml recipes/agent_grpo.py
    accelerate launch --config_file recipes/accelerate/local.yaml recipes/agent_grpo.py --algorithm dapo \\
        --output_dir runs/agent_dapo
    accelerate launch --config_file recipes/accelerate/2cpu.yaml recipes/agent_grpo.py --prompts_per_step 8
"""

# ruff: noqa: E402
from __future__ import annotations

import os

# NOTE: set before torch loads OpenMP (see recipes/grpo.py): busy-waiting OpenMP threads on a shared
# 2-core machine make this model's small matrices many times slower.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse
import json
import time

import torch
from _common import (
    add_overwrite_arg,
    fresh_output_dir,
    make_accelerator,
    read_metrics,
    reward_window,
    run_record,
    smooth,
    summarize,
    wrapped_title,
    write_json,
)
from accelerate.utils import set_seed

from rollout import ContinuousBatchingConfig
from rollout.agents import run_episodes
from trainers import AgentGRPOConfig, AgentGRPOTrainer
from trainers.calculator import (
    CalculatorEnv,
    calculator_dataset,
    calculator_problems,
    calculator_warm_start,
    describe,
    episode_stats,
    make_calculator_tokenizer,
)
from trainers.tasks import build_tiny_model

# ----------------------------------------------------------------------------------- config
STEPS = 50  # RL steps
PROMPTS_PER_STEP = 16  # problems per step and process
GROUP_SIZE = 8  # episodes per problem
MAX_TURNS = 2  # a tool call and an answer (a second call is refused: the episode ends)
MAX_NEW_TOKENS = 12  # per model turn: "<tool_call>" + 9 characters + eos
TEMPERATURE = 1.0
LR = 1e-3  # the embedded model is tiny and trained from scratch
NUM_DIGITS = 4
WARM_START = dict(hidden_size=64, num_layers=2, steps=300, tool_share=0.15, tool_demos=0.5, seed=0)
HELDOUT = 256  # held-out problems for greedy accuracy / tool use before and after RL
ENGINE = ContinuousBatchingConfig(page_size=16, num_blocks=1024, max_batch_tokens=4096)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--algorithm", default="grpo", choices=["grpo", "dr_grpo", "dapo"])
    p.add_argument("--steps", type=int, default=STEPS)
    p.add_argument("--prompts_per_step", type=int, default=PROMPTS_PER_STEP)
    p.add_argument("--group_size", type=int, default=GROUP_SIZE)
    p.add_argument("--max_turns", type=int, default=MAX_TURNS)
    p.add_argument("--temperature", type=float, default=TEMPERATURE)
    p.add_argument("--lr", type=float, default=LR)
    p.add_argument("--sft_steps", type=int, default=WARM_START["steps"])
    p.add_argument("--tool_share", type=float, default=WARM_START["tool_share"],
                   help="how often the warm-started policy calls the tool")
    p.add_argument("--heldout", type=int, default=HELDOUT)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output_dir", default="runs/agent_grpo")
    add_overwrite_arg(p)
    return p.parse_args(argv)


def warm_start(accelerator, path: str, settings: dict) -> str:
    """Rank 0 builds and saves the warm-started policy at `path` (reused when built with the same settings)."""
    record = os.path.join(path, "warm_start.json")
    if accelerator.is_main_process:
        saved = json.load(open(record)) if os.path.exists(record) else None
        if saved == settings:
            print(f"warm start: reusing {path}")
        else:
            tokenizer = make_calculator_tokenizer()
            model = build_tiny_model(tokenizer, hidden_size=settings["hidden_size"], num_layers=settings["num_layers"],
                                     seed=settings["seed"])
            calculator_warm_start(model, tokenizer, tool_share=settings["tool_share"],
                                  tool_demos=settings["tool_demos"], steps=settings["steps"], num_digits=NUM_DIGITS,
                                  seed=settings["seed"])
            model.save_pretrained(path)
            tokenizer.save_pretrained(path)
            with open(record, "w") as f:
                json.dump(settings, f)
    accelerator.wait_for_everyone()
    return path


def greedy_eval(engine, tokenizer, n: int) -> dict[str, float]:
    """Greedy episodes on `n` held-out problems: exact-answer rate and tool-use rate."""
    rows = calculator_problems(n, NUM_DIGITS, seed=10_000)
    batch = run_episodes(engine, CalculatorEnv, rows, group_size=1, max_turns=MAX_TURNS, temps=0.0,
                         max_new_tokens=MAX_NEW_TOKENS)
    return {"accuracy": batch.rewards.mean().item(), **episode_stats(batch, tokenizer)}


def plot(history: list[dict], path: str, title: str) -> str:
    """Reward and tool-use rate per step (raw points and EMA), one PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [h["step"] for h in history]
    fig, ax = plt.subplots(figsize=(7, 3.8), dpi=100)
    for key, color, label in (("reward_mean", "tab:blue", "reward (exact answer)"),
                              ("tool_use_rate", "tab:orange", "tool-use rate")):
        values = [h[key] for h in history]
        ax.plot(steps, values, "o", color=color, alpha=0.35, markersize=3)
        ax.plot(steps, smooth(values), color=color, linewidth=2, label=label)
    ax.set_xlabel("RL step")
    ax.set_ylabel("mean reward / tool-use rate")
    ax.set_ylim(-0.02, 1.02)
    ax.set_title(wrapped_title(title, 70), fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    accelerator = make_accelerator()
    set_seed(args.seed)
    fresh_output_dir(accelerator, args.output_dir, record=run_record("recipes/agent_grpo.py", args),
                     overwrite=args.overwrite)
    start = time.perf_counter()

    # 1-2. the warm-started policy, saved and loaded back as a hub checkpoint would be
    from transformers import AutoModelForCausalLM, AutoTokenizer

    settings = {**WARM_START, "steps": args.sft_steps, "tool_share": args.tool_share}
    init = warm_start(accelerator, os.path.join(args.output_dir, "init"), settings)
    warm_start_s = time.perf_counter() - start
    tokenizer = AutoTokenizer.from_pretrained(init)
    model = AutoModelForCausalLM.from_pretrained(init, dtype=torch.float32)
    dataset = calculator_dataset(args.steps * args.prompts_per_step * accelerator.num_processes, NUM_DIGITS,
                                 seed=1000 + args.seed)

    # 3. GRPO over episodes
    config = AgentGRPOConfig(
        output_dir=args.output_dir,
        algorithm=args.algorithm,
        max_steps=args.steps,
        prompts_per_step=args.prompts_per_step,
        group_size=args.group_size,
        max_turns=args.max_turns,
        max_new_tokens=MAX_NEW_TOKENS,
        temperature=args.temperature,
        learning_rate=args.lr,
        engine_config=ENGINE,
        seed=args.seed,
        log_stdout=False,
    )
    trainer = AgentGRPOTrainer(model, tokenizer, CalculatorEnv, dataset, config, accelerator=accelerator,
                               episode_metrics=lambda batch: episode_stats(batch, tokenizer))
    heldout = {}
    with trainer:
        if accelerator.is_main_process and args.heldout:
            heldout["greedy_before"] = greedy_eval(trainer.engine, tokenizer, args.heldout)
        trainer.train()
        accelerator.wait_for_everyone()
        if accelerator.is_main_process and args.heldout:
            heldout["greedy_after"] = greedy_eval(trainer.engine, tokenizer, args.heldout)
        examples = run_episodes(trainer.engine, CalculatorEnv, calculator_problems(4, NUM_DIGITS, seed=7), group_size=1,
                                max_turns=args.max_turns, temps=args.temperature, max_new_tokens=MAX_NEW_TOKENS, seed=0)
    wall = time.perf_counter() - start

    # 4. outputs
    history = read_metrics(args.output_dir) if accelerator.is_main_process else []
    tool_rates = [h["tool_use_rate"] for h in history]
    window = reward_window(len(tool_rates))
    summary = summarize(
        history, wall, warm_start_s=warm_start_s, num_processes=accelerator.num_processes, algorithm=args.algorithm,
        tool_use_first5=sum(tool_rates[:window]) / max(1, len(tool_rates[:window])),
        tool_use_last5=sum(tool_rates[-window:]) / max(1, len(tool_rates[-window:])),
        examples=describe(examples, tokenizer, range(len(examples))), **heldout,
    )
    policy = trainer.gather_policy()  # NOTE: under FSDP every rank gathers the shards
    if accelerator.is_main_process:
        final = os.path.join(args.output_dir, "final")
        policy.save_pretrained(final)
        tokenizer.save_pretrained(final)
        title = (f"{args.algorithm} + calculator tool, first/last {summary['reward_window']} steps: reward "
                 f"{summary['reward_first5']:.2f} -> "
                 f"{summary['reward_last5']:.2f}, tool use {summary['tool_use_first5']:.2f} -> "
                 f"{summary['tool_use_last5']:.2f}")
        plot(history, os.path.join(args.output_dir, "reward.png"), title)
        write_json(summary, os.path.join(args.output_dir, "summary.json"))
        print(f"{title} in {summary['steps']} steps, {wall:.0f}s (warm start {warm_start_s:.0f}s); "
              f"outputs in {args.output_dir}")
        if heldout:
            before, after = heldout["greedy_before"], heldout["greedy_after"]
            print(f"held-out greedy: accuracy {before['accuracy']:.3f} -> {after['accuracy']:.3f}, "
                  f"tool use {before['tool_use_rate']:.3f} -> {after['tool_use_rate']:.3f} ({args.heldout} problems)")
        for text in summary["examples"]:
            print("  " + text)
    accelerator.end_training()
    return summary


if __name__ == "__main__":
    main()
