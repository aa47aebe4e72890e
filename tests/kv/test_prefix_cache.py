"""Prefix caching end to end: hits, identical outputs, counters that add up, blocks returned, reset."""

from __future__ import annotations

import functools

import pytest
import torch
from support.tiny_models import VOCAB, hf_greedy, make_model, random_prompts
from transformers import GenerationConfig

from rollout import ContinuousBatchingConfig
from rollout.engine.core import EngineCore

PS = 16
PREFIX = 64  # 4 full pages
MAX_NEW = 6
GC = GenerationConfig(do_sample=False, eos_token_id=None, max_new_tokens=MAX_NEW)


@functools.cache
def setup():
    model = make_model("llama", seed=1)
    g = torch.Generator().manual_seed(5)
    prefix = torch.randint(1, VOCAB, (PREFIX,), generator=g).tolist()
    prompts = [
        prefix + torch.randint(1, VOCAB, (n,), generator=g).tolist() for n in (1, 5, 9, 16, 17, 23, 30, 40)
    ]
    return model, prompts


def make_core(sharing: bool = True) -> EngineCore:
    model, _ = setup()
    cbc = ContinuousBatchingConfig(
        page_size=PS, num_blocks=128, max_batch_tokens=48, allow_block_sharing=sharing
    )
    return EngineCore(model, GC, cbc)


def run(core: EngineCore, prompts: list[list[int]], tag: str = "r") -> list[list[int]]:
    reqs = [core.make_request(p, request_id=f"{tag}{i}") for i, p in enumerate(prompts)]
    for r in reqs:
        core.add(r)
    while core.has_work():
        core.step()
    assert all(len(r.generated) == MAX_NEW for r in reqs)
    return [r.generated for r in reqs]


def test_shared_prefix_hits_the_cache_and_changes_nothing():
    _, prompts = setup()
    total = sum(map(len, prompts))
    on, off = make_core(True), make_core(False)
    out_on, out_off = run(on, prompts), run(off, prompts)
    assert out_on == out_off

    s = on.cache_stats()
    assert s["preemptions"] == 0
    assert s["cached_prompt_tokens"] > 0
    # NOTE: each later request waits for the shared pages in flight, then reads all four of them
    assert s["cached_prompt_tokens"] == (len(prompts) - 1) * PREFIX
    assert s["computed_prompt_tokens"] + s["cached_prompt_tokens"] == total
    assert s["generated_tokens"] == MAX_NEW * len(prompts)

    s = off.cache_stats()
    assert s["cached_prompt_tokens"] == 0 and s["computed_prompt_tokens"] == total


def test_every_block_is_free_after_the_run_and_cached_pages_stay_reusable():
    _, prompts = setup()
    core = make_core()
    run(core, prompts)
    s = core.cache_stats()
    assert s["free_blocks"] == s["num_blocks"]
    assert s["cached_pages"] > 0  # freed, but their hashes are kept for later hits
    core.page_pool.check_invariants()


def test_repeat_hits_every_full_page_and_reset_makes_it_miss():
    _, prompts = setup()
    core = make_core()
    prompt = prompts[6]  # 94 tokens: 5 full pages before the last token
    (first,) = run(core, [prompt], "a")
    before = core.cache_stats()
    assert before["cached_prompt_tokens"] == 0 and before["computed_prompt_tokens"] == len(prompt)

    (again,) = run(core, [prompt], "b")
    after = core.cache_stats()
    assert again == first
    hit = (len(prompt) - 1) // PS * PS  # the last prompt token is always recomputed
    assert after["cached_prompt_tokens"] - before["cached_prompt_tokens"] == hit
    assert after["computed_prompt_tokens"] - before["computed_prompt_tokens"] == len(prompt) - hit

    assert core.reset_prefix_cache() > 0
    assert core.cache_stats()["cached_pages"] == 0
    (third,) = run(core, [prompt], "c")
    last = core.cache_stats()
    assert third == first
    assert last["cached_prompt_tokens"] == after["cached_prompt_tokens"]  # a miss
    assert last["computed_prompt_tokens"] - after["computed_prompt_tokens"] == len(prompt)
    assert last["free_blocks"] == last["num_blocks"]


def test_a_group_of_identical_prompts_computes_the_prompt_once():
    _, prompts = setup()
    prompt = prompts[3]  # 80 tokens: 5 pages, the last one full
    core = make_core()
    out = run(core, [prompt] * 4)
    (alone,) = run(make_core(False), [prompt])
    assert out == [alone] * 4
    s = core.cache_stats()
    # the three followers reuse all but the last prompt token of the leader's KV
    assert s["cached_prompt_tokens"] == 3 * (len(prompt) - 1)
    assert s["computed_prompt_tokens"] == len(prompt) + 3
    assert s["free_blocks"] == s["num_blocks"]


# ---------------------------------------------------------------- sliding windows (issue 13, item 5)
@pytest.mark.parametrize("arch, overrides", [("qwen3", {}), ("mistral", {"sliding_window": 512}),
                                             ("mistral", {"sliding_window": 24}), ("gemma2", {})])
def test_a_groups_prompt_is_prefilled_once_on_sliding_window_models(arch, overrides):
    """8 samples of one 40-token prompt: 40 tokens for the leader, then each fork computes only its last
    prompt token (47 in all), whatever the attention windows; greedy rows equal HF."""
    from rollout import RolloutEngine

    model = make_model(arch, **overrides)
    prompt = random_prompts(1, 40, 40, seed=12)[0]
    gc = GenerationConfig(do_sample=False, eos_token_id=None, max_new_tokens=8)
    with RolloutEngine(model, config=ContinuousBatchingConfig(page_size=16, num_blocks=256),
                       generation_config=gc) as engine:
        batch = engine.generate([prompt], temps=0.0, group_size=8)
        assert engine.cache_stats()["computed_prompt_tokens"] == 47
    want = hf_greedy(model, prompt, 8)
    assert batch.completion_ids.tolist() == [want] * 8
