"""`Rollout`: the one protocol of everything that makes rollouts: `RolloutEngine` (in process), `RolloutPool`
(`rollout serve` processes), `RolloutFleet` (Ray actors) and `RolloutClient` (one server). Trainers take any
`Rollout` and hand it token ids (or their tokenizer's strings when it has one).

    from rollout import Rollout, SamplingParams
    assert isinstance(engine, Rollout)
    batch = rollout.generate(prompt_ids, sampling=SamplingParams(temperature=1.0, max_tokens=64), group_size=8)
    scores = rollout.score(batch)
    version = rollout.update_weights(model)      # a module, a state dict, (name, tensor) pairs or a directory

The parameter names are the same on all four (a test reads their signatures); a backend refuses what it cannot do
with a ValueError naming the argument, never by ignoring it. Pure Python: no torch.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

from rollout.in_flight import UPDATE_DEFAULT, InFlight
from rollout.sampling_params import SamplingParams

# NOTE: the parameters every `Rollout` method takes, by name and in this order (the test of the four classes)
GENERATE_PARAMETERS = ("prompts", "temps", "group_size", "max_new_tokens", "top_k", "top_p", "seed", "sampling",
                       "return_routed_experts")
SCORE_PARAMETERS = ("prompt_ids", "completion_ids", "top_logprobs", "prompt_logprobs", "temps", "progress",
                    "sampling", "return_routed_experts")
UPDATE_PARAMETERS = ("source", "in_flight", "recompute_kv", "version")


@runtime_checkable
class Rollout(Protocol):
    """What a trainer needs of a rollout backend."""

    policy_version: int

    def generate(self, prompts: Sequence[str] | Sequence[Sequence[int]], temps: float | Sequence[float] | None = None,
                 group_size: int = 1, max_new_tokens: int | None = None, top_k: int | None = None,
                 top_p: float | None = None, seed: int | None = None, *,
                 sampling: SamplingParams | Sequence[SamplingParams] | None = None,
                 return_routed_experts: bool = False) -> Any:
        """`group_size` samples per prompt: a `RolloutBatch`, rows grouped by prompt."""

    def score(self, prompt_ids: Any, completion_ids: Any = None, top_logprobs: int = 0, prompt_logprobs: bool = False,
              temps: float | Sequence[float] | None = None, progress: bool = False, *,
              sampling: SamplingParams | Sequence[SamplingParams] | None = None,
              return_routed_experts: bool = False) -> Any:
        """Teacher-forced logprobs of the completions: a `ScoreBatch`."""

    def update_weights(self, source: Any, in_flight: InFlight = UPDATE_DEFAULT, recompute_kv: bool = False, *,
                       version: int | None = None) -> int:
        """New policy weights; returns the new `policy_version`."""

    def close(self) -> None:
        """Release what it holds (threads, processes, actors, the KV cache)."""
