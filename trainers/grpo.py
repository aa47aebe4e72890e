"""GRPO (and its Dr. GRPO / DAPO variants) on a persistent `RolloutEngine`.

Per step, on every process: sample this rank's prompt shard; roll out `group_size` completions per
prompt on the rank's own engine (per-prompt temperatures); score them with the reward functions;
group-relative advantages from the algorithm registry (DAPO drops constant-reward groups and,
with `max_resample_rounds`, samples more prompts to refill the batch; optional overlong filter and
soft overlong penalty);
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

import torch
from torch import Tensor

from rollout import RolloutBatch
from trainers.algorithms import get_algorithm, nonconstant_group_mask
from trainers.base import RLTrainer
from trainers.common import RLConfig, scored_logprobs
from trainers.losses import aggregate, clipped_policy_loss, kl_k3, masked_mean
from trainers.rollouts import batch_tensors, merge_batches, take_rows


@dataclass
class GRPOConfig(RLConfig):
    """`RLConfig` (rollout, optimisation, logging fields) plus:

    Args:
        algorithm: "grpo", "dr_grpo" or "dapo" (`trainers.algorithms`): advantage scaling, loss
            aggregation, clip range and whether constant-reward groups are dropped.
        beta: weight of the k3 KL to a frozen reference model (0 = no reference is built).
        max_resample_rounds: with an algorithm that drops constant-reward groups (DAPO), up to
            this many extra rounds of `prompts_per_step` fresh prompts per step refill the batch
            with groups that carry signal (DAPO's dynamic sampling; 0 = drop only). Logged as
            `resample_rounds` and `kept_fraction`.
        overlong_filter: leave truncated completions (finish reason "length") out of the loss.
        overlong_buffer: DAPO's soft overlong punishment: a completion longer than
            `max_new_tokens - overlong_buffer` loses up to `overlong_penalty` reward, linearly in
            the tokens it uses of the buffer (0 = off).
        async_rollout: generate ahead of the learner on a producer thread (`trainers.async_rollout`),
            at most `max_staleness` policy versions behind it (0 = wait for every update: the
            synchronous update exactly); tokens sampled by an older version get truncated importance
            weights capped at `stale_tis_cap` (None = off); `mask_stale` drops tokens staler than
            `max_staleness`. `rollout_threads` / `learner_threads`: torch threads of each side (None = as is).
    """

    output_dir: str = "outputs/grpo"
    algorithm: str = "grpo"
    beta: float = 0.0
    max_resample_rounds: int = 0
    overlong_filter: bool = False
    overlong_buffer: int = 0
    overlong_penalty: float = 1.0
    async_rollout: bool = False
    max_staleness: int = 1
    stale_tis_cap: float | None = 2.0
    mask_stale: bool = True
    rollout_threads: int | None = None
    learner_threads: int | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if get_algorithm(self.algorithm).use_gae:
            raise ValueError(f"algorithm {self.algorithm!r} needs a value head: use PPOTrainer")
        if self.beta < 0:
            raise ValueError(f"beta must be >= 0, got {self.beta}")
        if self.max_resample_rounds < 0:
            raise ValueError(f"max_resample_rounds must be >= 0, got {self.max_resample_rounds}")
        if self.max_staleness < 0 or (self.stale_tis_cap is not None and self.stale_tis_cap <= 0):
            raise ValueError(f"max_staleness must be >= 0 and stale_tis_cap > 0, got {self.max_staleness}, "
                             f"{self.stale_tis_cap}")
        if self.async_rollout and self.max_resample_rounds:
            raise ValueError("async_rollout does not support max_resample_rounds (DAPO refills) yet")
        if not 0 <= self.overlong_buffer < self.max_new_tokens:
            raise ValueError(
                f"overlong_buffer must be in [0, max_new_tokens={self.max_new_tokens}), got {self.overlong_buffer}"
            )


def overlong_penalty(lengths: Tensor, max_new_tokens: int, buffer: int, factor: float) -> Tensor:
    """DAPO's soft overlong punishment `[N]`: 0 up to `max_new_tokens - buffer` tokens, then
    falling linearly to `-factor` at `max_new_tokens`."""
    if buffer == 0:
        return torch.zeros(lengths.shape, dtype=torch.float32, device=lengths.device)
    over = (lengths.float() - (max_new_tokens - buffer)).clamp_min(0.0)  # [N]
    return -factor * over / buffer


class GRPOTrainer(RLTrainer):
    """Group-relative policy optimisation with one rollout engine per process.

    Args:
        model: a HF causal LM (trained in place; the engine shares its tensors).
        tokenizer: encodes prompts (chat template for conversational rows) and decodes completions.
        reward_funcs: one callable or a list, called as TRL calls them (`trainers.rewards`):
            `fn(prompts=, completions=, completion_ids=, finish_reasons=, **columns)` -> a list of
            floats or None; combined with `config.reward_weights`.
        train_dataset: a `datasets.Dataset` or list of dicts with a "prompt" column (a string or a
            list of chat messages); the other columns reach the reward functions, aligned with the
            completions.
        config: a `GRPOConfig`.
        ref_model: the frozen KL reference when `beta > 0` (default: a copy of the initial model).
        accelerator: an `accelerate.Accelerator` (default: a new one, `cpu=True` without CUDA).
        optimizer: default AdamW over the model's trainable parameters.
        rollout: generate on this engine-like rollout (a `RolloutEngine`, `RolloutPool` or `RolloutFleet` on the
            same initial weights; `trainers.engine_builder`) instead of an engine built here.
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

    @property
    def norm_len(self) -> int:
        """Dr. GRPO's constant length normaliser: the generation budget of one sample."""
        return self.config.max_new_tokens

    def rollout(self, rows: list[dict]) -> tuple[RolloutBatch, Tensor, dict[str, float]]:
        """Generate and score one set of prompt rows: `(batch, rewards [N] incl. the overlong
        penalty, metrics)`. No collective call."""
        cfg = self.config
        batch, metrics = self.generate(rows)
        rewards, reward_metrics = self.score(rows, batch)  # [N]
        if cfg.overlong_buffer:
            penalty = overlong_penalty(
                batch.completion_lengths, cfg.max_new_tokens, cfg.overlong_buffer, cfg.overlong_penalty
            )
            rewards = rewards + penalty.to(rewards.device)
            reward_metrics["overlong_penalty"] = penalty.mean().item()
        return batch, rewards, {**metrics, **reward_metrics}

    def refill(
        self, rows: list[dict], batch: RolloutBatch, rewards: Tensor, metrics: dict[str, float]
    ) -> tuple[RolloutBatch, Tensor]:
        """DAPO's dynamic sampling: while some rank holds fewer than `prompts_per_step` groups with
        signal, roll out more prompts (at most `max_resample_rounds` rounds); then the batch is
        the groups with signal first, topped up with dropped ones (masked out of the loss) so every
        rank keeps `prompts_per_step` groups and the same number of backward passes."""
        cfg, g = self.config, self.config.group_size
        batches, scores, rounds = [batch], [rewards], 0
        for round_ in range(1, cfg.max_resample_rounds + 1):
            kept = int(nonconstant_group_mask(torch.cat(scores), g).sum()) // g
            # NOTE: every rank takes part in the decision, so the collective calls stay matched.
            if self.global_max(float(kept < cfg.prompts_per_step)) == 0.0:
                break
            rounds = round_
            if kept < cfg.prompts_per_step:
                more, more_rewards, more_metrics = self.rollout(self.prompts.extra_rows(self.step_count, round_))
                batches.append(more)
                scores.append(more_rewards)
                metrics["time_generate"] += more_metrics["time_generate"]
        merged, rewards = merge_batches(batches, self.engine.pad_token_id), torch.cat(scores)
        groups = nonconstant_group_mask(rewards, g).view(-1, g)[:, 0]  # [G]
        order = torch.cat([groups.nonzero().flatten(), (~groups).nonzero().flatten()])[: cfg.prompts_per_step]
        index = (order[:, None] * g + torch.arange(g, device=order.device)).flatten().to(rewards.device)  # [N]
        metrics["resample_rounds"] = float(rounds)
        return take_rows(merged, index), rewards[index]

    def global_max(self, value: float) -> float:
        if self.accelerator.num_processes == 1:
            return value
        t = torch.tensor([value], dtype=torch.float64, device=self.accelerator.device)
        return float(self.accelerator.reduce(t, reduction="max").item())

    def collect(self) -> tuple[dict[str, Tensor], dict[str, float]]:
        """Rollouts -> rewards -> advantages -> the trainer's logprobs, as loss-ready tensors."""
        cfg = self.config
        rows = self.prompts.rows(self.step_count)
        # 1. this rank's rollouts (N = prompts_per_step x group_size rows, each group adjacent), scored
        batch, rewards, metrics = self.rollout(rows)
        metrics.update(self.reward_stats(rewards))
        if self.algorithm.drop_constant_groups and cfg.max_resample_rounds:
            batch, rewards = self.refill(rows, batch, rewards, metrics)
        start = time.perf_counter()
        data = batch_tensors(batch)
        mask = data["completion_mask"]  # [N, T]
        # 2. group-relative advantages (whole groups: a group never crosses ranks)
        data["advantages"] = self.algorithm.advantages(rewards, cfg.group_size)  # [N]
        keep = self.algorithm.keep_mask(rewards, cfg.group_size)  # [N]
        keep &= ~rewards.isnan()  # NOTE: unscorable rows (every reward function said None)
        if cfg.overlong_filter:
            truncated = torch.tensor([r == "length" for r in batch.finish_reasons], device=keep.device)
            metrics["truncated_fraction"] = truncated.float().mean().item()
            keep &= ~truncated
        # NOTE: dropped rows stay in the batch with an empty loss mask, so every rank runs the
        # same number of backward passes (DDP would hang otherwise).
        data["loss_mask"] = mask & keep[:, None]  # [N, T]
        # 3. the trainer's own logprobs before the update: ratio denominator and parity probe
        own = self.recompute_old(data, metrics)
        # 4. the frozen reference, for the KL term
        if self.ref_model is not None:
            chunks = cfg.num_minibatches * cfg.gradient_accumulation_steps
            data["ref_logprobs"] = self.reference(data, chunks, **self.truncation)  # [N, T]
            metrics["time_reference"] = self.reference.seconds
            metrics["kl"] = masked_mean(kl_k3(own["logprobs"], data["ref_logprobs"], mask), mask).item()
        metrics["kept_fraction"] = keep.float().mean().item()
        metrics["time_train"] = time.perf_counter() - start
        return data, metrics

    def loss(self, micro: dict[str, Tensor]) -> tuple[Tensor, dict[str, Tensor]]:
        """Clipped surrogate (+ beta x k3 KL) on one micro-batch, with the algorithm's aggregation
        (Dr. GRPO's sum divides by the constant `max_new_tokens`)."""
        logits, _ = self.forward(self.model, micro)
        logprobs, _ = scored_logprobs(logits, micro, **self.truncation)  # [n, T]
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
            norm_len=self.norm_len,
        )
        metrics = {k: stats[k] for k in ("clip_fraction", "ratio_mean", "approx_kl")}
        if "ref_logprobs" in micro:
            kl = aggregate(
                kl_k3(logprobs, micro["ref_logprobs"], mask), mask, self.algorithm.agg, self.norm_len
            )
            loss = loss + self.config.beta * kl
            metrics["kl_loss"] = kl.detach()
        return loss, metrics
