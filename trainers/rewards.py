"""Reward functions, called as TRL's `GRPOTrainer` calls them, and combined with weights.

A reward function is called by keyword:

    fn(prompts=..., completions=..., completion_ids=..., finish_reasons=..., trainer_state=...,
       log_metric=..., **dataset_columns) -> list[float | None]

one entry per completion (groups adjacent). `None` means "not applicable": that function is left
out of that row's weighted sum (TRL's `nansum`); a row for which every function returns None is
unscorable (reward NaN, advantage 0). Conversational rows (`prompt` is a list of messages) get
their completions as `[{"role": "assistant", "content": text}]`, as in TRL. So a function written
for TRL works unchanged:

    def accuracy(completions, solution, **kwargs): ...
    rewards, metrics = score_completions([accuracy, format_reward], rows, texts, group_size=8)
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from types import SimpleNamespace
from typing import Any

import torch
from torch import Tensor

from rollout.api.chat import is_conversational

RewardFn = Callable[..., Sequence[float | None]]

# NOTE: the row keys that are not passed on as dataset columns (TRL's list).
RESERVED_COLUMNS = ("prompt", "completion", "completion_ids")


def reward_name(fn: RewardFn, index: int) -> str:
    """A metric name for a reward function: its ``__name__`` (or its class's), else ``reward_{index}``."""
    name = getattr(fn, "__name__", None) or type(fn).__name__
    return name if name and name != "function" else f"reward_{index}"


def expand_rows(rows: Sequence[Mapping[str, Any]], group_size: int) -> tuple[list[Any], dict[str, list[Any]]]:
    """Per-completion prompts and dataset columns: each prompt row repeated ``group_size`` times.

    Returns ``(prompts [N], {column: values [N]})`` for every column but the reserved ones."""
    prompts = [row["prompt"] for row in rows for _ in range(group_size)]
    columns = [k for k in rows[0] if k not in RESERVED_COLUMNS] if rows else []
    return prompts, {k: [row[k] for row in rows for _ in range(group_size)] for k in columns}


def completions_for_rewards(prompts: Sequence[Any], texts: Sequence[str]) -> list[Any]:
    """Completions as TRL hands them over: the text, or an assistant message for chat rows."""
    return [
        [{"role": "assistant", "content": text}] if is_conversational(prompt) else text
        for prompt, text in zip(prompts, texts, strict=True)
    ]


def score_completions(
    reward_funcs: Sequence[RewardFn],
    rows: Sequence[Mapping[str, Any]],
    completions: Sequence[str],
    group_size: int,
    weights: Sequence[float] | None = None,
    *,
    completion_ids: Sequence[Sequence[int]] | None = None,
    finish_reasons: Sequence[str] | None = None,
    trainer_state: Any = None,
) -> tuple[Tensor, dict[str, float]]:
    """Weighted sum of every reward function's scores, TRL's convention.

    Args:
        reward_funcs: callables, called by keyword (see the module docstring).
        rows: the step's prompt rows (dicts with "prompt" and any extra columns), one per group.
        completions: ``[N = len(rows) x group_size]`` decoded completions, groups adjacent.
        weights: one per function (default 1 each).
        completion_ids, finish_reasons: ``[N]`` raw generated ids and "stop" / "length" / ...
        trainer_state: passed on as ``trainer_state`` (default: an object with ``global_step`` 0).
    Returns:
        ``(rewards [N] fp32, metrics)``: NaN where every function returned None; metrics hold
        ``"reward/<name>"``, the mean of that function's non-None scores (NaN if there were none),
        plus whatever the functions sent through ``log_metric(name, value)``.
    """
    if not reward_funcs:
        raise ValueError("at least one reward function is needed")
    weights = [1.0] * len(reward_funcs) if weights is None else [float(w) for w in weights]
    if len(weights) != len(reward_funcs):
        raise ValueError(f"reward_weights has {len(weights)} values for {len(reward_funcs)} reward functions")
    prompts, columns = expand_rows(rows, group_size)
    if len(completions) != len(prompts):
        raise ValueError(f"{len(completions)} completions for {len(rows)} prompts x group_size {group_size}")
    n = len(completions)
    metrics: dict[str, float] = {}

    def log_metric(name: str, value: float) -> None:
        metrics[name] = float(value)

    kwargs = dict(
        prompts=prompts,
        completions=completions_for_rewards(prompts, completions),
        completion_ids=[list(ids) for ids in completion_ids] if completion_ids is not None else None,
        finish_reasons=list(finish_reasons) if finish_reasons is not None else None,
        trainer_state=trainer_state if trainer_state is not None else SimpleNamespace(global_step=0),
        log_metric=log_metric,
        **columns,
    )
    per_func = torch.full((n, len(reward_funcs)), math.nan, dtype=torch.float32)  # [N, F]
    for i, fn in enumerate(reward_funcs):
        name = reward_name(fn, i)
        scores = list(fn(**kwargs))
        if len(scores) != n:
            raise ValueError(f"reward {name} returned {len(scores)} scores for {n} completions")
        values = [math.nan if s is None else float(s) for s in scores]
        if any(math.isnan(v) for v, s in zip(values, scores, strict=True) if s is not None):
            raise ValueError(f"reward {name} returned NaN (return None for 'not applicable')")
        per_func[:, i] = torch.tensor(values, dtype=torch.float32)
        present = per_func[:, i][~per_func[:, i].isnan()]
        metrics[f"reward/{name}"] = present.mean().item() if present.numel() else math.nan
    weighted = per_func * torch.tensor(weights, dtype=torch.float32)  # [N, F]
    total = weighted.nansum(dim=1)  # [N]
    total[per_func.isnan().all(dim=1)] = math.nan  # NOTE: unscorable rows: no reward, no advantage
    return total, metrics
