"""`DisaggGRPOTrainer`: GRPO whose rollouts come from `rollout serve` processes instead of an engine in the
learner's process (the disaggregated layout: rollout servers on their own cores or GPUs, the learner on others).

The trainer is `GRPOTrainer` unchanged but for its engine: a `rollout.fleet.pool.RolloutPool` with the
engine's RL API (`generate` -> `RolloutBatch` of token ids and logprobs straight from the servers,
`update_weights(policy)` -> one bucketed broadcast to every live server, `policy_version`). By default the step
stays synchronous: generate on the servers, train here, broadcast, next step. With `async_rollout=True`
(`trainers.async_rollout`) a producer thread of this process asks the servers for step k+1 (up to k+K) while
the learner trains on step k; it only waits on HTTP (the GIL is free for the learner), and each broadcast is
applied by the servers in flight (`in_flight="keep"`), so the servers' per-token `weight_versions` give the
staleness of every token. The parity probe
(`logprob_mismatch_max`) compares the servers' logprobs with the learner's own on the same tokens, so a
broadcast that did not land shows there. One learner process (the broadcast has one rank 0).
"""

from __future__ import annotations

from rollout.fleet.pool import RolloutPool

from .grpo import GRPOConfig, GRPOTrainer


class DisaggGRPOTrainer(GRPOTrainer):
    """`GRPOTrainer` on a `RolloutPool` (see the module docstring).

    Args:
        model, tokenizer, reward_funcs, train_dataset, config: as `GRPOTrainer`.
        pool: the pool of rollout servers; they must serve the same initial weights as `model` (started on
            the checkpoint it was loaded from). The trainer closes the pool; the servers are the caller's.
    """

    def __init__(self, model, tokenizer, reward_funcs, train_dataset, config: GRPOConfig | None = None, *,
                 pool: RolloutPool, **kwargs) -> None:
        if not isinstance(pool, RolloutPool):
            raise ValueError(f"pool must be a rollout.fleet.pool.RolloutPool, got {type(pool).__name__}")
        self.pool = pool
        super().__init__(model, tokenizer, reward_funcs, train_dataset, config, rollout=pool, **kwargs)
        if self.accelerator.num_processes != 1:
            raise ValueError("DisaggGRPOTrainer runs one learner process (the weight broadcast has one rank 0); "
                             f"got {self.accelerator.num_processes}")
