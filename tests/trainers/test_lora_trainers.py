"""LoRA policies in the trainers (`trainers.lora`): only the adapter trains, the engine serves it unmerged and each sync
copies its tensors only, the reference is the base with the adapter disabled, checkpoints hold a loadable adapter."""

from __future__ import annotations

import pytest
import torch
from support.lora import redraw
from support.training import digit_share

from rollout import ContinuousBatchingConfig, RolloutEngine
from trainers import GRPOConfig, GRPOTrainer, PPOConfig, PPOTrainer
from trainers.common import reference_logprobs
from trainers.lora import ADAPTER_DIR, FULL_FT_LR, LORA_LR_FACTOR, adapter_nbytes
from trainers.reference import AdapterDisabledReference
from trainers.rollouts import batch_tensors
from trainers.tasks import addition_reward, build_tiny_model

ENGINE = dict(page_size=4, num_blocks=128, max_batch_tokens=256)
PROMPT = "123+456="


def base_model(tokenizer):
    return build_tiny_model(tokenizer, hidden_size=64, num_layers=2, seed=0)


def lora_settings(tmp_path, **overrides) -> dict:
    settings = dict(
        output_dir=str(tmp_path),
        max_steps=3,
        prompts_per_step=4,
        group_size=4,
        max_new_tokens=6,
        learning_rate=1e-2,
        lora_rank=4,
        log_stdout=False,
        progress=False,
        engine_config=ContinuousBatchingConfig(**ENGINE),
    )
    settings.update(overrides)
    return settings


def lora_trainer(tokenizer, dataset, tmp_path, **overrides) -> GRPOTrainer:
    return GRPOTrainer(
        base_model(tokenizer),
        tokenizer,
        [addition_reward, digit_share],
        dataset,
        GRPOConfig(**lora_settings(tmp_path, **overrides)),
    )


def split_state(policy) -> tuple[dict, dict]:
    """(base tensors, LoRA tensors) of a PeftModel, cloned."""
    state = {k: v.detach().clone() for k, v in policy.state_dict().items()}
    return (
        {k: v for k, v in state.items() if ".lora_" not in k},
        {k: v for k, v in state.items() if ".lora_" in k},
    )


def greedy(engine, tokenizer, **kwargs):
    return engine.generate([tokenizer(PROMPT).input_ids], temps=0.0, max_new_tokens=6, **kwargs)


def engine_vs_trainer(trainer, tokenizer) -> float:
    """Greedy rollout of a fixed prompt: max |engine logprob - the trainer's own log_softmax| (the adapter on)."""
    batch = greedy(trainer.engine, tokenizer)
    with torch.no_grad():
        logits = trainer.policy(input_ids=batch.input_ids).logits.float()[
            :, batch.prompt_ids.shape[1] - 1 : -1
        ]
    mine = torch.log_softmax(logits, -1).gather(-1, batch.completion_ids[..., None]).squeeze(-1)  # [1, T]
    return (mine - batch.logprobs)[batch.completion_mask.bool()].abs().max().item()


def test_lora_grpo_trains_the_adapter_only_and_syncs_its_bytes(tokenizer, dataset, tmp_path, monkeypatch):
    import rollout.engine.core as engine_module  # NOTE: the core copies full weights (load_weights)

    def full_copy(*args, **kwargs):
        raise AssertionError("a LoRA sync took the full-weight path (copy_weights)")

    monkeypatch.setattr(engine_module, "copy_weights", full_copy)
    trainer = lora_trainer(tokenizer, dataset, tmp_path)
    assert [info.name for info in trainer.engine.list_loras()] == [
        "default"
    ]  # NOTE: served unmerged, in a slot
    optimized = {id(p) for group in trainer.optimizer.param_groups for p in group["params"]}
    assert optimized == {id(p) for n, p in trainer.policy.named_parameters() if ".lora_" in n}
    base, lora = split_state(trainer.policy)
    nbytes = adapter_nbytes(trainer.policy)
    assert nbytes == sum(v.numel() * v.element_size() for v in lora.values())
    assert nbytes < 0.1 * sum(v.numel() * v.element_size() for v in base.values())
    for step in range(1, 3):
        metrics = trainer.step()
        assert trainer.engine.policy_version == step
        assert metrics["sync_bytes"] == nbytes  # NOTE: the adapter's tensors, never the base weights
        assert metrics["logprob_mismatch_max"] < 1e-4
        assert engine_vs_trainer(trainer, tokenizer) < 1e-5, f"engine adapter stale after step {step}"
    base_after, lora_after = split_state(trainer.policy)
    unchanged = [k for k in base if not torch.equal(base[k], base_after[k])]
    assert not unchanged, f"base weights changed: {unchanged[:3]}"
    assert max((lora[k] - lora_after[k]).abs().max().item() for k in lora) > 1e-3  # the adapter did learn
    trainer.close()


