"""`build_rollout`: the one place a trainer gets its `Rollout`, whatever the run: a rollout the caller gave
(`rollout=`: an engine, a `RolloutPool`, a `RolloutFleet`, a `RolloutClient`), or an engine of its own on the
policy's weights (zero-copy), on a cast copy (`engine_dtype`), or on a copy refreshed by each sync (async GRPO,
where the optimizer must not change the weights under a running generation).

    fleet = RolloutFleet(checkpoint_dir, num_engines=2)        # or a RolloutEngine, or a RolloutPool
    trainer = GRPOTrainer(model, tokenizer, reward, dataset, config, rollout=fleet)

A given rollout is any `rollout.Rollout` (`generate`, `score`, `update_weights`, `close`, `policy_version`; the
trainer hands it token ids, so one built without a tokenizer works too). It must start on the same weights as
`model` (built from the checkpoint the model was loaded from, or on the model itself); each step's sync sends it
the new weights. With `async_rollout=True` the trainer's producer thread asks it for step k+1 while the learner
trains on step k (a fleet or a pool then generates in its own processes). The trainer closes it with itself, as it
would its own engine.
"""

from __future__ import annotations

import copy

import torch

from rollout import ContinuousBatchingConfig, Rollout, RolloutEngine

# NOTE: why a LoRA policy cannot use each given rollout yet (each would sync or serve the whole model)
LORA_REFUSALS = {
    "RolloutPool": "its requests carry no adapter name and its update_weights broadcasts every weight",
    "RolloutFleet": "its engine actors load full state dicts on every update",
    "RolloutEngine": "an engine built before the trainer wraps the policy with PEFT serves no adapter",
}


def check_given(rollout) -> None:
    """A ValueError naming what `rollout=` must be, unless it is a `rollout.Rollout`."""
    if rollout is not None and not isinstance(rollout, Rollout):
        raise ValueError(f"rollout must be a rollout.Rollout (a RolloutEngine, RolloutPool, RolloutFleet or "
                         f"RolloutClient: generate, score, update_weights, close, policy_version); got "
                         f"{type(rollout).__name__}")


def build_rollout(trainer) -> Rollout:
    """The trainer's `Rollout` (module docstring); ValueError naming a setting a given rollout cannot run."""
    cfg, given = trainer.config, trainer.given_rollout
    if given is not None:
        return _given(trainer, given)
    if cfg.engine_dtype is not None:  # NOTE: a cast copy; each sync copies and casts
        model = copy.deepcopy(trainer.unsharded_policy()).to(getattr(torch, cfg.engine_dtype)).eval()
        model.requires_grad_(False)
    elif getattr(cfg, "async_rollout", False) and trainer.layout.fsdp is None:
        model = copy.deepcopy(trainer.policy).eval()  # NOTE: refreshed by each sync, never changed mid-generation
        model.requires_grad_(False)
    else:
        model = trainer.unsharded_policy()  # NOTE: the policy itself (zero-copy), under FSDP a full copy
    engine_config = colocated_engine_config(cfg.engine_config, cfg.engine_memory_fraction,
                                            next(model.parameters()).device)
    return RolloutEngine(model, tokenizer=trainer.tokenizer, config=engine_config)


def _given(trainer, rollout) -> Rollout:
    cfg, kind = trainer.config, type(rollout).__name__
    if cfg.lora_rank is not None:
        raise ValueError(f"lora_rank with rollout={kind} is not supported yet: "
                         f"{LORA_REFUSALS.get(kind, LORA_REFUSALS['RolloutEngine'])}; "
                         "leave rollout= out (the trainer's own engine syncs the adapter only)")
    if cfg.engine_dtype is not None:
        where = "rollout servers: start them with --dtype" if kind == "RolloutPool" else "a given rollout: build it"
        raise ValueError(f"engine_dtype does not apply to {where} in that dtype instead")
    if getattr(cfg, "async_rollout", False) and shares_weights(rollout, trainer.policy):
        raise ValueError("async_rollout with a rollout engine built on the trainer's own model: the optimizer "
                         "would change its weights under a running generation; build it on a copy of the model")
    return rollout


def shares_weights(rollout, policy) -> bool:
    """Whether `rollout` is an in-process engine running on `policy`'s own parameter storage."""
    model = getattr(rollout, "model", None)
    if not hasattr(model, "parameters"):
        return False
    ours = {p.data_ptr() for p in policy.parameters()}
    return any(p.data_ptr() in ours for p in model.parameters())


def colocated_engine_config(
    config: ContinuousBatchingConfig | None, fraction: float | None, device: torch.device
) -> ContinuousBatchingConfig | None:
    """The engine config for an engine that shares `device` with training: on an accelerator its
    KV cache takes `fraction` of the free memory (`max_memory_percent`); on a CPU, or with no
    fraction, `config` as given (the engine's CPU default is a small share of RAM)."""
    if fraction is None or device.type == "cpu":
        return config
    return (config or ContinuousBatchingConfig()).replace(max_memory_percent=fraction)

