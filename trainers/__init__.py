"""Trainers: pure losses and advantages, algorithm variants, GRPO / PPO trainers.

Names resolve lazily, so ``import trainers`` stays cheap until one is used.
Add an export as one more ``name: module`` entry in ``_EXPORTS``.
"""

from importlib import import_module
from typing import Any

_EXPORTS: dict[str, str] = {
    "masked_sum": "trainers.losses",
    "masked_mean": "trainers.losses",
    "aggregate": "trainers.losses",
    "group_advantages": "trainers.losses",
    "gae": "trainers.losses",
    "kl_k3": "trainers.losses",
    "truncated_importance_weights": "trainers.losses",
    "entropy_from_logits": "trainers.losses",
    "token_logprobs": "trainers.losses",
    "clipped_policy_loss": "trainers.losses",
    "value_loss": "trainers.losses",
    "Algorithm": "trainers.algorithms",
    "get_algorithm": "trainers.algorithms",
    "nonconstant_group_mask": "trainers.algorithms",
    "RLConfig": "trainers.common",
    "GRPOConfig": "trainers.grpo",
    "GRPOTrainer": "trainers.grpo",
    "AgentGRPOConfig": "trainers.agent_grpo",
    "AgentGRPOTrainer": "trainers.agent_grpo",
    "PPOConfig": "trainers.ppo",
    "PPOTrainer": "trainers.ppo",
    "PolicyWithValue": "trainers.ppo",
    "score_completions": "trainers.rewards",
    "math_reward": "trainers.verifiers",
    "extract_final_answer": "trainers.verifiers",
    "MetricsLogger": "trainers.metrics",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'trainers' has no attribute {name!r}")
    return getattr(import_module(module), name)


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
