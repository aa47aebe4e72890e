"""How a fleet cuts one call into per-engine shards and puts the answers back together (pure bookkeeping)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from rollout.api.score_batch import ScoreBatch

# NOTE: the per-prompt (per-row) arguments of `generate` / `score`: one value for all, or a list of one each


def plan_shards(n: int, load: Sequence[int], live: Sequence[int]) -> list[tuple[int, int, int]]:
    """`(engine, start, end)` contiguous shards of `n` items over the `live` engines: each next item goes to the
    engine with the least work (`load`, items already in flight, plus what this call gave it), lowest index on
    ties; then each engine's count becomes one contiguous range, in engine order."""
    if not live:
        raise RuntimeError("no rollout engine left alive")
    counts = dict.fromkeys(live, 0)
    for _ in range(n):
        k = min(live, key=lambda j: (load[j] + counts[j], j))
        counts[k] += 1
    shards, start = [], 0
    for k in live:
        if counts[k]:
            shards.append((k, start, start + counts[k]))
            start += counts[k]
    return shards


def _pad(t: torch.Tensor | None, width: int, dim: int, left: bool = False) -> torch.Tensor | None:
    if t is None or t.shape[dim] == width:
        return t
    shape = list(t.shape)
    shape[dim] = width - t.shape[dim]
    fill = torch.zeros(shape, dtype=t.dtype)
    return torch.cat([fill, t] if left else [t, fill], dim=dim)


def merge_scores(parts: Sequence[ScoreBatch], prompts: Sequence[Sequence[int]],
                 completions: Sequence[Sequence[int]], width: int | None) -> ScoreBatch:
    """One `ScoreBatch` of the shards' (in row order): completions right-padded to `width` (default the longest),
    prompt logprobs left-padded to the longest prompt, as one engine would have packed them."""
    t_len = max((len(c) for c in completions), default=0) if width is None else width
    p_len = max((len(p) for p in prompts), default=0)
    parts = [p.to("cpu") for p in parts]

    def cat(name: str, size: int, dim: int, left: bool = False):
        values = [getattr(p, name) for p in parts]
        if not values or values[0] is None:
            return None
        return torch.cat([_pad(v, size, dim, left) for v in values])

    if not parts:
        return ScoreBatch(logprobs=torch.zeros((0, t_len)), mask=torch.zeros((0, t_len), dtype=torch.long))
    return ScoreBatch(logprobs=cat("logprobs", t_len, 1), mask=cat("mask", t_len, 1),
                      top_logprobs=cat("top_logprobs", t_len, 1), top_ids=cat("top_ids", t_len, 1),
                      prompt_logprobs=cat("prompt_logprobs", p_len, 1, left=True),
                      prompt_mask=cat("prompt_mask", p_len, 1, left=True))
