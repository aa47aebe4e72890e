"""Routed experts recorded in the engine step (`generate(..., return_routed_experts=True)`, `score` likewise) on
the four MoE architectures (Qwen3-MoE, Mixtral, OLMoE, gpt-oss with sinks and a sliding layer): every token that
ran has HF's top-k of its teacher-forced router logits, through forks, prefix-cache hits, chunked prompts,
preemption (recomputed and offloaded); greedy equals HF `generate`; what is refused is refused by name."""

from __future__ import annotations

import pytest
import torch
from support.routes import assert_row_routes, batch_rows
from support.tiny_models import MOE_ARCHS, hf_greedy, make_model, random_prompts
from transformers import GenerationConfig

from rollout import ContinuousBatchingConfig, RolloutEngine

GC = GenerationConfig(do_sample=False, eos_token_id=None, max_new_tokens=6)
MAX_NEW = 6


def engine(model, **cfg) -> RolloutEngine:
    config = dict(page_size=16, num_blocks=64, max_batch_tokens=32) | cfg
    return RolloutEngine(model, config=ContinuousBatchingConfig(**config), generation_config=GC)


def prompts() -> list[list[int]]:
    """Unrelated prompts (3..40 tokens, chunked by the 32-token budget) and three sharing a 33-token prefix."""
    return random_prompts(5, 3, 40, seed=3, shared_prefix=33, n_shared=3)


def check_batch(model, batch) -> int:
    pad = ~batch.attention_mask.bool()
    assert batch.routed_experts.dtype == torch.int16
    assert batch.routed_experts.shape[:2] == batch.input_ids.shape
    assert (batch.routed_experts[pad] == -1).all(), "padding must be -1"
    return sum(assert_row_routes(model, tokens, routes) for tokens, routes in batch_rows(batch))


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_routes_equal_hf_top_k_with_forks_and_prefix_hits(arch):
    model = make_model(arch)
    with engine(model) as eng:
        first = eng.generate(prompts(), temps=0.0, group_size=2, max_new_tokens=MAX_NEW,
                             return_routed_experts=True)
        again = eng.generate(prompts(), temps=0.0, group_size=1, max_new_tokens=MAX_NEW,
                             return_routed_experts=True)  # NOTE: the prompts' full pages now come from the cache
        stats = eng.cache_stats()
    assert stats["cached_prompt_tokens"] >= 2 * 16 * 3, stats  # forks, then hits on every shared prefix page
    ties = check_batch(model, first) + check_batch(model, again)
    assert ties <= 2
    for i, p in enumerate(prompts()):
        want = hf_greedy(model, p, MAX_NEW)
        assert first.completion_ids[2 * i].tolist() == want and again.completion_ids[i].tolist() == want, (arch, i)



@pytest.mark.parametrize("arch", MOE_ARCHS)
@pytest.mark.parametrize("offload", [False, True], ids=["recompute", "offload"])
def test_routes_survive_preemption(arch, offload):
    model = make_model(arch)
    many = random_prompts(6, 20, 40, seed=5)
    cfg = dict(num_blocks=9, max_batch_tokens=64) | ({"cpu_offload_space": 1e-3} if offload else {})
    with engine(model, **cfg) as eng:
        batch = eng.generate(many, temps=0.0, max_new_tokens=24, return_routed_experts=True)
        stats = eng.cache_stats()
        # NOTE: the same prompts again, newest first: their cached pages (restored ones too) are hits
        again = eng.generate(many[::-1], temps=0.0, max_new_tokens=2, return_routed_experts=True)
        hits = eng.cache_stats()["cached_prompt_tokens"] - stats["cached_prompt_tokens"]
    assert stats["preemptions"] > 0, stats
    if offload:
        assert stats["restored_pages"] > 0, stats
    assert hits > 0
    assert check_batch(model, batch) + check_batch(model, again) <= 2


