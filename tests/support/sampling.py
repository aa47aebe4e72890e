"""Helpers of the sampling-controls tests: prompts that repeat tokens (so history-dependent processors
change the greedy output) and transformers' `generate` with a given `GenerationConfig` as the oracle."""

from __future__ import annotations

import torch
from transformers import GenerationConfig

from .tiny_models import VOCAB, hf_greedy


def repeating_prompt(model, seed: int = 0, length: int = 8, echo: int = 8) -> list[int]:
    """P + G + P with P random and G model's greedy continuation of P: the greedy continuation of the whole
    tends to repeat G, so penalties, n-gram bans and sequence biases change it."""
    g = torch.Generator().manual_seed(seed)
    p = torch.randint(4, VOCAB, (length,), generator=g).tolist()
    return p + hf_greedy(model, p, echo) + p


@torch.no_grad()
def hf_generate(model, prompt: list[int], gc: GenerationConfig) -> list[int]:
    """transformers' own `generate` with `gc` on one prompt: the generated tokens (EOS included)."""
    ids = torch.tensor([prompt], device=model.device)
    out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=gc)
    return out[0, len(prompt):].tolist()


# NOTE: processor fields a case may give one value per row (a list); the rest are one value for every row
PER_ROW = ("repetition_penalty", "presence_penalty", "frequency_penalty", "min_p", "min_tokens", "logit_bias")


def sampling_of(kw: dict, rows: int = 1):
    """A case's processor keywords as `SamplingParams`: one for every row, or one per row when a per-row field
    holds a list (`generate(sampling=...)` / `score(sampling=...)` take either)."""
    from rollout import SamplingParams

    per_row = {k: v for k, v in kw.items() if k in PER_ROW and isinstance(v, list)}
    if not per_row:
        return SamplingParams(**kw)
    return [SamplingParams(**{**kw, **{k: v[i] for k, v in per_row.items()}}) for i in range(rows)]
