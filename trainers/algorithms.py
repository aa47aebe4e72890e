"""Registry of policy-gradient variants: which advantage, aggregation and clip each one uses.

A trainer asks for ``get_algorithm(name)`` and reads the choices off it instead of branching
on the name, so a new variant is one more entry in :data:`ALGORITHMS`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from trainers.losses import ADVANTAGE_SCALES, AGGREGATIONS, group_advantages


@dataclass(frozen=True, slots=True)
class Algorithm:
    """One policy-gradient variant.

    Args:
        name: registry key.
        advantage_scale: ``"std"`` or ``None``, passed to :func:`group_advantages`.
        agg: loss aggregation, a key of ``trainers.losses.AGGREGATIONS``.
        clip_low, clip_high: the ratio is clipped to ``[1 - clip_low, 1 + clip_high]``.
        drop_constant_groups: drop groups whose rewards are all equal (no learning signal; DAPO).
        use_gae: per-token advantages from a value head via GAE (PPO) instead of group-relative.
    """

    name: str
    advantage_scale: str | None
    agg: str
    clip_low: float
    clip_high: float
    drop_constant_groups: bool = False
    use_gae: bool = False

    def __post_init__(self) -> None:
        if self.advantage_scale not in ADVANTAGE_SCALES:
            raise ValueError(f"advantage_scale must be one of {list(ADVANTAGE_SCALES)}")
        if self.agg not in AGGREGATIONS:
            raise ValueError(f"agg {self.agg!r} not in {sorted(AGGREGATIONS)}")
        if not (0.0 <= self.clip_low < 1.0 and self.clip_high >= 0.0):
            raise ValueError(
                f"need 0 <= clip_low < 1 and clip_high >= 0, got {self.clip_low}, {self.clip_high}"
            )

    def advantages(self, rewards: Tensor, group_size: int) -> Tensor:
        """Group-relative advantages ``[N]`` with this variant's scaling."""
        return group_advantages(rewards, group_size, scale=self.advantage_scale)

    def keep_mask(self, rewards: Tensor, group_size: int) -> Tensor:
        """Bool ``[N]``: samples to train on (all of them unless constant groups are dropped)."""
        if self.drop_constant_groups:
            return nonconstant_group_mask(rewards, group_size)
        return torch.ones(rewards.shape[0], dtype=torch.bool, device=rewards.device)


def nonconstant_group_mask(rewards: Tensor, group_size: int) -> Tensor:
    """Bool keep-mask ``[N]``: False for every sample of a group whose rewards are all equal."""
    # rewards: [N] -> [N]
    if rewards.dim() != 1 or group_size < 1 or rewards.numel() % group_size != 0:
        raise ValueError(f"rewards of shape {tuple(rewards.shape)} do not split into groups of {group_size}")
    grouped = rewards.view(-1, group_size)  # [G, group_size]
    # NOTE: unscorable samples (NaN) are ignored: a group varies when its scored rewards differ.
    present = ~grouped.isnan()  # [G, group_size]
    high = torch.where(present, grouped, -math.inf).amax(dim=1)  # [G]
    low = torch.where(present, grouped, math.inf).amin(dim=1)  # [G]
    varies = high > low  # [G]
    return varies.repeat_interleave(group_size)  # [N]


ALGORITHMS: dict[str, Algorithm] = {
    a.name: a
    for a in (
        Algorithm("grpo", advantage_scale="std", agg="seq_mean_token_mean", clip_low=0.2, clip_high=0.2),
        Algorithm(
            "dr_grpo", advantage_scale=None, agg="seq_mean_token_sum_norm", clip_low=0.2, clip_high=0.2
        ),
        Algorithm(
            "dapo",
            advantage_scale="std",
            agg="token_mean",
            clip_low=0.2,
            clip_high=0.28,
            drop_constant_groups=True,
        ),
        Algorithm("ppo", advantage_scale=None, agg="token_mean", clip_low=0.2, clip_high=0.2, use_gae=True),
    )
}


def get_algorithm(name: str) -> Algorithm:
    """The registered variant called ``name``; ValueError listing the valid names otherwise."""
    try:
        return ALGORITHMS[name]
    except KeyError:
        raise ValueError(f"unknown algorithm {name!r}; valid: {sorted(ALGORITHMS)}") from None
