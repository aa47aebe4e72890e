"""PPO with a value head on a persistent `RolloutEngine`.

Per step, on every process: roll out this rank's prompts; score each completion; the reward sits
on its last token (minus an optional per-token `kl_coef` x (logp - ref logp) penalty); the
trainer recomputes logprobs and values before the update; GAE (`trainers.losses.gae`) gives
per-token advantages (whitened) and returns; `num_iterations` epochs of minibatch updates of the
clipped surrogate (`agg="token_mean"`) plus `vf_coef` x the clipped value loss; then
`engine.update_weights(policy)`.

    trainer = PPOTrainer(model, tokenizer, addition_reward, dataset, PPOConfig(max_steps=50))
    trainer.train()
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from trainers.base import RLTrainer
from trainers.common import RLConfig, completion_forward, scored_logprobs
from trainers.losses import (
    clipped_policy_loss,
    gae,
    kl_k3,
    masked_mean,
    masked_sum,
    value_loss,
)
from trainers.rollouts import batch_tensors


@dataclass
class PPOConfig(RLConfig):
    """`RLConfig` plus:

    Args:
        group_size: completions per prompt (1 by default: PPO needs no groups).
        vf_coef: weight of the value loss.
        value_clip: half-width of the value trust region around the rollout-time values (None = off).
        gamma, lam: GAE discount and lambda.
        kl_coef: per-token KL penalty to a frozen reference folded into the rewards (0 = none).
        whiten_advantages: normalise advantages to zero mean, unit variance over the rank's tokens.
    """

    output_dir: str = "outputs/ppo"
    group_size: int = 1
    vf_coef: float = 0.5
    value_clip: float | None = 0.2
    gamma: float = 1.0
    lam: float = 0.95
    kl_coef: float = 0.0
    whiten_advantages: bool = True
    algorithm: str = "ppo"

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.algorithm != "ppo":
            raise ValueError(f"PPOConfig.algorithm must be 'ppo', got {self.algorithm!r}")
        if self.vf_coef < 0 or self.kl_coef < 0:
            raise ValueError(f"vf_coef and kl_coef must be >= 0, got {self.vf_coef}, {self.kl_coef}")
        if not (0 <= self.gamma <= 1 and 0 <= self.lam <= 1):
            raise ValueError(f"gamma and lam must be in [0, 1], got {self.gamma}, {self.lam}")


class PolicyWithValue(nn.Module):
    """A causal LM and a linear value head on its last hidden state, trained as one module.

    Args:
        policy: a HF causal LM.
        value_head: default `nn.Linear(hidden_size, 1)`, small init, on the policy's device/dtype.
    Forward: the policy's kwargs -> `(logits [N, K, V], values [N, K] fp32)` over the same `K`
    positions as the logits (`logits_to_keep`).
    """

    def __init__(self, policy: nn.Module, value_head: nn.Module | None = None) -> None:
        super().__init__()
        self.policy = policy
        if value_head is None:
            hidden = policy.config.get_text_config().hidden_size
            ref = next(policy.parameters())
            value_head = nn.Linear(hidden, 1, device=ref.device, dtype=ref.dtype)
            nn.init.normal_(value_head.weight, std=0.01)
            nn.init.zeros_(value_head.bias)
        self.value_head = value_head

    def forward(self, input_ids: Tensor, logits_to_keep: int = 0, **kwargs) -> tuple[Tensor, Tensor]:
        out = self.policy(
            input_ids=input_ids, logits_to_keep=logits_to_keep, output_hidden_states=True, **kwargs
        )
        hidden = out.hidden_states[-1]  # [N, L, H]
        if logits_to_keep:
            hidden = hidden[:, -logits_to_keep:]  # [N, K, H]
        return out.logits, self.value_head(hidden).squeeze(-1).float()  # [N, K, V], [N, K]


class PPOTrainer(RLTrainer):
    """PPO with a value head, one rollout engine per process.

    Args: as `GRPOTrainer`; `model` is a HF causal LM (wrapped here in a `PolicyWithValue`) or a
    `PolicyWithValue`; `ref_model` is used when `kl_coef > 0`; `rollout=` an engine-like rollout
    (`trainers.engine_builder`). Attributes as `GRPOTrainer`, plus
    `value_model` (the unwrapped `PolicyWithValue`).
    """

    config: PPOConfig

    def __init__(
        self, model, tokenizer, reward_funcs, train_dataset, config: PPOConfig | None = None, **kwargs
    ) -> None:
        super().__init__(model, tokenizer, reward_funcs, train_dataset, config or PPOConfig(), **kwargs)
        self.value_model = self.accelerator.unwrap_model(self.model)
        self.clip_low = self.algorithm.clip_low if self.config.clip_low is None else self.config.clip_low
        self.clip_high = self.algorithm.clip_high if self.config.clip_high is None else self.config.clip_high

    def trainable_module(self, model: nn.Module) -> nn.Module:
        return model if isinstance(model, PolicyWithValue) else PolicyWithValue(model)

    def policy_module(self, unwrapped: nn.Module) -> nn.Module:
        return unwrapped.policy

    @property
    def uses_reference(self) -> bool:
        return self.config.kl_coef > 0

    def forward(self, model: nn.Module, micro: dict[str, Tensor]) -> tuple[Tensor, Tensor]:
        with self.routing.forcing(model, micro.get("routed_experts")):
            logits, values = completion_forward(self.passes.model(model), micro)  # [n, T+1, V], [n, T+1]
        # NOTE: the value at the position that predicts token t is V(s_t), the state before it.
        return logits, values[:, :-1]

    def collect(self) -> tuple[dict[str, Tensor], dict[str, float]]:
        """Rollouts -> rewards -> logprobs and values -> GAE advantages and returns."""
        cfg = self.config
        rows = self.prompts.rows(self.step_count)
        # 1. this rank's rollouts
        batch, metrics = self.generate(rows)
        start = time.perf_counter()
        data = batch_tensors(batch)
        scores, reward_metrics = self.score(rows, batch)  # [N]
        reward_metrics.update(self.reward_stats(scores))
        # NOTE: a row no reward function scored (all None) is left out of the loss, as in TRL.
        scorable = ~scores.isnan()  # [N]
        scores = scores.nan_to_num(0.0)
        mask = data["completion_mask"] & scorable[:, None]  # [N, T]
        data["loss_mask"] = mask
        # 2. the trainer's own logprobs and values before the update
        own = self.recompute_old(data, metrics)
        data["old_values"] = own["values"]  # [N, T]
        # 3. per-token rewards: the score on the last token, minus the KL penalty on every token
        token_rewards = torch.zeros_like(own["values"])  # [N, T]
        last = (mask.sum(dim=1) - 1).clamp_min(0)  # [N]
        token_rewards[torch.arange(len(last), device=last.device), last] = scores.to(token_rewards.dtype)
        if self.ref_model is not None:
            chunks = cfg.num_minibatches * cfg.gradient_accumulation_steps
            ref = self.reference(data, chunks, **self.truncation)  # [N, T]
            metrics["time_reference"] = self.reference.seconds
            token_rewards -= cfg.kl_coef * torch.where(mask, own["logprobs"] - ref, 0.0)
            metrics["kl"] = masked_mean(kl_k3(own["logprobs"], ref, mask), mask).item()
        # 4. GAE over the generated tokens
        advantages, data["returns"] = gae(token_rewards, own["values"], mask, cfg.gamma, cfg.lam)
        ranks = None if self.accelerator.num_processes == 1 else self.all_sum
        data["advantages"] = whiten(advantages, mask, all_sum=ranks) if cfg.whiten_advantages else advantages
        metrics.update(reward_metrics)
        metrics["returns_mean"] = masked_mean(data["returns"], mask).item()
        metrics["time_train"] = time.perf_counter() - start
        return data, metrics

    def all_sum(self, t: Tensor) -> Tensor:
        """`t` summed over the ranks (whitening statistics of the whole batch)."""
        return self.accelerator.reduce(t.to(self.accelerator.device), reduction="sum")

    def loss(self, micro: dict[str, Tensor]) -> tuple[Tensor, dict[str, Tensor]]:
        """Clipped surrogate (token mean) + vf_coef x clipped value loss on one micro-batch."""
        logits, values = self.forward(self.model, micro)  # [n, T+1, V], [n, T]
        logprobs, _ = scored_logprobs(logits, micro, **self.truncation)  # [n, T]
        mask = micro["loss_mask"]
        policy_loss, stats = clipped_policy_loss(
            logprobs,
            micro["old_logprobs"],
            micro["advantages"],
            mask,
            clip_low=self.clip_low,
            clip_high=self.clip_high,
            agg="token_mean",
            tis_weights=micro.get("tis_weights"),
        )
        v_loss, v_stats = value_loss(
            values, micro["old_values"], micro["returns"], mask, clip=self.config.value_clip, agg="token_mean"
        )
        metrics = {k: stats[k] for k in ("clip_fraction", "ratio_mean", "approx_kl")}
        metrics.update(v_stats, policy_loss=policy_loss.detach(), value_loss=v_loss.detach())
        return policy_loss + self.config.vf_coef * v_loss, metrics


def whiten(x: Tensor, mask: Tensor, eps: float = 1e-8, all_sum: Callable[[Tensor], Tensor] | None = None) -> Tensor:
    """`(x - mean) / std` over the masked entries of `x [N, T]`; 0 where the mask is 0. With `all_sum` (a
    sum over the ranks) the mean and variance are those of every rank's masked entries together."""
    if all_sum is None:
        mean = masked_mean(x, mask)
        var = masked_mean((x - mean).square(), mask)
    else:
        total = all_sum(torch.stack([masked_sum(x, mask), mask.bool().sum().to(x.dtype)]))  # [2]
        count = total[1].clamp_min(1)
        mean = total[0] / count
        var = all_sum(masked_sum((x - mean).square(), mask)) / count
    return torch.where(mask.bool(), (x - mean) * torch.rsqrt(var + eps), 0.0)
