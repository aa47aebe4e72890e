"""What a submission means (issue 13, items 1, 6, 7, 10): torch's global RNG is left alone, stop tokens
are a union, `input_ids` is one flat prompt, and a prompt is checked once, outside the manager's lock."""

from __future__ import annotations

import pytest
import torch
from support.tiny_models import hf_greedy, make_model, random_prompts
from transformers import GenerationConfig

import rollout.engine.core
from rollout import ContinuousBatchingConfig, RolloutEngine, init_continuous_batching
from rollout.engine.core import EngineCore

SMALL = dict(page_size=16, num_blocks=64)


@pytest.fixture(scope="module")
def model():
    return make_model("qwen3", seed=0)


def greedy_gc(eos=None, max_new_tokens: int = 10) -> GenerationConfig:
    return GenerationConfig(do_sample=False, eos_token_id=eos, max_new_tokens=max_new_tokens)


def distinct_greedy(model, n: int = 10) -> tuple[list[int], list[int]]:
    """A prompt whose first `n` greedy tokens are all different (so each can serve as a stop token)."""
    for seed in range(50):
        prompt = random_prompts(1, 6, 10, seed=seed)[0]
        ref = hf_greedy(model, prompt, n)
        if len(set(ref)) == n:
            return prompt, ref
    raise AssertionError("no prompt with distinct greedy tokens")


# ------------------------------------------------------------------------------- 1. global RNG
def test_building_and_running_an_engine_leaves_the_global_rng_alone(model):
    torch.manual_seed(123)
    expected = torch.rand(4)
    torch.manual_seed(123)
    with RolloutEngine(model, config=ContinuousBatchingConfig(**SMALL), generation_config=greedy_gc()) as engine:
        batch = engine.generate([[1, 2, 3]], temps=1.0, group_size=4, max_new_tokens=5)  # unseeded sampling
    assert torch.equal(torch.rand(4), expected)
    assert batch.completion_mask.sum() == 20


def test_unseeded_requests_draw_from_the_engines_own_generator(model):
    """Two engines built after the same global seed sample differently: no stream is taken from the global one."""
    outs = []
    for _ in range(2):
        torch.manual_seed(7)
        core = EngineCore(model, GenerationConfig(do_sample=True, eos_token_id=None, max_new_tokens=16),
                          ContinuousBatchingConfig(**SMALL))
        req = core.make_request([1, 2, 3], temperature=1.0)
        core.add(req)
        while core.has_work():
            core.step()
        outs.append(req.generated)
    assert outs[0] != outs[1]


# ------------------------------------------------------------------------------- 6. stop tokens
def test_stop_tokens_are_the_union_of_tokenizer_model_and_request(model):
    from test_engine import word, word_tokenizer

    prompt, ref = distinct_greedy(model)
    tokenizer = word_tokenizer(ref[7])  # the tokenizer's EOS comes late
    saved = model.generation_config.eos_token_id
    model.generation_config.eos_token_id = [ref[9], ref[4]]  # Llama 3 style: a list in the model's config
    try:
        with RolloutEngine(model, tokenizer=tokenizer, config=ContinuousBatchingConfig(**SMALL)) as engine:
            batch = engine.generate([" ".join(map(word, prompt))], temps=0.0, max_new_tokens=10)
    finally:
        model.generation_config.eos_token_id = saved
    assert batch.completion_ids[0, : int(batch.completion_mask[0].sum())].tolist() == ref[:5]
    assert batch.finish_reasons == ["stop"]

    m = init_continuous_batching(model, generation_config=greedy_gc(eos=ref[5]),
                                 continuous_batching_config=ContinuousBatchingConfig(**SMALL))
    m.start()
    try:
        m.add_request(prompt, request_id="own-first", eos_token_ids=[ref[2]])
        m.add_request(prompt, request_id="engine-first", eos_token_ids=[ref[8]])
        m.add_request(prompt, request_id="ignore", eos_token_ids=[ref[8]], ignore_eos=True)
        results = {r.request_id: r.generated_tokens for r in m}
    finally:
        m.destroy()
    assert results == {"own-first": ref[:3], "engine-first": ref[:6], "ignore": ref[:9]}


# ------------------------------------------------------------------------------- 7. input shape
def test_a_2d_tensor_or_nested_list_is_not_one_prompt(model):
    m = init_continuous_batching(model, generation_config=greedy_gc(max_new_tokens=3),
                                 continuous_batching_config=ContinuousBatchingConfig(**SMALL))
    m.start()
    try:
        for bad in (torch.tensor([[1, 2, 3], [4, 5, 6]]), torch.tensor([[1, 2, 3]]), [[1, 2], [3, 4]], [1, [2]],
                    [1.0, 2.0], torch.tensor([1.0, 2.0]), "1 2 3"):
            with pytest.raises(ValueError, match="input_ids"):
                m.add_request(bad)
        rid = m.add_request(torch.tensor([1, 2, 3]))  # a 1-D tensor is one prompt
        results = {r.request_id: r for r in m}
    finally:
        m.destroy()
    assert list(results) == [rid] and results[rid].prompt_ids == [1, 2, 3]
    assert all(type(t) is int for t in results[rid].prompt_ids)

    with RolloutEngine(model, config=ContinuousBatchingConfig(**SMALL), generation_config=greedy_gc()) as engine:
        with pytest.raises(ValueError, match="input_ids"):
            engine.generate([torch.tensor([[1, 2, 3], [4, 5, 6]])], max_new_tokens=2)
        rows = engine.generate(torch.tensor([[1, 2, 3], [4, 5, 6]]), temps=0.0, max_new_tokens=2)  # rows
    assert rows.prompt_ids.tolist() == [[1, 2, 3], [4, 5, 6]]


# ------------------------------------------------------------------------ 10. submission cost
def test_a_groups_prompt_is_checked_once_outside_the_lock(model, monkeypatch):
    engine = RolloutEngine(model, config=ContinuousBatchingConfig(**SMALL), generation_config=greedy_gc())
    checks: list[int] = []
    check = rollout.engine.core.check_token_ids

    def counting_check(ids, vocab_size):
        assert not engine.manager.debug_state()["lock_held"], "a prompt was validated under the manager's lock"
        checks.append(len(ids))
        return check(ids, vocab_size)

    monkeypatch.setattr(rollout.engine.core, "check_token_ids", counting_check)
    try:
        engine.generate([[1, 2, 3, 4], [5, 6]], temps=1.0, group_size=8, max_new_tokens=2)
        assert checks == [4, 2]  # once per prompt, not once per sample
        checks.clear()
        engine.manager.add_requests([[1, 2, 3], [4, 5]], max_new_tokens=2)
        engine.manager.add_request([7, 8, 9], max_new_tokens=2)
        assert sorted(checks) == [2, 3, 3]  # add_requests checks each input once, not twice
        assert len(list(engine.manager)) == 3
    finally:
        engine.close()
