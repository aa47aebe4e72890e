"""Asynchronous rollouts for GRPO: generation runs ahead of the learner by at most `max_staleness` versions.

`GRPOConfig(async_rollout=True, max_staleness=K)`: a producer thread generates step j's groups on the
engine's own copy of the policy as soon as the engine holds version >= j - K (versions counted in RL
steps), while the learner trains on an earlier step. The learner hands each update to the engine in flight
(`update_weights(in_flight="keep")`, between two engine steps, KV kept), so a batch started under version
v may finish under v + 1: every token carries the version that sampled it (`RolloutBatch.versions`).

The loss sees the learner's own recomputation as `old_logprobs` (the proximal policy, as in the
synchronous trainer). A token sampled under an older version (staleness = learner version - token version
> 0) gets a truncated importance weight `min(exp(old_logprobs - rollout_logprobs), stale_tis_cap)`
(decoupled PPO, AReaL); with `mask_stale`, tokens staler than `max_staleness` leave the loss. Fresh tokens
are treated exactly as in the synchronous trainer, so `max_staleness=0` (generation waits for every
update) reproduces the synchronous update bit for bit.

The producer starts with `train()` or, in a user's own loop, at the first `step()`, and stops at `close()` (or
`config.max_steps`: a later `step()` is refused by name). With `rollout=` (`trainers.engine_builder`) it asks that
rollout (a `RolloutFleet` or `RolloutPool` generating in other processes) instead of a copy-engine of its own.

Threads: `torch.set_num_threads` acts per calling thread for the OpenMP pool that torch's CPU kernels use
(each thread keeps its own team size; a new thread starts from the last value set anywhere), so with
`rollout_threads=1` / `learner_threads=1` rollout runs on one core and the learner on the other.
Metrics: `staleness_mean` / `staleness_max` (over trained tokens), `stale_fraction`,
`stale_logprob_gap` (|rollout - learner| logprob on stale tokens), `fresh_logprob_mismatch_max` (the largest
|rollout - learner| logprob on the tokens the learner's current version sampled: the engine against the behaviour
policy, the parity probe of an async run, absent from a step without such tokens; `logprob_mismatch_max` compares
every token with the current policy, so it grows with staleness), `time_generate` (the producer's time
for this batch), `time_generate_exposed` (the learner's wait for it), `time_generate_overlapped`.
"""

from __future__ import annotations

import copy
import logging
import threading
import time

import torch
from torch import Tensor

from rollout import RolloutBatch
from rollout.engine.openmp import release_thread_team
from trainers.losses import masked_mean

logger = logging.getLogger("trainers")


