"""Per-request seeds: a seeded request samples the same tokens whatever else shares its batches."""

from __future__ import annotations

import functools

import torch
from support.tiny_models import VOCAB, make_model
from transformers import GenerationConfig

from rollout import ContinuousBatchingConfig, RolloutEngine, generate_batch
from rollout.engine.core import EngineCore
from rollout.sampling.seeding import call_seeds, group_seed, sample_seed

MAX_NEW = 12
GC = GenerationConfig(do_sample=True, eos_token_id=None, max_new_tokens=MAX_NEW)
# NOTE: a small step budget, so the seeded request is chunked and decoded beside different neighbours
CBC = ContinuousBatchingConfig(page_size=16, num_blocks=128, max_batch_tokens=64)
TARGET = dict(temperature=1.5, top_k=50, top_p=0.95, seed=1234)


@functools.cache
def setup():
    model = make_model("qwen3", seed=5)
    g = torch.Generator().manual_seed(21)
    prompts = [torch.randint(1, VOCAB, (n,), generator=g).tolist() for n in (20, 7, 33, 12, 50, 3, 26, 41)]
    return model, prompts


def run(specs: list[tuple[list[int], dict]]) -> list[list[int]]:
    """Generate for (prompt, sampling kwargs) pairs on one fresh core; returns the tokens of each."""
    model, _ = setup()
    core = EngineCore(model, GC, CBC)
    reqs = [core.make_request(p, request_id=f"r{i}", **kw) for i, (p, kw) in enumerate(specs)]
    for r in reqs:
        core.add(r)
    while core.has_work():
        core.step()
    assert all(len(r.generated) == MAX_NEW for r in reqs)
    return [r.generated for r in reqs]


def neighbours(prompts: list[list[int]], offset: int) -> list[tuple[list[int], dict]]:
    """15 other sampled requests: unseeded, seeded differently, filtered, hot and cold, greedy."""
    kinds = [
        dict(temperature=1.0),
        dict(temperature=1.5),
        dict(temperature=1.5, seed=1),
        dict(temperature=0.8, top_k=5, seed=2),
        dict(temperature=1.2, top_p=0.9),
        dict(temperature=0.0),
        dict(temperature=2.0, seed=99),
    ]
    return [(prompts[(i + offset) % len(prompts)], kinds[(i + offset) % len(kinds)]) for i in range(15)]


def test_same_seed_same_tokens_alone_and_in_batches_of_16():
    _, prompts = setup()
    target = (prompts[0], TARGET)
    (alone,) = run([target])
    assert run([target]) == [alone]  # reproducible across engines

    batch = neighbours(prompts, 0)
    batch.insert(7, target)
    out = run(batch)
    assert len(out) == 16 and out[7] == alone

    # first in another batch, with a twin (same prompt and seed, another id) further back
    batch = [target, *neighbours(prompts, 3)[:13], (prompts[0], TARGET), (prompts[0], dict(temperature=1.5))]
    out = run(batch)
    assert len(out) == 16
    assert out[0] == alone and out[14] == alone
    assert out[15] != alone  # the same prompt unseeded draws something else


def test_different_seeds_give_different_samples():
    _, prompts = setup()
    out = run([(prompts[0], {**TARGET, "seed": s}) for s in range(5)])
    assert len({tuple(t) for t in out}) == 5


def test_generate_batch_seed_kwarg():
    model, prompts = setup()
    same = [prompts[1]] * 3
    a = generate_batch(
        model, same, generation_config=GC, continuous_batching_config=CBC, temperature=1.5, seed=7
    )
    b = generate_batch(
        model, same, generation_config=GC, continuous_batching_config=CBC, temperature=1.5, seed=7
    )
    tokens = [o.generated_tokens for o in a.values()]
    assert tokens == [o.generated_tokens for o in b.values()]
    assert tokens[0] == tokens[1] == tokens[2]  # same prompt, same seed


def test_the_seed_rule_a_call_is_its_groups():
    """`rollout.sampling.seeding`: group i of a call seeded s is seeded group_seed(s, i), group 0 by s itself, so
    a call split into one-prompt calls (what RolloutPool sends) draws the same streams."""
    s, groups, size = 11, 3, 4
    seeds = call_seeds(s, groups, size)
    assert group_seed(s, 0) == s
    for i in range(groups):
        assert seeds[i * size : (i + 1) * size] == call_seeds(group_seed(s, i), 1, size)
        assert seeds[i * size : (i + 1) * size] == [sample_seed(group_seed(s, i), j) for j in range(size)]
    assert len(set(seeds)) == groups * size
    assert not set(seeds) & {group_seed(s, i) for i in range(groups)}  # a group seed is no sample's stream
    assert not set(call_seeds(s + 1, groups, size)) & set(seeds)  # seed s+1 does not replay seed s shifted
    assert call_seeds(s, groups, 2) == [seeds[i * size + j] for i in range(groups) for j in range(2)]  # G-free
    assert all(0 <= x < 2**63 for x in seeds) and call_seeds(None, 2, 2) == [None] * 4


def test_engine_generate_follows_the_seed_rule():
    model, prompts = setup()
    config = ContinuousBatchingConfig(page_size=16, num_blocks=128)
    with RolloutEngine(model, config=config, generation_config=GC) as engine:
        call = engine.generate(prompts[:3], temps=1.5, group_size=3, seed=5)
        split = [
            engine.generate([p], temps=1.5, group_size=3, seed=group_seed(5, i)) for i, p in enumerate(prompts[:3])
        ]
    assert call.completion_ids.tolist() == [row for b in split for row in b.completion_ids.tolist()]
    assert len({tuple(r) for r in call.completion_ids.tolist()}) == 9
