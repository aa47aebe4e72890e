"""`RLTrainer`: the plumbing GRPO and PPO share (accelerate setup, one rollout engine per process,
rollouts, the minibatch update loop, weight sync, metrics, checkpoints).

What varies with the config is a part the trainer holds, chosen in `trainers.parts` (`adapter`, `layout`,
`passes`, `routing`, `engine`, `ref_model` / `reference`, `feed`); the trainer calls its parts and
inherits from nothing but `object`.

A subclass supplies three things: `collect()` (rollout -> rewards -> advantages -> old logprobs,
top to bottom), `loss(micro)` (a pure loss from `trainers.losses` on one micro-batch) and, for PPO,
the trainable module. One RL step is `collect`, `optimize`, `sync_weights`, `log`.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import time
from collections import defaultdict
from collections.abc import Sequence
from types import SimpleNamespace

import torch
from accelerate import Accelerator
from torch import Tensor

from rollout import RolloutBatch, SamplingParams
from rollout.contract import Rollout
from trainers.algorithms import get_algorithm
from trainers.checkpoints import STATE_FILE, checkpoints
from trainers.common import (
    AGG_DENOMINATORS,
    PromptSource,
    RLConfig,
    completion_forward,
    disable_dropout,
    logprob_mismatch,
    lr_factor,
    minibatch_plan,
    rollout_seed,
    scored_logprobs,
)
from trainers.engine_builder import build_rollout, check_given, colocated_engine_config  # noqa: F401 (re-exported)
from trainers.losses import masked_mean, truncated_importance_weights
from trainers.metrics import MetricsLogger
from trainers.parts import (
    choose_adapter,
    choose_feed,
    choose_layout,
    choose_passes,
    choose_reference,
    reference_model,
)
from trainers.rewards import RewardFn, score_completions
from trainers.rollouts import completion_id_lists, encode_prompt, speculation_counts, speculation_metrics
from trainers.routing_replay import RoutingReplay


class RLTrainer:
    """Shared base of `GRPOTrainer` and `PPOTrainer` (see their docstrings for the arguments)."""

    config: RLConfig

    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer,
        reward_funcs: RewardFn | Sequence[RewardFn],
        train_dataset,
        config: RLConfig,
        *,
        ref_model: torch.nn.Module | None = None,
        accelerator: Accelerator | None = None,
        optimizer: torch.optim.Optimizer | None = None,
        rollout: Rollout | None = None,
    ) -> None:
        check_given(rollout)
        self.given_rollout = rollout  # NOTE: None: the trainer builds its own engine (trainers.engine_builder)
        self.config, self.tokenizer = config, tokenizer
        self.accelerator = acc = accelerator or Accelerator(cpu=not torch.cuda.is_available())
        self.algorithm = get_algorithm(config.algorithm)
        self.reward_funcs = list(reward_funcs) if isinstance(reward_funcs, Sequence) else [reward_funcs]
        self.adapter = choose_adapter(config)
        module = self.trainable_module(self.adapter.wrap(model))  # NOTE: lora_rank: a PeftModel (trainers.lora)
        if config.disable_dropout:
            disable_dropout(module)
        optimizer = optimizer or torch.optim.AdamW(
            [p for p in module.parameters() if p.requires_grad],
            lr=config.learning_rate,
            betas=tuple(config.adam_betas),
            weight_decay=config.weight_decay,
        )
        # NOTE: a plain scheduler, not prepared: accelerate would step it once per process.
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            optimizer,
            functools.partial(
                lr_factor,
                schedule=config.lr_schedule,
                warmup_steps=config.warmup_steps,
                total_steps=config.max_steps,
            ),
        )
        self.layout = choose_layout(self, self.policy_module(module))
        # NOTE: DDP-wrapped, FSDP2-sharded, or as it is (TP)
        self.model, self.optimizer = self.layout.prepare(module, optimizer, self.policy_module(module))
        acc.register_for_checkpointing(self.scheduler)
        self.policy = self.policy_module(acc.unwrap_model(self.model))  # the HF causal LM, unwrapped
        self.passes = choose_passes(config, acc, self.model)
        self.routing = RoutingReplay(config.routing_replay)
        self.feed = choose_feed(config)
        self.engine = build_rollout(self)
        self.adapter.check_engine(self.engine)
        self.sleeps = config.sleep_engine
        if self.sleeps is None:  # NOTE: colocated on one GPU: the update needs the cache's memory
            self.sleeps = self.engine.device.type == "cuda" and self.engine.device == acc.device
        if self.feed.overlaps:  # NOTE: the engine generates while the learner trains
            self.sleeps = False
        self.ref_model = reference_model(self, ref_model)
        self.reference = choose_reference(self)
        self.prompts = PromptSource(train_dataset, config.prompts_per_step, self.data_rank, self.data_world,
                                    config.seed, config.shuffle)
        self.metrics_logger = MetricsLogger(
            acc,
            config.output_dir,
            config.max_steps,
            config.log_stdout,
            config.progress,
            desc=config.algorithm,
        )
        self.step_count = 0  # RL steps done
        self.version_base = 0  # step count minus engine version (non-zero after a resume)

    # ----------------------------------------------------------------------------- hooks
    def trainable_module(self, model: torch.nn.Module) -> torch.nn.Module:
        """The module the optimizer trains (PPO wraps the policy with a value head)."""
        return model

    def policy_module(self, unwrapped: torch.nn.Module) -> torch.nn.Module:
        """The causal LM inside the (unwrapped) trainable module: the one the engine runs."""
        return unwrapped

    @property
    def uses_reference(self) -> bool:
        return False

    def collect(self) -> tuple[dict[str, Tensor], dict[str, float]]:
        raise NotImplementedError

    def loss(self, micro: dict[str, Tensor]) -> tuple[Tensor, dict[str, Tensor]]:
        raise NotImplementedError

    def forward(self, model: torch.nn.Module, micro: dict[str, Tensor]) -> tuple[Tensor, Tensor | None]:
        """Teacher-forced `(logits [n, T+1, V], values [n, T] or None)` of a micro-batch."""
        with self.routing.forcing(model, micro.get("routed_experts")):  # NOTE: routing replay, when on
            return completion_forward(self.passes.model(model), micro).logits, None

    @property
    def truncation(self) -> dict[str, float | int | None]:
        """The engine's sampling filters, applied again wherever the trainer scores tokens."""
        return {"top_k": self.config.top_k, "top_p": self.config.top_p}

    # ---------------------------------------------------------------------- the layout's
    @property
    def data_rank(self) -> int:
        """The data-parallel replica this process feeds (a TP group's ranks share one)."""
        return self.layout.data_rank

    @property
    def data_world(self) -> int:
        """How many data-parallel replicas the processes make."""
        return self.layout.data_world

    @property
    def fsdp(self):
        """The FSDP settings the policy is sharded with (`trainers.sharding`), None unsharded."""
        return self.layout.fsdp

    @property
    def sync_stats(self):
        """The last sharded sync's buckets, tensors and peak bucket bytes (`trainers.sharding.SyncStats`)."""
        return self.layout.sync_stats

    @property
    def param_fraction(self) -> float:
        """The share of the policy's parameters this rank holds (1.0 unsharded)."""
        return self.layout.param_fraction

    def unsharded_policy(self) -> torch.nn.Module:
        """The policy with full tensors: the trainer's own, or under FSDP the engine's copy."""
        return self.layout.unsharded_policy(self.policy)

    def weight_source(self):
        """What `engine.update_weights` copies from: the policy itself, or under FSDP its full tensors."""
        return self.layout.weight_source(self.policy, given=self.given_rollout is not None)

    def gather_policy(self) -> torch.nn.Module:
        """The policy with its current weights as full tensors, for evaluation or `save_pretrained` between steps
        (collective under FSDP or TP: every rank calls it)."""
        return self.layout.gather_policy(self.policy)

    @property
    def rollouts(self):
        """The `AsyncRollouts` producer of an `async_rollout` run while it runs (else None)."""
        return self.feed.producer

    # --------------------------------------------------------------------------- the loop
    def train(self) -> list[dict[str, float]]:
        """Run steps until `config.max_steps`; returns every step's metrics."""
        history = []
        self.feed.before_train(self)
        try:
            self.metrics_logger.start(self.step_count)
            while self.step_count < self.config.max_steps:
                history.append(self.step())
                if self.config.save_steps and self.step_count % self.config.save_steps == 0:
                    self.save_checkpoint()
            self.metrics_logger.close()
        finally:
            self.feed.stop()  # NOTE: async: the producer ends with the run
        return history

    def step(self) -> dict[str, float]:
        """One RL step: collect rollouts, update the policy, sync the engine, log. With `async_rollout` the first
        step starts the producer (`trainers.async_rollout`)."""
        self.feed.before_step(self)
        self.model.train()
        data, metrics = self.collect()
        start = time.perf_counter()
        metrics.update(self.optimize(data))
        metrics["time_train"] += time.perf_counter() - start
        metrics["lr"] = self.scheduler.get_last_lr()[0]
        self.scheduler.step()
        start = time.perf_counter()
        if self.sleeps:
            self.engine.wake()
        metrics["sync_seconds"] = self.sync_weights()
        metrics.update(self.adapter.sync_metrics(self.policy))
        metrics["time_sync"] = time.perf_counter() - start  # NOTE: the wake and the sync
        self.step_count += 1
        metrics = {"step": self.step_count, **self.layout.reduce_metrics(metrics)}
        metrics["trainer_param_fraction"] = self.param_fraction  # NOTE: the logging rank's own, not a mean
        self.metrics_logger.log(metrics)
        return metrics

    def generate(self, rows: list[dict]) -> tuple[RolloutBatch, dict[str, float]]:
        """This rank's rollouts for its prompt shard: `group_size` seeded samples per prompt (from the async
        producer when one runs)."""
        return self.feed.generate(self, rows)

    def sample_rollouts(
        self, rows: list[dict], step: int, sleep: bool = False
    ) -> tuple[RolloutBatch, dict[str, float]]:
        """`rows`' rollouts seeded for RL step `step`, timed; `sleep`: then free the KV cache for the trainer's
        passes."""
        cfg, acc, start, spec = self.config, self.accelerator, time.perf_counter(), speculation_counts(self.engine)
        batch = self.engine.generate(
            [encode_prompt(self.tokenizer, row["prompt"], cfg.chat_template) for row in rows],
            temps=cfg.temperatures(rows),
            group_size=cfg.group_size,
            max_new_tokens=cfg.max_new_tokens,
            top_k=cfg.top_k,
            top_p=cfg.top_p,
            seed=rollout_seed(cfg.seed, step, self.data_rank),  # NOTE: a TP group's ranks share one
            # NOTE: engines, pools (a Ray fleet refuses it)
            **({"return_routed_experts": True} if cfg.routing_replay else {}),
            **({"sampling": SamplingParams(return_sampling_mask=True)} if cfg.score_on_sampling_mask else {}),
        ).to(acc.device)
        if sleep:  # NOTE: woken before the sync; counted in time_generate as before
            self.engine.sleep()
        elapsed = time.perf_counter() - start
        return batch, {
            "time_generate": elapsed,
            "rollout_tokens_per_s": batch.completion_mask.sum().item() / max(elapsed, 1e-9),
            "response_length": batch.completion_lengths.float().mean().item(),
            **speculation_metrics(spec, speculation_counts(self.engine)),  # NOTE: an engine that speculates
        }

    def score(self, rows: list[dict], batch: RolloutBatch) -> tuple[Tensor, dict[str, float]]:
        """Rewards `[N]` of this rank's completions (NaN where no function applied), with each
        function's mean; no collective call (ranks may score different numbers of batches)."""
        if batch.completions_text is None and self.tokenizer is not None:  # NOTE: a rollout without a tokenizer
            batch.completions_text = self.tokenizer.batch_decode(completion_id_lists(batch), skip_special_tokens=True)
        if batch.completions_text is None:
            raise ValueError("reward functions need decoded completions: pass a tokenizer")
        rewards, metrics = score_completions(
            self.reward_funcs,
            rows,
            batch.completions_text,
            self.config.group_size,
            self.config.reward_weights,
            completion_ids=completion_id_lists(batch),
            finish_reasons=batch.finish_reasons,
            trainer_state=self.trainer_state(),
        )
        return rewards.to(self.accelerator.device), metrics

    def trainer_state(self):
        """What reward functions get as `trainer_state` (TRL's fields that apply here)."""
        return SimpleNamespace(global_step=self.step_count, max_steps=self.config.max_steps)

    def reward_stats(self, rewards: Tensor) -> dict[str, float]:
        """Global `reward_mean` / `reward_std` over every rank's scored rows (one gather)."""
        everyone = self.layout.gather_replicas(rewards.to(self.accelerator.device)).float()  # [N x data-parallel ranks]
        everyone = everyone[~everyone.isnan()]
        # NOTE: every rank gets the same global values, so the cross-rank mean leaves them as they are.
        return {
            "reward_mean": everyone.mean().item() if everyone.numel() else float("nan"),
            "reward_std": everyone.std().item() if everyone.numel() > 1 else 0.0,
            "unscorable_fraction": 1.0 - everyone.numel() / max(1, rewards.numel() * self.data_world),
        }

    @torch.no_grad()
    def recompute(self, data: dict[str, Tensor]) -> dict[str, Tensor]:
        """The trainer's own view of the rollouts before the update, micro-batch by micro-batch:
        `logprobs [N, T]` (the ratio's denominator and the parity probe), `entropy [N, T]` and,
        with a value head, `values [N, T]`."""
        model = self.accelerator.unwrap_model(self.model)  # NOTE: no DDP hooks for no-grad passes
        chunks = self.config.num_minibatches * self.config.gradient_accumulation_steps
        parts: dict[str, list[Tensor]] = defaultdict(list)
        for idx in torch.arange(data["completion_ids"].shape[0]).tensor_split(chunks):
            micro = {k: v[idx] for k, v in data.items()}
            logits, values = self.forward(model, micro)
            logprobs, entropy = scored_logprobs(logits, micro, with_entropy=True, **self.truncation)
            parts["logprobs"].append(logprobs)
            parts["entropy"].append(entropy)
            if values is not None:
                parts["values"].append(values.float())
        return {k: torch.cat(v) for k, v in parts.items()}

    def recompute_old(self, data: dict[str, Tensor], metrics: dict[str, float]) -> dict[str, Tensor]:
        """`recompute`, stored as the update's `old_logprobs` (and, with `tis_cap`, `tis_weights`), with
        the rollout parity probe and the entropy added to `metrics`; returns the recomputation."""
        mask = data["completion_mask"]  # [N, T]
        with self.routing.measure(metrics):  # NOTE: routing_mismatch_fraction under the rollout's weights
            own = self.recompute(data)
        data["old_logprobs"] = own["logprobs"]  # [N, T]
        metrics.update(logprob_mismatch(data["rollout_logprobs"], own["logprobs"], mask))
        if "sampling_support" in data:  # NOTE: scored on the engine's masks (score_on_sampling_mask)
            metrics["sampling_mask_kept"] = (data["sampling_support"] >= 0).sum(-1)[mask.bool()].float().mean().item()
        metrics["entropy"] = masked_mean(own["entropy"], mask).item()
        if self.config.tis_cap is not None:
            data["tis_weights"] = truncated_importance_weights(
                own["logprobs"], data["rollout_logprobs"], self.config.tis_cap
            )  # [N, T]
        return own

    def optimize(self, data: dict[str, Tensor]) -> dict[str, float]:
        """`num_iterations` epochs of `num_minibatches` optimizer steps, each accumulating
        `gradient_accumulation_steps` micro-batches; returns metrics averaged over optimizer steps."""
        cfg, acc = self.config, self.accelerator
        extra = self.feed.correct(self, data)  # NOTE: async: the stale tokens' weights and masks
        # NOTE: accelerate's gradient state is process-global; set our count each time.
        acc.gradient_accumulation_steps = cfg.gradient_accumulation_steps
        denominator = AGG_DENOMINATORS[self.algorithm.agg]
        generator = torch.Generator().manual_seed(cfg.seed * 7919 + self.step_count)
        totals: dict[str, float] = defaultdict(float)
        updates = 0
        for _ in range(cfg.num_iterations):
            for micro_indices in minibatch_plan(
                data["loss_mask"].shape[0], cfg.num_minibatches, cfg.gradient_accumulation_steps, generator
            ):
                whole = self.global_mean(float(denominator(data["loss_mask"][torch.cat(micro_indices)])))
                acc.step = 0  # NOTE: accelerate syncs gradients on the last of our micro-batches
                for idx in micro_indices:
                    micro = {k: v[idx] for k, v in data.items()}
                    # NOTE: the micro-batch's share of its minibatch makes the accumulated gradient
                    # exactly that of the minibatch's loss; accelerate divides by the count again.
                    share = float(denominator(micro["loss_mask"])) / max(whole, 1.0)
                    with acc.accumulate(self.model):
                        loss, metrics = self.loss(micro)
                        acc.backward(loss * share * cfg.gradient_accumulation_steps)
                    totals["loss"] += loss.item() * share
                    for key, value in metrics.items():
                        totals[key] += float(value) * share
                totals["grad_norm"] += self.clip_and_step()
                updates += 1
        return {**{k: v / updates for k, v in totals.items()}, **extra}

    def global_mean(self, value: float) -> float:
        """`value` averaged over the ranks. A minibatch's loss divides by this mean of the ranks'
        denominators (e.g. token counts), so DDP's gradient average is the loss of the combined
        batch, even when ranks hold different token counts (DAPO's dropped groups)."""
        if self.accelerator.num_processes == 1:
            return value
        t = torch.tensor([value], dtype=torch.float64, device=self.accelerator.device)
        return float(self.accelerator.reduce(t, reduction="mean").item())

    def clip_and_step(self) -> float:
        """Clip the all-reduced gradients, step, zero; returns the pre-clip grad norm."""
        params = self.passes.all_reduced([p for p in self.model.parameters() if p.requires_grad])
        max_norm = self.config.max_grad_norm
        norm = self.accelerator.clip_grad_norm_(params, max_norm if max_norm is not None else float("inf"))
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return float("nan") if norm is None else float(norm)  # NOTE: some backends report no norm

    def sync_weights(self) -> float:
        """Hand the updated policy to the engine (`feed.sync`: in flight under `async_rollout`); returns the
        seconds it took."""
        start = time.perf_counter()
        self.feed.sync(self)
        return time.perf_counter() - start

    # ---------------------------------------------------------------------- checkpoints
    def save_checkpoint(self, path: str | None = None) -> str:
        """`accelerator.save_state` (model, optimizer, scheduler, RNG) plus the step counter."""
        path = path or os.path.join(self.config.output_dir, f"checkpoint-{self.step_count}")
        self.accelerator.save_state(path)
        self.layout.save_shards(self.model, self.optimizer, path)  # NOTE: FSDP, TP: model and optimizer as DCP
        self.adapter.save(self.unsharded_policy(), path, self.accelerator.is_main_process)  # NOTE: LoRA's adapter
        if self.accelerator.is_main_process:
            with open(os.path.join(path, STATE_FILE), "w") as f:
                json.dump({"step": self.step_count}, f)
            if self.config.save_total_limit is not None:
                for old in checkpoints(self.config.output_dir)[: -self.config.save_total_limit]:
                    shutil.rmtree(old, ignore_errors=True)
        self.accelerator.wait_for_everyone()
        return path

    def load_checkpoint(self, path: str) -> None:
        """Restore a `save_checkpoint` directory and resync the engine; the next step is the saved
        step + 1 (prompt order and sampling seeds depend only on the step)."""
        self.accelerator.load_state(path)
        self.layout.load_shards(self.model, self.optimizer, path)
        with open(os.path.join(path, STATE_FILE)) as f:
            self.step_count = int(json.load(f)["step"])
        self.sync_weights()
        self.version_base = self.step_count - self.engine.policy_version

    def close(self) -> None:
        """Stop the async producer, the engine and the reference's engine; close the progress bar."""
        self.feed.stop()  # NOTE: before the engine closes under a running generate
        self.metrics_logger.close()
        self.engine.close()
        if self.reference is not None:
            self.reference.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

