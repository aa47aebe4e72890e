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
    """The mode's own figures over the run: mean / max staleness (per-step `staleness_mean` / `_max`), the largest
    rollout-vs-trainer logprob mismatch (`logprob_mismatch_max`) and, async, its largest value on the tokens the
    learner's current version sampled (`fresh_logprob_mismatch_max`), where the steps logged them."""
    out: dict = {}
    for key, reduce in (("staleness_mean", statistics.mean), ("staleness_max", max), ("logprob_mismatch_max", max),
                        ("fresh_logprob_mismatch_max", max)):
        values = [h[key] for h in history if h.get(key) is not None]
        if values:
            out[key] = reduce(values)
    return out


def mode_line(args, history: Sequence[dict]) -> str:
    """`mode: sync: logprob mismatch engine vs trainer (parity probe) max 6.1e-05`; async, what the mismatch
    compares: the behaviour policy (the version that sampled each token, as the engine scored it) against the
    current policy, which moved since (so it grows with staleness), and beside it the engine against the behaviour
    policy, measured on the tokens the current version sampled (the async run's parity probe)."""
    nums = mode_numbers(history)
    parts = []
    if "staleness_mean" in nums:
        parts.append(f"staleness mean {nums['staleness_mean']:.2f}, max {nums.get('staleness_max', 0):g}")
    if "logprob_mismatch_max" in nums:
        if getattr(args, "async_rollout", False):
            parts.append(f"logprob mismatch behaviour vs current policy (stale tokens included: the policy moved "
                         f"since) max {nums['logprob_mismatch_max']:.3g}")
            fresh = nums.get("fresh_logprob_mismatch_max")
            parts.append("engine vs behaviour policy (tokens the current version sampled) "
                         + (f"max {fresh:.3g}" if fresh is not None else "not measured: no such tokens"))
        else:
            parts.append(f"logprob mismatch engine vs trainer (parity probe) max {nums['logprob_mismatch_max']:.3g}")
    return f"mode: {mode_name(args)}" + (": " + "; ".join(parts) if parts else "")
