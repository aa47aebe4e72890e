"""Helpers of the trainer tests (GRPO, PPO, two ranks, recipes) on the addition task's tiny models."""

from __future__ import annotations

import torch


def digit_share(prompts, completions, **columns):
    """Dense toy reward: the share of digit characters (varies inside a group from the start)."""
    return [sum(ch.isdigit() for ch in c) / max(len(c), 1) for c in completions]


def trained_state(trainer) -> dict[str, torch.Tensor]:
    """A copy of the trainer's model weights (the value head too, under PPO)."""
    return {k: v.detach().clone() for k, v in trainer.accelerator.unwrap_model(trainer.model).state_dict().items()}


def save_tiny_addition_checkpoint(path) -> str:
    """Save a tiny addition-task model (hidden 32, 1 layer, 2 heads, seed 0) and its tokenizer to `path`."""
    from trainers.tasks import build_tiny_model, make_addition_tokenizer

    tokenizer = make_addition_tokenizer()
    build_tiny_model(tokenizer, hidden_size=32, num_layers=1, num_heads=2, seed=0).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)
