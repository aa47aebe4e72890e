"""Routing replay (R3, "rollout routing replay", arXiv 2510.11370) for MoE policies: `RLConfig(routing_replay=True)`.

The engine records the experts each MoE layer chose for every token it ran (`batch.routed_experts`
`[N, P + T, L, k]`, `rollout.model.routes`). In the trainer's teacher-forced passes (the old-logprob
recomputation and the loss's pass with gradients) a forward hook on each router module (`rollout.model.routers`)
replaces the experts the training router would pick with the recorded ones, for that forward only: the gate
weights are the training router's own formula over the recorded experts (softmax of its logits, renormalised as
the class does: `rollout.model.routers.GATES`), so the router still gets its gradient. Positions with no
recorded route (padding, the last sampled token, -1) keep the router's own choice.

`routing_mismatch_fraction`: in the recomputation before the update (the rollout's weights), the share of
(token, layer) pairs with a recorded route whose training-time top-k (as a set) differs from the rollout's,
measured before the replay replaces it. The frozen reference's pass is not replayed (its own routing).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator

import torch
from torch import Tensor

from rollout.model.routers import gate_weights, moe_routers


class RoutingReplay:
    """Forces recorded experts in a policy's forward (`forcing`) and measures how often they differ (`measure`).

    Args:
        enabled: off, both context managers do nothing (a dense policy, or `routing_replay=False`).
    """

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.counting = False
        self.mismatched = 0  # (token, layer) pairs whose own top-k differs from the recorded one
        self.pairs = 0  # (token, layer) pairs with a recorded route
        self.forced = 0  # router calls whose experts were replaced (tests read it)

    @contextlib.contextmanager
    def forcing(self, model: torch.nn.Module, routes: Tensor | None) -> Iterator[None]:
        """For one forward of `model` on `input_ids [n, S]`: every router takes `routes [n, S, L, k]`."""
        if not self.enabled or routes is None:
            yield
            return
        routers = moe_routers(model)
        if len(routers) != routes.shape[2]:
            raise ValueError(f"routing replay: the batch has routes of {routes.shape[2]} MoE layers, the policy "
                             f"{len(routers)} routers")
        handles = [r.register_forward_hook(functools.partial(self._force, routes[:, :, layer]))
                   for layer, r in enumerate(routers)]
        try:
            yield
        finally:
            for h in handles:
                h.remove()

    def _force(self, routes: Tensor, module: torch.nn.Module, args, output):
        logits, _, own = output  # [n*S, E], [n*S, k], [n*S, k]
        recorded = routes.reshape(-1, routes.shape[-1]).to(own.device, torch.long)  # [n*S, k]
        if recorded.shape != own.shape:
            raise ValueError(f"routing replay: {recorded.shape[0]} recorded rows of {recorded.shape[1]} experts "
                             f"for a router call of {tuple(own.shape)}")
        valid = (recorded >= 0).all(dim=-1)  # [n*S]
        if self.counting:
            differ = (own.sort(dim=-1).values != recorded.sort(dim=-1).values).any(dim=-1) & valid
            self.mismatched += int(differ.sum())
            self.pairs += int(valid.sum())
        experts = torch.where(valid[:, None], recorded, own)  # [n*S, k]
        self.forced += 1
        return logits, gate_weights(module, logits, experts), experts

    @contextlib.contextmanager
    def measure(self, metrics: dict[str, float]) -> Iterator[None]:
        """Counts the replayed passes inside; adds `routing_mismatch_fraction` to `metrics` after them."""
        if not self.enabled:
            yield
            return
        self.counting, self.mismatched, self.pairs = True, 0, 0
        try:
            yield
        finally:
            self.counting = False
        metrics["routing_mismatch_fraction"] = self.mismatched / max(self.pairs, 1)

