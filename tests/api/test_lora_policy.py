"""A PEFT policy (`RolloutEngine(peft_model)`): one base copy (the user's), its adapter served unmerged in a slot,
followed in place, and `update_weights(peft_model)` copying the adapter's tensors only."""

from __future__ import annotations

import pytest
import torch
from support.lora import make_peft, redraw
from support.tiny_models import hf_greedy, make_model, random_prompts, teacher_forced_logprobs
from transformers import GenerationConfig

from rollout import ContinuousBatchingConfig, RolloutEngine

pytest.importorskip("peft", reason="LoRA tests need peft (the [lora] extra)")

NEW = 8
GC = GenerationConfig(do_sample=False, eos_token_id=None, max_new_tokens=NEW)


def _engine(policy, **config) -> RolloutEngine:
    return RolloutEngine(policy, config=ContinuousBatchingConfig(page_size=16, num_blocks=96, **config),
                         generation_config=GC)


def _check(out, model, prompts) -> None:
    for i, prompt in enumerate(prompts):
        got = out.completion_ids[i].tolist()
        assert got == hf_greedy(model, prompt, NEW), i
        torch.testing.assert_close(out.logprobs[i], teacher_forced_logprobs(model, prompt, got), atol=1e-5, rtol=0)


@pytest.mark.parametrize("arch", ["qwen3", "gemma2"])
def test_a_peft_policy_runs_on_one_base_copy_and_follows_in_place_steps(arch):
    base = make_model(arch)
    policy = make_peft(base, seed=1, r=4)
    prompts = random_prompts(4, 5, 40, seed=2)
    with _engine(policy) as engine:
        view = engine.manager.core.view
        assert not any(hasattr(m, "lora_A") for m in view.modules()), "the view still runs PEFT's layers"
        own = policy.base_model.model.model.layers[0].self_attn.q_proj.base_layer.weight
        assert view.base_model.model.model.layers[0].self_attn.q_proj.weight is own  # NOTE: the user's base tensor
        assert [i.name for i in engine.list_loras()] == ["default"]
        _check(engine.generate(prompts, temps=0.0), policy, prompts)
        redraw(policy, seed=5)  # NOTE: in place, as an optimizer step on the LoRA parameters
        _check(engine.generate(prompts, temps=0.0), policy, prompts)
        assert engine.list_loras()[0].version == 2


def test_update_weights_of_a_peft_policy_copies_the_adapter_only():
    base = make_model("llama")
    policy, trained = make_peft(base, seed=1, r=4), make_peft(base, seed=7, r=4)
    base_weights = {n: p.detach().clone() for n, p in policy.named_parameters() if "lora_" not in n}
    prompts = random_prompts(3, 5, 30, seed=3)
    with _engine(policy) as engine:
        engine.generate(prompts, temps=0.0)
        with torch.no_grad():  # NOTE: a base weight of the source that differs: it must not be sent
            trained.base_model.model.model.layers[0].mlp.up_proj.base_layer.weight.mul_(2.0)
        assert engine.update_weights(trained) == 1
        out = engine.generate(prompts, temps=0.0)
        assert out.versions.max().item() == 1
    lora = {n: p for n, p in trained.named_parameters() if "lora_" in n}
    for n, p in policy.named_parameters():
        if "lora_" in n:
            assert torch.equal(p, lora[n]), n  # NOTE: copied into the policy's own adapter, as update_weights does
        else:
            assert torch.equal(p, base_weights[n]), n
    with torch.no_grad():
        trained.base_model.model.model.layers[0].mlp.up_proj.base_layer.weight.div_(2.0)
    _check(out, trained, prompts)


def test_a_peft_policy_mixes_with_added_adapters():
    base = make_model("qwen3")
    policy, other = make_peft(base, seed=1, r=4), make_peft(base, seed=2, r=8, targets=["q_proj", "o_proj"])
    prompts = random_prompts(4, 5, 30, seed=4)
    with _engine(policy, max_loras=1, max_lora_rank=8) as engine:
        engine.add_lora("other", other)
        out = engine.generate(prompts, temps=0.0, lora=[None, "other", "other", None])
        with pytest.raises(ValueError, match="table is full"):
            engine.add_lora("third", other)
    for i, prompt in enumerate(prompts):
        assert out.completion_ids[i].tolist() == hf_greedy(other if i in (1, 2) else policy, prompt, NEW), i


def test_a_peft_policy_that_cannot_run_unmerged_runs_through_peft_layers():
    """DoRA: refused by the unmerged path, so the engine runs PEFT's own layers (one adapter), as before LoRA."""
    base = make_model("qwen3")
    policy = make_peft(base, seed=1, r=2, use_dora=True)
    prompts = random_prompts(2, 5, 20, seed=6)
    with _engine(policy) as engine:
        assert engine.list_loras() == []
        _check(engine.generate(prompts, temps=0.0), policy, prompts)
