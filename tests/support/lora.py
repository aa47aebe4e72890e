"""LoRA test helpers: PEFT adapters on a copy of a tiny model, with every LoRA tensor drawn non-zero (PEFT starts
B at zero, where an adapter changes nothing and a test of it could not fail)."""

from __future__ import annotations

import copy

import torch


def make_peft(base: torch.nn.Module, seed: int, r: int = 4, targets="all-linear", std: float = 0.2, **config):
    """A `PeftModel` of LoRA rank `r` on a deep copy of `base` (the base itself is left alone), in eval mode."""
    from peft import LoraConfig, get_peft_model

    cfg = LoraConfig(r=r, lora_alpha=config.pop("lora_alpha", 2 * r), target_modules=targets, lora_dropout=0.0,
                     **config)
    model = get_peft_model(copy.deepcopy(base), cfg)
    redraw(model, seed, std)
    return model.eval()


def redraw(model: torch.nn.Module, seed: int, std: float = 0.2) -> None:
    """Draw every LoRA tensor of `model` again from N(0, std) (seeded), in place."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * std)
