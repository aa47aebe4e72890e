"""The run's mode (synchronous, async, batch-invariant), named in the recipes' plot titles and summary lines
with the numbers that mode is about: the staleness of async rollouts, the trainer-engine logprob mismatch."""

from __future__ import annotations

import statistics
from collections.abc import Sequence


def mode_name(args) -> str:
    """"sync", "async (max_staleness N)", with ", batch-invariant" and ", LoRA rank r" when those are on."""
    name = f"async (max_staleness {args.max_staleness})" if getattr(args, "async_rollout", False) else "sync"
    name += ", batch-invariant" if getattr(args, "batch_invariant", False) else ""
    return name + (f", LoRA rank {args.lora_rank}" if getattr(args, "lora_rank", None) is not None else "")


def mode_numbers(history: Sequence[dict]) -> dict:
    """The mode's own figures over the run: mean / max staleness (per-step `staleness_mean` / `_max`) and the
    largest trainer-engine logprob mismatch (`logprob_mismatch_max`), where the steps logged them."""
    out: dict = {}
    for key, reduce in (("staleness_mean", statistics.mean), ("staleness_max", max), ("logprob_mismatch_max", max)):
        values = [h[key] for h in history if h.get(key) is not None]
        if values:
            out[key] = reduce(values)
    return out


def mode_line(args, history: Sequence[dict]) -> str:
    """`mode: async (max_staleness 1): staleness mean 0.47, max 1; logprob mismatch max 0`."""
    nums = mode_numbers(history)
    parts = []
    if "staleness_mean" in nums:
        parts.append(f"staleness mean {nums['staleness_mean']:.2f}, max {nums.get('staleness_max', 0):g}")
    if "logprob_mismatch_max" in nums:
        parts.append(f"logprob mismatch max {nums['logprob_mismatch_max']:.3g}")
    return f"mode: {mode_name(args)}" + (": " + "; ".join(parts) if parts else "")