@pytest.mark.parametrize("arch", ["qwen3_moe", "gpt_oss"])
def test_pages_cached_before_routes_were_asked_for_are_not_served_without_routes(arch):
    model = make_model(arch)
    with engine(model) as eng:
        eng.generate(prompts(), temps=0.0, max_new_tokens=2)  # NOTE: fills the prefix cache, recording off
        batch = eng.generate(prompts(), temps=0.0, max_new_tokens=MAX_NEW, return_routed_experts=True)
        later = eng.generate(prompts(), temps=0.0, max_new_tokens=MAX_NEW)  # recording stays on: pages keep routes
        hits = eng.cache_stats()["cached_prompt_tokens"]
        again = eng.generate(prompts(), temps=0.0, max_new_tokens=MAX_NEW, return_routed_experts=True)
        assert eng.cache_stats()["cached_prompt_tokens"] > hits
    assert torch.equal(later.completion_ids, batch.completion_ids)
    assert check_batch(model, batch) + check_batch(model, again) <= 2


def test_score_returns_the_routes_of_prompt_and_completion():
    model = make_model("qwen3_moe")
    ps = random_prompts(3, 5, 20, seed=7)
    cs = random_prompts(3, 2, 9, seed=8)
    with engine(model) as eng:
        scored = eng.score(ps, cs, return_routed_experts=True)
    p_len = max(map(len, ps))
    for i, (p, c) in enumerate(zip(ps, cs, strict=True)):
        row = scored.routed_experts[i]
        routes = torch.cat([row[p_len - len(p) : p_len], row[p_len : p_len + len(c)]])
        # NOTE: a scoring request runs every given token, the last one too: append a never-run slot for the helper
        assert_row_routes(model, p + c + [0], torch.cat([routes, torch.full_like(routes[:1], -1)]))


def test_routes_off_leave_the_batch_and_the_engine_alone():
    model = make_model("mixtral")
    with engine(model) as eng:
        batch = eng.generate(prompts()[:2], temps=0.0, max_new_tokens=3)
        assert batch.routed_experts is None
        assert eng.manager.core.runner.routes is None  # NOTE: no hook, no route pages
        assert not any(m._forward_hooks for m in eng.manager.core.routers)


def test_refusals_name_the_flag():
    with engine(make_model("qwen3")) as eng, pytest.raises(ValueError, match="return_routed_experts.*no mixture"):
        eng.generate([[1, 2, 3]], return_routed_experts=True)
    with engine(make_model("qwen3_moe"), default_compile_level=1) as eng, \
            pytest.raises(ValueError, match="return_routed_experts.*default_compile_level"):
        eng.generate([[1, 2, 3]], return_routed_experts=True)


def test_batch_invariant_mode_refuses_moe_by_name():
    with pytest.raises(ValueError, match="batch_invariant=True does not support mixture-of-experts"):
        engine(make_model("olmoe"), batch_invariant=True)


def test_offloaded_pages_park_their_routes_beside_their_kv():
    from rollout.model.routers import moe_routers
    from rollout.model.routes import RoutedOffloader, RouteRecorder

    class Buffer:  # NOTE: the KV side of the offload buffer: hands out host slots
        def __init__(self):
            self.free = [0, 1, 2]

        def save(self, pages):
            return [self.free.pop(0) for _ in pages]

        def restore(self, slots, pages):
            self.free += slots

        def discard(self, slots):
            self.free += slots

    recorder = RouteRecorder(
        moe_routers(make_model("mixtral")), num_slots=4 * 16, page_size=16, device=torch.device("cpu")
    )
    try:
        recorder.pages.copy_(torch.arange(recorder.pages.numel()).view_as(recorder.pages) % 8)
        page1 = recorder.pages[16:32].clone()
        offloader = RoutedOffloader(Buffer(), recorder)
        slots = offloader.save([1])
        recorder.pages[16:32] = 5  # NOTE: page 1 reused by another request
        offloader.restore(slots, [3])
        assert torch.equal(recorder.pages[48:64], page1)
        assert offloader.free == [1, 2, 0] and not offloader.parked
    finally:
        recorder.close()


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_gate_formula_given_the_routers_own_experts_is_its_own_gate_bitwise(arch):
    from rollout.model.routers import gate_weights, moe_routers

    model = make_model(arch)
    hidden = torch.randn(37, model.config.hidden_size, generator=torch.Generator().manual_seed(0))
    for router in moe_routers(model):
        logits, weights, experts = router(hidden)
        assert torch.equal(gate_weights(router, logits, experts), weights)
        swapped = experts.flip(-1)  # NOTE: the same experts in the other order: the weights follow them
        assert torch.equal(gate_weights(router, logits, swapped), weights.flip(-1))
