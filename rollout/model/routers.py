"""The MoE routers of a Hugging Face model: which modules they are, and their gate weights over given experts.

transformers 5 gives each sparse MoE block a router module (`Qwen3MoeTopKRouter`, `MixtralTopKRouter`,
`OlmoeTopKRouter`, `GptOssTopKRouter`) whose forward maps hidden states `[T, H]` to
`(router_logits [T, E], gate weights [T, k], expert indices [T, k])`; the block hands the last two to its
experts. So the experts a token goes to can be read (the engine's route recording, `rollout.model.routes`) and
set (routing replay, `trainers.routing_replay`) on the router's output alone, for every one of those models.

`GATES` holds, per router class, how its gate weights follow from its logits for a given set of experts (the
class's own formula with the top-k indices given instead of chosen): with the router's own indices they are its
own weights bitwise. Pure functions; nothing here patches a module.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F


def _softmax_then_pick(normalise: Callable[[torch.nn.Module], bool], cast: bool):
    """Qwen3-MoE / OLMoE / Mixtral: softmax over all experts in fp32, the picked probabilities, renormalised
    to sum 1 when the router does, cast back to the logits' dtype when the class does."""

    def gate(router: torch.nn.Module, logits: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        probs = F.softmax(logits, dtype=torch.float, dim=-1)  # [T, E]
        picked = probs.gather(-1, experts)  # [T, k]
        if normalise(router):
            picked = picked / picked.sum(dim=-1, keepdim=True)
        return picked.to(logits.dtype) if cast else picked

    return gate


def _pick_then_softmax(router: torch.nn.Module, logits: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
    """gpt-oss: softmax over the picked experts' logits only."""
    picked = logits.gather(-1, experts)  # [T, k]
    return F.softmax(picked, dim=1, dtype=picked.dtype)


# NOTE: keyed by class name (the classes live in optional model files); each returns weights [T, k].
GATES: dict[str, Callable[[torch.nn.Module, torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "Qwen3MoeTopKRouter": _softmax_then_pick(lambda r: r.norm_topk_prob, cast=True),
    "OlmoeTopKRouter": _softmax_then_pick(lambda r: r.norm_topk_prob, cast=True),
    "MixtralTopKRouter": _softmax_then_pick(lambda r: True, cast=False),
    "GptOssTopKRouter": _pick_then_softmax,
}


def moe_routers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The router module of each MoE layer of `model`, in layer order (empty for a dense model).

    ValueError for a module that looks like a top-k router (a class name ending in "TopKRouter") of a class
    `GATES` does not know: its experts could be neither recorded nor replayed correctly."""
    found = []
    for module in model.modules():
        name = type(module).__name__
        if name in GATES:
            found.append(module)
        elif name.endswith("TopKRouter"):
            raise ValueError(
                f"{name} is a mixture-of-experts router rollout does not know (routes are recorded and replayed "
                f"for {sorted(GATES)}): add its gate formula to rollout.model.routers.GATES"
            )
    return found


def route_shape(routers: list[torch.nn.Module]) -> tuple[int, int]:
    """(MoE layers L, experts per token k) of a model's routers (all MoE layers of one model share k)."""
    ks = {int(r.top_k) for r in routers}
    if len(ks) != 1:
        raise ValueError(f"MoE layers with different experts per token {sorted(ks)} are not supported")
    return len(routers), ks.pop()


def gate_weights(router: torch.nn.Module, logits: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
    """`router`'s gate weights `[T, k]` for the given `experts [T, k]` (int64), from its `logits [T, E]`."""
    return GATES[type(router).__name__](router, logits, experts)
