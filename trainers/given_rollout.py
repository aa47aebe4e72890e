"""`rollout=`: a trainer on an engine-like rollout the caller built, instead of an engine of its own.

    fleet = RolloutFleet(checkpoint_dir, num_engines=2)        # or a RolloutEngine, or a RolloutPool
    trainer = GRPOTrainer(model, tokenizer, reward, dataset, config, rollout=fleet)

Any `rollout.Rollout` works (`generate`, `score`, `update_weights`, `close`, `policy_version`; the trainer hands
it token ids, so one built without a tokenizer works too). It must start on the same weights as `model` (built from the
checkpoint the model was loaded from, or on the model itself); each step's sync sends it the new weights. With
`async_rollout=True` the trainer's producer thread asks it for step k+1 while the learner trains on step k (a fleet or a
pool then generates in its own processes). The trainer closes it with itself, as it would its own engine.
"""

from __future__ import annotations

from trainers.engine_builder import check_given


class GivenRolloutMixin:
    """`rollout=` for an `RLTrainer` (None: the trainer builds its own engine, as before); `build_rollout`
    (`trainers.engine_builder`) takes it from there."""

    def __init__(self, *args, rollout=None, **kwargs) -> None:
        check_given(rollout)
        self.given_rollout = rollout
        super().__init__(*args, **kwargs)
