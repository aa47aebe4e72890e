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


def build_tiny_moe_model(tokenizer, seed: int = 0, initializer_range: float = 0.1):
    """A tiny fp32 Qwen3-MoE policy for the addition task (hidden 64, 2 sparse layers of 8 experts, 2 per token)."""
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    config = Qwen3MoeConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8,
        num_experts_per_tok=2, norm_topk_prob=True, max_position_embeddings=128, tie_word_embeddings=True,
        initializer_range=initializer_range, pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
    )
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config)
