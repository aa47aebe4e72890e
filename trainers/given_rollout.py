"""`rollout=`: a trainer on an engine-like rollout the caller built, instead of an engine of its own.

    fleet = RolloutFleet(checkpoint_dir, num_engines=2)        # or a RolloutEngine, or a RolloutPool
    trainer = GRPOTrainer(model, tokenizer, reward, dataset, config, rollout=fleet)

Anything with the engine's RL API works: `generate(prompts, temps=, group_size=, max_new_tokens=, top_k=, top_p=,
seed=)` -> `RolloutBatch`, `update_weights(policy, in_flight=)`, `policy_version`, `pad_token_id`, `device`,
`sleep()` / `wake()`, `close()`. It must start on the same weights as `model` (built from the checkpoint the model
was loaded from, or on the model itself); each step's sync sends it the new weights. With `async_rollout=True`
the trainer's producer thread asks it for step k+1 while the learner trains on step k (a fleet or a pool then
generates in its own processes). The trainer closes it with itself, as it would its own engine.
"""

from __future__ import annotations

# NOTE: why a LoRA policy cannot use each given rollout yet (each would sync or serve the whole model)
LORA_REFUSALS = {
    "RolloutPool": "its requests carry no adapter name and its update_weights broadcasts every weight",
    "RolloutFleet": "its engine actors load full state dicts on every update",
    "RolloutEngine": "an engine built before the trainer wraps the policy with PEFT serves no adapter",
}
ENGINE_API = ("generate", "update_weights", "policy_version", "pad_token_id", "sleep", "wake", "close")


class GivenRolloutMixin:
    """`rollout=` for an `RLTrainer` (None: the trainer builds its own engine, as before)."""

    def __init__(self, *args, rollout=None, **kwargs) -> None:
        if rollout is not None:
            missing = [name for name in ENGINE_API if not hasattr(rollout, name)]
            if missing:
                raise ValueError(f"rollout must have the RolloutEngine API (a RolloutEngine, RolloutPool or "
                                 f"RolloutFleet); {type(rollout).__name__} lacks {missing}")
        self.given_rollout = rollout
        super().__init__(*args, **kwargs)

    def build_engine(self):
        if self.given_rollout is None:
            return super().build_engine()
        if self.config.lora_rank is not None:
            raise ValueError(f"lora_rank with rollout={type(self.given_rollout).__name__} is not supported yet: "
                             f"{LORA_REFUSALS.get(type(self.given_rollout).__name__, LORA_REFUSALS['RolloutEngine'])}; "
                             "leave rollout= out (the trainer's own engine syncs the adapter only)")
        if self.config.engine_dtype is not None:
            raise ValueError("engine_dtype does not apply to a given rollout: build it in that dtype instead")
        if getattr(self.config, "async_rollout", False) and shares_weights(self.given_rollout, self.policy):
            raise ValueError("async_rollout with a rollout engine built on the trainer's own model: the optimizer "
                             "would change its weights under a running generation; build it on a copy of the model")
        return self.given_rollout


def shares_weights(rollout, policy) -> bool:
    """Whether `rollout` is an in-process engine running on `policy`'s own parameter storage."""
    model = getattr(rollout, "model", None)
    if not hasattr(model, "parameters"):
        return False
    ours = {p.data_ptr() for p in policy.parameters()}
    return any(p.data_ptr() in ours for p in model.parameters())
