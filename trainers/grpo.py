"""GRPO (and its Dr. GRPO / DAPO variants) on a persistent `RolloutEngine`.

Per step, on every process: sample this rank's prompt shard; roll out `group_size` completions per
prompt on the rank's own engine (per-prompt temperatures); score them with the reward functions;
group-relative advantages from the algorithm registry (DAPO drops constant-reward groups);
recompute the rollout logprobs with the trainer's model (the ratio's denominator and the parity
probe); `num_iterations` epochs of clipped-surrogate minibatch updates (plus `beta` x k3 KL to a
frozen reference), gradients all-reduced by DDP; then `engine.update_weights(policy)`.

    trainer = GRPOTrainer(model, tokenizer, addition_reward, dataset, GRPOConfig(max_steps=50))
    history = trainer.train()          # list of per-step metric dicts; also metrics.jsonl

Launch on several processes with `accelerate launch --multi_gpu --num_processes 2 script.py`
(on CPU, build `Accelerator(cpu=True)` and pass it in).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from torch import Tensor

from trainers.algorithms import get_algorithm
from trainers.base import RLTrainer
from trainers.common import RLConfig, batch_tensors, reference_logprobs, scored_logprobs
from trainers.losses import aggregate, clipped_policy_loss, kl_k3, masked_mean


@dataclass
class GRPOConfig(RLConfig):
    """`RLConfig` (rollout, optimisation, logging fields) plus:

    Args:
        algorithm: "grpo", "dr_grpo" or "dapo" (`trainers.algorithms`): advantage scaling, loss
            aggregation, clip range and whether constant-reward groups are dropped.
        beta: weight of the k3 KL to a frozen reference model (0 = no reference is built).
    """

    output_dir: str = "outputs/grpo"
    algorithm: str = "grpo"
    beta: float = 0.0

    def __post_init__(self) -> None:
        super().__post_init__()
        if get_algorithm(self.algorithm).use_gae:
            raise ValueError(f"algorithm {self.algorithm!r} needs a value head: use PPOTrainer")
        if self.beta < 0:
            raise ValueError(f"beta must be >= 0, got {self.beta}")


class GRPOTrainer(RLTrainer):
    """Group-relative policy optimisation with one rollout engine per process.

    Args:
        model: a HF causal LM (trained in place; the engine shares its tensors).
        tokenizer: encodes prompts and decodes completions for the reward functions.
        reward_funcs: one callable or a list, each `(prompts, completions, **columns) -> list[float]`,
            combined with `config.reward_weights`.
        train_dataset: a `datasets.Dataset` or list of dicts with a "prompt" column; the other
            columns reach the reward functions, aligned with the completions.
        config: a `GRPOConfig`.
        ref_model: the frozen KL reference when `beta > 0` (default: a copy of the initial model).
        accelerator: an `accelerate.Accelerator` (default: a new one, `cpu=True` without CUDA).
        optimizer: default AdamW over the model's trainable parameters.
    Attributes:
        engine (`RolloutEngine`), model (prepared), policy (unwrapped), accelerator, step_count.
    """

    config: GRPOConfig

    def __init__(
        self, model, tokenizer, reward_funcs, train_dataset, config: GRPOConfig | None = None, **kwargs
    ) -> None:
        super().__init__(model, tokenizer, reward_funcs, train_dataset, config or GRPOConfig(), **kwargs)
        self.clip_low = self.algorithm.clip_low if self.config.clip_low is None else self.config.clip_low
        self.clip_high = self.algorithm.clip_high if self.config.clip_high is None else self.config.clip_high

    @property
    def uses_reference(self) -> bool:
        return self.config.beta > 0

    def collect(self) -> tuple[dict[str, Tensor], dict[str, float]]:
        """Rollouts -> rewards -> advantages -> the trainer's logprobs, as loss-ready tensors."""
        cfg = self.config
        rows = self.prompts.rows(self.step_count)
        # 1. this rank's rollouts: N = prompts_per_step x group_size rows, each group adjacent
        batch, metrics = self.generate(rows)
        start = time.perf_counter()
        data = batch_tensors(batch)
        mask = data["completion_mask"]  # [N, T]
        # 2. rewards and group-relative advantages (whole groups: a group never crosses ranks)
        rewards, reward_metrics = self.score(rows, batch)  # [N]
        data["advantages"] = self.algorithm.advantages(rewards, cfg.group_size)  # [N]
        keep = self.algorithm.keep_mask(rewards, cfg.group_size)  # [N]
        # NOTE: dropped groups stay in the batch with an empty loss mask, so every rank runs the
        # same number of backward passes (DDP would hang otherwise).
        data["loss_mask"] = mask & keep[:, None]  # [N, T]
        # 3. the trainer's own logprobs before the update: ratio denominator and parity probe
        own = self.recompute_old(data, metrics)
        # 4. the frozen reference, for the KL term
        if self.ref_model is not None:
            chunks = cfg.num_minibatches * cfg.gradient_accumulation_steps
            data["ref_logprobs"] = reference_logprobs(self.ref_model, data, chunks)  # [N, T]
            metrics["kl"] = masked_mean(kl_k3(own["logprobs"], data["ref_logprobs"], mask), mask).item()
        metrics.update(reward_metrics)
        metrics["kept_fraction"] = keep.float().mean().item()
        metrics["time_train"] = time.perf_counter() - start
        return data, metrics

    def loss(self, micro: dict[str, Tensor]) -> tuple[Tensor, dict[str, Tensor]]:
        """Clipped surrogate (+ beta x k3 KL) on one micro-batch, with the algorithm's aggregation."""
        logits, _ = self.forward(self.model, micro)
        logprobs, _ = scored_logprobs(logits, micro)  # [n, T]
        mask = micro["loss_mask"]  # [n, T]
        loss, stats = clipped_policy_loss(
            logprobs,
            micro["old_logprobs"],
            micro["advantages"],
            mask,
            clip_low=self.clip_low,
            clip_high=self.clip_high,
            agg=self.algorithm.agg,
            tis_weights=micro.get("tis_weights"),
        )
        metrics = {k: stats[k] for k in ("clip_fraction", "ratio_mean", "approx_kl")}
        if "ref_logprobs" in micro:
            kl = aggregate(kl_k3(logprobs, micro["ref_logprobs"], mask), mask, self.algorithm.agg)
            loss = loss + self.config.beta * kl
            metrics["kl_loss"] = kl.detach()
        return loss, metrics
