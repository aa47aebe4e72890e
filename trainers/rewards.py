"""Reward functions: plain callables ``(prompts, completions, **dataset_columns) -> list[float]``,
several combined with weights into one scalar reward per completion.

    rewards, metrics = score_completions([addition_reward, length_penalty], rows, completions,
                                         group_size=8, weights=[1.0, 0.1])
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

RewardFn = Callable[..., Sequence[float]]


def reward_name(fn: RewardFn, index: int) -> str:
    """A metric name for a reward function: its ``__name__`` (or its class's), else ``reward_{index}``."""
    name = getattr(fn, "__name__", None) or type(fn).__name__
    return name if name and name != "function" else f"reward_{index}"


def expand_rows(rows: Sequence[Mapping[str, Any]], group_size: int) -> tuple[list[Any], dict[str, list[Any]]]:
    """Per-completion prompts and dataset columns: each prompt row repeated ``group_size`` times.

    Returns ``(prompts [N], {column: values [N]})`` for every column but "prompt"."""
    prompts = [row["prompt"] for row in rows for _ in range(group_size)]
    columns = [k for k in rows[0] if k != "prompt"] if rows else []
    return prompts, {k: [row[k] for row in rows for _ in range(group_size)] for k in columns}


def score_completions(
    reward_funcs: Sequence[RewardFn],
    rows: Sequence[Mapping[str, Any]],
    completions: Sequence[str],
    group_size: int,
    weights: Sequence[float] | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """Weighted sum of every reward function's scores.

    Args:
        reward_funcs: callables ``(prompts, completions, **columns) -> list[float]``.
        rows: the step's prompt rows (dicts with "prompt" and any extra columns), one per group.
        completions: ``[N = len(rows) x group_size]`` decoded completions, groups adjacent.
        weights: one per function (default 1 each).
    Returns:
        ``(rewards [N] fp32, {"reward/<name>": mean score of that function})``.
    """
    if not reward_funcs:
        raise ValueError("at least one reward function is needed")
    weights = [1.0] * len(reward_funcs) if weights is None else [float(w) for w in weights]
    if len(weights) != len(reward_funcs):
        raise ValueError(f"reward_weights has {len(weights)} values for {len(reward_funcs)} reward functions")
    prompts, columns = expand_rows(rows, group_size)
    if len(completions) != len(prompts):
        raise ValueError(f"{len(completions)} completions for {len(rows)} prompts x group_size {group_size}")
    total = torch.zeros(len(completions), dtype=torch.float32)  # [N]
    metrics: dict[str, float] = {}
    for i, (fn, weight) in enumerate(zip(reward_funcs, weights, strict=True)):
        name = reward_name(fn, i)
        scores = [float(s) for s in fn(prompts, list(completions), **columns)]
        if len(scores) != len(completions):
            raise ValueError(
                f"reward {name} returned {len(scores)} scores for {len(completions)} completions"
            )
        if any(math.isnan(s) for s in scores):
            raise ValueError(f"reward {name} returned NaN")
        values = torch.tensor(scores, dtype=torch.float32)  # [N]
        total += weight * values
        metrics[f"reward/{name}"] = values.mean().item()
    return total, metrics