class AsyncRollouts:
    """The producer thread and the hand-off of finished batches to the learner.

    Args:
        trainer: the `GRPOTrainer` (its engine, prompts, tokenizer and config are used).
        first_step, last_step: the RL steps to generate (`range(first_step, last_step)`).
        version: the policy version (in RL steps) the engine holds now.
    """

    def __init__(self, trainer, first_step: int, last_step: int, version: int) -> None:
        self.trainer = trainer
        self.max_staleness = trainer.config.max_staleness
        self.steps = range(first_step, last_step)
        # NOTE: its own prompt source: `PromptSource` re-shuffles in place at an epoch change, and the
        # learner reads the same steps' rows (for the rewards) on its own thread
        self.prompts = copy.copy(trainer.prompts)
        self.version = version
        self.ready: dict[int, tuple[RolloutBatch, dict[str, float]]] = {}
        self.error: BaseException | None = None
        self.stopping = False
        self.cv = threading.Condition()
        self.thread = threading.Thread(target=self._run, name="rollout-producer", daemon=True)
        self.thread.start()

    # ------------------------------------------------------------------ producer
    def _run(self) -> None:
        threads = self.trainer.config.rollout_threads
        if threads is not None:
            torch.set_num_threads(threads)  # NOTE: this thread's OpenMP team only
        try:
            for step in self.steps:
                with self.cv:
                    while not self.stopping and self.version < step - self.max_staleness:
                        self.cv.wait()
                    if self.stopping:
                        return
                    started_at = self.version
                rows = self.prompts.rows(step)
                batch, metrics = self.trainer.sample_rollouts(rows, step)
                metrics["rollout_start_version"] = float(started_at)
                with self.cv:
                    self.ready[step] = (batch, metrics)
                    self.cv.notify_all()
        except BaseException as e:  # NOTE: re-raised on the learner's thread by `take`
            logger.exception("rollout producer failed")
            with self.cv:
                self.error = e
                self.cv.notify_all()
        finally:
            release_thread_team()

    # ------------------------------------------------------------------- learner
    def take(self, step: int) -> tuple[RolloutBatch, dict[str, float]]:
        """Step `step`'s batch, waiting for it; the wait is logged as `time_generate_exposed`."""
        start = time.perf_counter()
        with self.cv:
            while step not in self.ready:
                if self.error is not None:
                    raise RuntimeError(f"the rollout producer failed: {self.error!r}") from self.error
                if not self.thread.is_alive():
                    raise RuntimeError(f"the rollout producer ended before step {step}'s batch")
                self.cv.wait(timeout=1.0)  # NOTE: re-check the thread's liveness each second
            batch, metrics = self.ready.pop(step)
        exposed = time.perf_counter() - start
        metrics["time_generate_exposed"] = exposed
        metrics["time_generate_overlapped"] = max(0.0, metrics["time_generate"] - exposed)
        return batch, metrics

    def published(self, version: int) -> None:
        """The engine now holds `version` (in RL steps): generation may run up to `version + K`."""
        with self.cv:
            self.version = version
            self.cv.notify_all()

    def close(self, timeout: float = 60.0) -> None:
        with self.cv:
            self.stopping = True
            self.cv.notify_all()
        self.thread.join(timeout)
        if self.thread.is_alive():
            logger.warning("the rollout producer did not stop within %.0f s (a generate still running)", timeout)


def stale_correction(data: dict[str, Tensor], version: int, max_staleness: int, tis_cap: float | None,
                     mask_stale: bool) -> dict[str, float]:
    """Correct `data` (a GRPO update's tensors, `versions [N, T]` in RL steps) in place for tokens sampled
    by an older policy than `version`: truncated importance weights on them (`tis_cap`), and with
    `mask_stale` no loss on tokens staler than `max_staleness`. Fresh tokens are left as they are.
    Returns the staleness metrics."""
    mask = data["loss_mask"]  # [N, T]
    staleness = torch.where(mask, version - data["versions"], 0)  # [N, T]
    stale = mask & (staleness > 0)  # [N, T]
    gap = (data["rollout_logprobs"] - data["old_logprobs"]).abs()  # [N, T]
    metrics = {
        "staleness_mean": masked_mean(staleness.float(), mask).item() if mask.any() else 0.0,
        "staleness_max": float(staleness.max()) if staleness.numel() else 0.0,
        "stale_fraction": masked_mean(stale.float(), mask).item() if mask.any() else 0.0,
        "stale_logprob_gap": masked_mean(gap, stale).item() if stale.any() else 0.0,
    }
    fresh = mask & (staleness == 0)  # [N, T] sampled by the version that is learning now: behaviour == current
    if fresh.any():
        metrics["fresh_logprob_mismatch_max"] = gap[fresh].max().item()
    if tis_cap is not None and stale.any():
        weights = torch.exp(data["old_logprobs"] - data["rollout_logprobs"]).clamp(max=tis_cap)  # [N, T]
        fresh = data.get("tis_weights", torch.ones_like(weights))
        data["tis_weights"] = torch.where(stale, weights, fresh).detach()
    too_stale = mask & (staleness > max_staleness)
    metrics["stale_masked_fraction"] = masked_mean(too_stale.float(), mask).item() if mask_stale and mask.any() else 0.0
    if mask_stale:
        data["loss_mask"] = mask & ~too_stale
    return metrics


