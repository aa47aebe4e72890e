"""Parameters changed in place without `update_weights` never serve stale prefix KV (issue 13, item 2).

An optimizer step on the trainer's own model, or a `copy_` into a persistent manager's model, bumps the
tensors' version counters; the engine notices before admitting the next requests and drops its prefix
cache, so greedy outputs follow the current weights.
"""

from __future__ import annotations

import copy

import pytest
import torch
from support.tiny_models import hf_greedy, make_model, random_prompts
from transformers import GenerationConfig

import rollout.kernels.linear as linear
from rollout import ContinuousBatchingConfig, RolloutEngine, continuous_batching_context_manager

GC = GenerationConfig(do_sample=False, eos_token_id=None, max_new_tokens=6)
CBC = ContinuousBatchingConfig(page_size=16, num_blocks=64)
PROMPTS = random_prompts(2, 36, 44, seed=31)  # two full pages each: prefix-cache hits on a second call


def run(manager, prompts) -> list[list[int]]:
    ids = [manager.add_request(p, max_new_tokens=6) for p in prompts]
    results = {r.request_id: r.generated_tokens for r in manager}
    return [results[i] for i in ids]


def test_persistent_manager_after_an_in_place_copy():
    model, other = make_model("qwen3", seed=0), make_model("qwen3", seed=1)
    try:
        with continuous_batching_context_manager(model, GC, CBC, persistent_manager=True) as m:
            assert run(m, PROMPTS) == [hf_greedy(model, p, 6) for p in PROMPTS]
        with torch.no_grad():
            for p, q in zip(model.parameters(), other.parameters(), strict=True):
                p.copy_(q)
        with continuous_batching_context_manager(model, GC, CBC, persistent_manager=True) as m2:
            assert m2 is m
            assert run(m2, PROMPTS) == [hf_greedy(other, p, 6) for p in PROMPTS]
            # unchanged weights: the pages computed since are served from the cache again
            before = m2.cache_stats()["cached_prompt_tokens"]
            assert run(m2, PROMPTS) == [hf_greedy(other, p, 6) for p in PROMPTS]
            assert m2.cache_stats()["cached_prompt_tokens"] == before + 64
    finally:
        m.destroy()


@pytest.mark.parametrize("packed", [False, True], ids=["torch_linear", "onednn_packed"])
@pytest.mark.parametrize("foreach", [False, True])
def test_engine_on_the_trainers_model_after_an_optimizer_step(foreach, packed, monkeypatch):
    if packed:  # NOTE: every linear of the view on oneDNN packed copies (rollout.kernels.linear), which must follow too
        if not linear.onednn_available():
            pytest.skip("torch has no oneDNN linear here")
        monkeypatch.setattr(linear, "MIN_WEIGHT_ELEMENTS", 0)
    trainer = make_model("qwen3", seed=0).train()
    opt = torch.optim.AdamW(trainer.parameters(), lr=0.05, foreach=foreach)
    with RolloutEngine(trainer, config=CBC, generation_config=GC) as engine:
        ref = copy.deepcopy(trainer).eval()
        assert engine.generate(PROMPTS, temps=0.0).completion_ids.tolist() == [hf_greedy(ref, p, 6) for p in PROMPTS]
        view = engine.manager.core.view
        assert any(getattr(m, "_rollout_packed", None) is not None for m in view.modules()) == packed
        ids = torch.tensor([PROMPTS[0]])
        trainer(ids, labels=ids).loss.backward()
        opt.step()  # no update_weights: the engine shares these tensors
        opt.zero_grad()
        ref = copy.deepcopy(trainer).eval()
        want = [hf_greedy(ref, p, 6) for p in PROMPTS]
        assert engine.generate(PROMPTS, temps=0.0).completion_ids.tolist() == want
