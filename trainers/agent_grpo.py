"""GRPO on multi-turn episodes: the policy talks to an environment (tools, feedback) and learns from the
whole trajectory, with the environment's tokens masked out of the loss.

The only change from `GRPOTrainer` is where a step's rollouts come from: `rollout.agents.run_episodes`
plays `group_size` episodes per prompt row (each with its own `env_factory()` environment), so a row of
the batch holds every turn after the first prompt, token-exact, and `RolloutBatch.loss_mask` marks the
model's tokens. The trainers' tensors take the loss mask from `batch.trained_mask` (`trainers.rollouts`),
so the clipped surrogate, the KL, the entropy, the parity probe and every aggregation (GRPO's per-sequence
mean, DAPO's token mean, Dr. GRPO's constant normaliser) count model tokens only. The reward of an
episode is the sum of the environment's rewards (plus any reward functions, scored on the trajectory's
text); advantages are group-relative as in GRPO.

    trainer = AgentGRPOTrainer(model, tokenizer, CalculatorEnv, dataset, AgentGRPOConfig(max_turns=2),
                               episode_metrics=lambda batch: episode_stats(batch, tokenizer))
    trainer.train()          # metrics.jsonl: reward_mean, num_turns, response_length (model tokens), ...
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from rollout import RolloutBatch
from rollout.agents import Environment, run_episodes
from trainers.common import rollout_seed
from trainers.grpo import GRPOConfig, GRPOTrainer
from trainers.rollouts import speculation_counts, speculation_metrics


@dataclass
class AgentGRPOConfig(GRPOConfig):
    """`GRPOConfig` for episodes, plus:

    Args:
        max_turns: model turns per episode at most (`max_new_tokens` is the budget of one turn).
        max_episode_tokens: trajectory tokens after the first prompt at most (model and environment
            tokens; None = only `max_turns` x `max_new_tokens` bounds the model's share).
    Dr. GRPO's constant normaliser is the episode's model-token budget, `max_turns` x `max_new_tokens`.
    """

    output_dir: str = "outputs/agent_grpo"
    max_turns: int = 4
    max_episode_tokens: int | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if isinstance(self.max_turns, bool) or not isinstance(self.max_turns, int) or self.max_turns < 1:
            raise ValueError(f"max_turns must be a positive int, got {self.max_turns!r}")
        if self.max_episode_tokens is not None and self.max_episode_tokens < 1:
            raise ValueError(f"max_episode_tokens must be >= 1 or None, got {self.max_episode_tokens}")
        if self.overlong_buffer:
            raise ValueError("overlong_buffer (a per-completion length penalty) does not apply to episodes; "
                             "bound them with max_turns / max_episode_tokens")


class AgentGRPOTrainer(GRPOTrainer):
    """GRPO whose samples are multi-turn episodes (`rollout.agents`).

    Args:
        model, tokenizer: as `GRPOTrainer` (the tokenizer's chat template renders message observations).
        env_factory: a callable returning a fresh `rollout.agents.Environment` per episode; `reset(row)`
            gets a dataset row (a dict), its rewards make the episode's reward.
        train_dataset: a `datasets.Dataset` or list of dicts with a "prompt" column (what `reset` reads).
        config: an `AgentGRPOConfig`.
        reward_funcs: optional reward functions added to the environment's reward (TRL convention; they see
            the whole trajectory's text as the completion).
        episode_metrics: optional `fn(batch) -> dict[str, float]` logged each step (same keys every step and
            rank), e.g. a tool-use rate.
        ref_model, accelerator, optimizer: as `GRPOTrainer`.
    """

    config: AgentGRPOConfig

    def __init__(
        self,
        model,
        tokenizer,
        env_factory: Callable[[], Environment],
        train_dataset,
        config: AgentGRPOConfig | None = None,
        *,
        reward_funcs: Sequence[Callable] = (),
        episode_metrics: Callable[[RolloutBatch], dict[str, float]] | None = None,
        **kwargs,
    ) -> None:
        if tokenizer is None:
            raise ValueError("AgentGRPOTrainer needs a tokenizer (environment turns go through its chat template)")
        super().__init__(model, tokenizer, list(reward_funcs), train_dataset, config or AgentGRPOConfig(), **kwargs)
        self.env_factory = env_factory
        self.episode_metrics = episode_metrics

    @property
    def norm_len(self) -> int:
        return self.config.max_turns * self.config.max_new_tokens

    def rollout(self, rows: list[dict]) -> tuple[RolloutBatch, Tensor, dict[str, float]]:
        """Play `group_size` episodes per row: `(batch, rewards [N], metrics)`. No collective call."""
        cfg, acc = self.config, self.accelerator
        start = time.perf_counter()
        before, spec = self.engine.cache_stats(), speculation_counts(self.engine)
        batch = run_episodes(
            self.engine,
            self.env_factory,
            rows,
            group_size=cfg.group_size,
            max_turns=cfg.max_turns,
            temps=cfg.temperatures(rows),
            max_new_tokens=cfg.max_new_tokens,
            max_tokens=cfg.max_episode_tokens,
            seed=rollout_seed(cfg.seed, self.step_count, self.data_rank),
            top_k=cfg.top_k,
            top_p=cfg.top_p,
            return_routed_experts=cfg.routing_replay,  # NOTE: replayed over the whole trajectory (docs/moe.md)
        ).to(acc.device)
        if self.sleeps:  # NOTE: free the KV cache for the trainer's passes; woken before the sync
            self.engine.sleep()
        elapsed = time.perf_counter() - start
        after = self.engine.cache_stats()
        cached, computed = (after[k] - before[k] for k in ("cached_prompt_tokens", "computed_prompt_tokens"))
        model_tokens = batch.trained_mask.sum(1).float()  # [N]
        metrics = {
            "time_generate": elapsed,
            "rollout_tokens_per_s": model_tokens.sum().item() / max(elapsed, 1e-9),
            "response_length": model_tokens.mean().item(),  # NOTE: the model's tokens, not the environment's
            "trajectory_length": batch.completion_lengths.float().mean().item(),
            "num_turns": batch.num_turns.float().mean().item(),
            "env_reward_mean": batch.rewards.float().mean().item(),
            # NOTE: each turn resubmits the whole context; this share of it came from the prefix cache
            "prefix_cached_fraction": cached / max(1, cached + computed),
            "policy_version": float(batch.policy_version + self.version_base),
            **speculation_metrics(spec, speculation_counts(self.engine)),  # NOTE: an engine that speculates
        }
        rewards = batch.rewards.to(acc.device).float()  # [N]
        if self.reward_funcs:
            extra, reward_metrics = self.score(rows, batch)  # [N], NaN where no function applied
            rewards = rewards + torch.nan_to_num(extra, nan=0.0)
            metrics.update(reward_metrics)
        if self.episode_metrics is not None:
            metrics.update({k: float(v) for k, v in self.episode_metrics(batch).items()})
        return batch, rewards, metrics