class SyncFeed:
    """The feed part of a synchronous trainer: a step generates its own rollouts when it needs them (the engine
    asleep during the update where the trainer sleeps it), and the update reaches the engine after the step.
    `AsyncFeed` is the other choice. The trainer passes itself to each call.

    Attributes: `producer`, the running `AsyncRollouts` (never one here); `overlaps`, whether the engine
    generates while the learner trains (then it never sleeps)."""

    producer: AsyncRollouts | None = None
    overlaps = False

    def before_train(self, trainer) -> None:
        """Called by `train()` before its first step."""

    def before_step(self, trainer) -> None:
        """Called by `step()` before it collects."""

    def stop(self) -> None:
        """Called when `train()` ends and at `close()`."""

    def generate(self, trainer, rows: list[dict]) -> tuple[RolloutBatch, dict[str, float]]:
        """The trainer's rollouts for `rows` at its current step, `policy_version` counted in RL steps."""
        batch, metrics = trainer.sample_rollouts(rows, trainer.step_count, sleep=trainer.sleeps)
        metrics["policy_version"] = float(batch.policy_version + trainer.version_base)  # NOTE: resumes too
        return batch, metrics

    def correct(self, trainer, data: dict[str, Tensor]) -> dict[str, float]:
        """Adjust the update's tensors in place before the update; returns metrics (none here)."""
        return {}

    def sync(self, trainer) -> None:
        """Hand the updated policy to the engine (a version bump and a prefix-cache flush when it shares the
        trainer's tensors)."""
        trainer.engine.update_weights(trainer.weight_source())  # NOTE: FSDP: full tensors a bucket at a time


class AsyncFeed(SyncFeed):
    """The feed part under `async_rollout` (module docstring): `AsyncRollouts` runs ahead from the first
    `step()` (or `train()`) until `train()` ends or `close()`; batches come from it, each update reaches the
    engine in flight, and the staleness correction runs before the update."""

    overlaps = True

    def __init__(self) -> None:
        self.producer = None
        self.engine_base = 0  # NOTE: RL steps minus engine versions when the producer started

    def before_train(self, trainer) -> None:
        if self.producer is None and trainer.step_count < trainer.config.max_steps:
            self.start(trainer)

    def before_step(self, trainer) -> None:
        """The first step starts the producer (a user's own loop of `step()` overlaps like `train()` does); a step
        past `config.max_steps` is refused (the producer generates up to it)."""
        cfg = trainer.config
        if trainer.step_count >= cfg.max_steps:
            raise ValueError(f"async_rollout generates the steps up to config.max_steps={cfg.max_steps}; "
                             f"step {trainer.step_count + 1} is past it: raise max_steps to train longer")
        if self.producer is None:
            self.start(trainer)

    def start(self, trainer) -> None:
        """Start the producer for steps `step_count` .. `config.max_steps - 1`."""
        if trainer.config.learner_threads is not None:
            torch.set_num_threads(trainer.config.learner_threads)
        self.engine_base = trainer.step_count - trainer.engine.policy_version
        self.producer = AsyncRollouts(trainer, trainer.step_count, trainer.config.max_steps, trainer.step_count)

    def stop(self) -> None:
        if self.producer is not None:
            self.producer.close()
            self.producer = None

    def generate(self, trainer, rows: list[dict]) -> tuple[RolloutBatch, dict[str, float]]:
        if self.producer is None:
            return super().generate(trainer, rows)
        batch, metrics = self.producer.take(trainer.step_count)
        done = batch.completion_mask.bool()  # [N, T]
        batch.versions = torch.where(done, batch.versions + self.engine_base, 0)  # NOTE: in RL steps
        metrics["policy_version"] = float(batch.versions[done].min()) if done.any() else float(trainer.step_count)
        return batch, metrics

    def correct(self, trainer, data: dict[str, Tensor]) -> dict[str, float]:
        if self.producer is None:
            return {}
        cfg = trainer.config
        return stale_correction(data, trainer.step_count, cfg.max_staleness, cfg.stale_tis_cap, cfg.mask_stale)

    def sync(self, trainer) -> None:
        if self.producer is None:
            return super().sync(trainer)
        trainer.engine.update_weights(trainer.weight_source(), in_flight="keep")
        self.producer.published(trainer.step_count + 1)  # NOTE: `step` counts this update after the sync