def test_reference_is_the_base_with_the_adapter_disabled(tokenizer, dataset, tmp_path):
    trainer = lora_trainer(tokenizer, dataset, tmp_path, beta=0.1)
    redraw(trainer.policy, seed=1)  # NOTE: a non-zero adapter, so the policy differs from its base
    assert trainer.ref_model is trainer.policy  # NOTE: no second copy of the weights
    assert isinstance(trainer.reference, AdapterDisabledReference)
    metrics = trainer.step()
    assert metrics["kl"] > 1e-3
    data = batch_tensors(
        trainer.engine.generate([tokenizer(PROMPT).input_ids] * 2, temps=1.0, max_new_tokens=6, seed=0)
    )
    trainer.policy.train()
    ref = trainer.reference(data, 1)  # [N, T]
    assert trainer.policy.training  # NOTE: its mode as found
    mask = data["completion_mask"].bool()
    expected = reference_logprobs(base_model(tokenizer).eval(), data, 1)
    assert (ref - expected)[mask].abs().max().item() < 1e-6
    policy = reference_logprobs(trainer.policy.eval(), data, 1)
    assert (policy - expected)[mask].abs().max().item() > 1e-2  # NOTE: the adapter does change the policy
    trainer.close()


def test_checkpoint_holds_an_adapter_the_engine_loads(tokenizer, dataset, tmp_path):
    trainer = lora_trainer(tokenizer, dataset, tmp_path)
    redraw(trainer.policy, seed=2)
    trainer.step()
    path = trainer.save_checkpoint()
    want = greedy(trainer.engine, tokenizer)
    trainer.close()
    config = ContinuousBatchingConfig(max_loras=1, max_lora_rank=4, **ENGINE)
    with RolloutEngine(base_model(tokenizer), config=config) as engine:
        engine.add_lora("policy", f"{path}/{ADAPTER_DIR}")
        got = greedy(engine, tokenizer, lora="policy")
    assert got.completion_ids.tolist() == want.completion_ids.tolist()
    assert (got.logprobs - want.logprobs).abs().max().item() < 1e-5


def test_ppo_with_lora_trains_adapter_and_value_head(tokenizer, dataset, tmp_path):
    config = PPOConfig(**lora_settings(tmp_path, max_steps=1, group_size=1, kl_coef=0.05))
    trainer = PPOTrainer(base_model(tokenizer), tokenizer, digit_share, dataset, config)
    base, _ = split_state(trainer.policy)
    head = trainer.value_model.value_head.weight.detach().clone()
    metrics = trainer.step()
    assert metrics["sync_bytes"] == adapter_nbytes(trainer.policy) and metrics["kl"] >= 0
    assert all(torch.equal(v, split_state(trainer.policy)[0][k]) for k, v in base.items())
    assert not torch.equal(head, trainer.value_model.value_head.weight)
    trainer.close()


def test_learning_rate_default_scales_with_lora():
    assert GRPOConfig().learning_rate == FULL_FT_LR
    assert GRPOConfig(lora_rank=1).learning_rate == pytest.approx(FULL_FT_LR * LORA_LR_FACTOR)
    assert GRPOConfig(lora_rank=1, learning_rate=3e-6).learning_rate == 3e-6  # NOTE: a given lr is kept
    assert LORA_LR_FACTOR == 10.0


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        (dict(lora_rank=0), "lora_rank"),
        (dict(lora_rank=-2), "lora_rank"),
        (dict(lora_rank=True), "lora_rank"),
        (dict(lora_rank=4, lora_alpha=0.0), "lora_alpha"),
        (dict(lora_rank=4, lora_target_modules=[]), "lora_target_modules"),
        (dict(lora_rank=4, batch_invariant=True), "batch_invariant"),
    ],
)
def test_bad_lora_config_is_refused_by_name(fields, named):
    with pytest.raises(ValueError, match=named):
        GRPOConfig(**fields)


def test_unknown_target_modules_fsdp_and_given_rollouts_are_refused(tokenizer, dataset, tmp_path):
    with pytest.raises(ValueError, match=r"lora_target_modules: \['nonexistent_proj'\]"):
        lora_trainer(tokenizer, dataset, tmp_path, lora_target_modules=["q_proj", "nonexistent_proj"])
    with pytest.raises(ValueError, match="lora_rank does not run under FSDP"):
        lora_trainer(tokenizer, dataset, tmp_path, fsdp=True)

    class RolloutPool:  # NOTE: a rollout.Rollout, as the given-rollout check sees it
        policy_version, pad_token_id = 0, 0
        generate = score = update_weights = sleep = wake = close = staticmethod(lambda *a, **k: None)

    with pytest.raises(ValueError, match="lora_rank with rollout=RolloutPool.*no adapter name"):
        GRPOTrainer(
            base_model(tokenizer),
            tokenizer,
            digit_share,
            dataset,
            GRPOConfig(**lora_settings(tmp_path)),
            rollout=RolloutPool(),
        )


def test_async_lora_engine_copy_gets_adapter_only_syncs(tokenizer, dataset, tmp_path, monkeypatch):
    import rollout.engine.core as engine_module  # NOTE: the core copies full weights (load_weights)

    def full_copy(*args, **kwargs):
        raise AssertionError("a LoRA sync took the full-weight path (copy_weights)")

    monkeypatch.setattr(engine_module, "copy_weights", full_copy)
    trainer = lora_trainer(tokenizer, dataset, tmp_path, async_rollout=True, max_staleness=0)
    assert trainer.engine.model is not trainer.policy  # NOTE: async generates on its own copy
    history = trainer.train()
    assert [h["sync_bytes"] for h in history] == [adapter_nbytes(trainer.policy)] * 3
    assert max(h["logprob_mismatch_max"] for h in history) < 1e-4  # NOTE: max_staleness 0: on the current adapter
    trainer.close()
