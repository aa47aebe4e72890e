"""Memory under pressure, end to end on tiny models: every output token-identical to `model.generate`.

- preemption by recompute on a cache far smaller than the workload;
- the same workload with CPU offload: preempted requests resume without recomputing anything;
- sliding windows: a pure-sliding model (Mistral) generates 300 tokens on a 6-page cache, and a
  hybrid one (Gemma 2: alternating sliding / full layers) recycles its sliding group's pages, with
  and without memory pressure;
- honest sizing: the default config grows the process RSS by little for a tiny model;
- requests larger than the cache are refused at submission, or fail alone, never crash the loop.
"""

from __future__ import annotations

import functools

import psutil
import pytest
import torch
from support.tiny_models import VOCAB, hf_greedy, make_model, random_prompts
from transformers import GenerationConfig

from rollout import ContinuousBatchingConfig, RequestStatus
from rollout.engine.core import EngineCore
from rollout.requests import Request, SamplingParams

GREEDY = GenerationConfig(do_sample=False, eos_token_id=None)
PS = 16


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny models gain nothing from intra-op threads, and on a busy 2-core machine their spinning
    makes each forward several times slower; restore the setting for the other test modules."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def run(model, prompts: list[list[int]], max_new: list[int] | int, cfg: ContinuousBatchingConfig):
    """Drive an `EngineCore` to completion; returns (generated tokens per prompt, cache_stats, core)."""
    core = EngineCore(model, GREEDY, cfg)
    news = [max_new] * len(prompts) if isinstance(max_new, int) else max_new
    reqs = [
        core.make_request(p, request_id=f"r{i}", max_new_tokens=n)
        for i, (p, n) in enumerate(zip(prompts, news, strict=True))
    ]
    for r in reqs:
        core.add(r)
    while core.has_work():
        core.step()
        core.page_pool.check_invariants()
    assert all(r.status == RequestStatus.FINISHED for r in reqs), [(r.status, r.error) for r in reqs]
    return [r.generated for r in reqs], core.cache_stats(), core


# ------------------------------------------------------------------ full attention under pressure
# 12 requests of 48..110 tokens (prompt + generation) = ~960 tokens of KV, on 24 pages of 16 (384).
PRESSURE_PROMPTS = random_prompts(12, 18, 50, seed=7)
PRESSURE_NEW = [110 - len(p) if i % 2 else 30 for i, p in enumerate(PRESSURE_PROMPTS)]


@functools.cache
def pressure_reference():
    model = make_model("qwen3")
    return model, [hf_greedy(model, p, n) for p, n in zip(PRESSURE_PROMPTS, PRESSURE_NEW, strict=True)]


def test_preemption_by_recompute_is_exact():
    model, ref = pressure_reference()
    out, stats, _ = run(model, PRESSURE_PROMPTS, PRESSURE_NEW, ContinuousBatchingConfig(page_size=PS, num_blocks=24))
    print(f"\nrecompute: preemptions={stats['preemptions']} recomputed_tokens={stats['recomputed_tokens']}")
    assert out == ref
    assert stats["preemptions"] > 0
    assert stats["recomputed_tokens"] > 0  # what lay below the high-water mark was computed again
    assert stats["offloaded_pages"] == 0
    assert stats["free_blocks"] == 24


@pytest.mark.parametrize("backend", ["auto", "sdpa", "flex"])
def test_cpu_offload_resumes_without_recompute(backend):
    model, ref = pressure_reference()
    cfg = ContinuousBatchingConfig(page_size=PS, num_blocks=24, cpu_offload_space=0.25, attn_backend=backend)
    out, stats, core = run(model, PRESSURE_PROMPTS, PRESSURE_NEW, cfg)
    print(f"\noffload: preemptions={stats['preemptions']} offloaded_pages={stats['offloaded_pages']} "
          f"restored_pages={stats['restored_pages']}")
    assert out == ref
    assert stats["preemptions"] > 0 and stats["offloaded_pages"] > 0
    assert stats["recomputed_tokens"] == 0 and stats["offload_fallbacks"] == 0
    # every page that went out came back, and every host slot is free again
    assert stats["restored_pages"] == stats["offloaded_pages"]
    assert stats["offload_free_pages"] == core.cache.offload.num_pages
    assert stats["free_blocks"] == 24


def test_full_offload_buffer_falls_back_to_recompute():
    model, ref = pressure_reference()
    core = EngineCore(model, GREEDY, ContinuousBatchingConfig(page_size=PS, num_blocks=24, cpu_offload_space=0.25))
    pages_per_gib = core.cache.offload.num_pages / 0.25
    # room for 4 pages only: most preemptions find the buffer full
    cfg = ContinuousBatchingConfig(page_size=PS, num_blocks=24, cpu_offload_space=4.5 / pages_per_gib)
    out, stats, core = run(model, PRESSURE_PROMPTS, PRESSURE_NEW, cfg)
    assert core.cache.offload.num_pages == 4
    assert out == ref
    assert stats["offload_fallbacks"] > 0 and stats["recomputed_tokens"] > 0
    assert stats["restored_pages"] == stats["offloaded_pages"]
    assert stats["offload_free_pages"] == 4


# ------------------------------------------------------------------------------ sliding windows


def test_mistral_sliding_window_generates_300_tokens_on_six_pages():
    model = make_model("mistral", sliding_window=24)
    prompt = random_prompts(1, 40, 40, seed=3)[0]
    out, stats, _ = run(model, [prompt], 300, ContinuousBatchingConfig(page_size=PS, num_blocks=6))
    print(f"\nmistral: 340 tokens on {stats['peak_used_pages']} pages at most, "
          f"{stats['recycled_pages']} pages recycled")
    assert out == [hf_greedy(model, prompt, 300)]
    # window 24 -> a query and its 23 past keys span at most 3 pages of 16
    assert stats["peak_used_pages"] <= 3
    assert stats["recycled_pages"] >= 340 // PS - 3
    assert stats["preemptions"] == 0 and stats["free_blocks"] == 6


@functools.cache
def gemma_reference():
    model = make_model("gemma2")  # 4 layers, alternating sliding (window 16) and full
    prompts = random_prompts(5, 12, 40, seed=11)
    return model, prompts, [hf_greedy(model, p, 50) for p in prompts]


def test_gemma2_hybrid_is_exact_and_its_sliding_group_recycles():
    model, prompts, ref = gemma_reference()
    out, stats, core = run(
        model, prompts, 50, ContinuousBatchingConfig(page_size=PS, num_blocks=64, max_batch_tokens=48)
    )
    assert core.windows == [None, 16]
    assert out == ref
    assert stats["preemptions"] == 0
    assert stats["recycled_pages"] > 0
    # full layers keep every page, the sliding group at most 2 per request (window 16 spans 2 pages)
    assert stats["peak_used_pages"] <= sum(-(-(len(p) + 50) // PS) + 2 for p in prompts)


@pytest.mark.parametrize("offload, backend", [(0.0, "auto"), (0.25, "auto"), (0.25, "sdpa"), (0.25, "flex")])
def test_gemma2_under_pressure_is_exact(offload, backend):
    model, prompts, ref = gemma_reference()
    cfg = ContinuousBatchingConfig(page_size=PS, num_blocks=14, max_batch_tokens=48, cpu_offload_space=offload,
                                   attn_backend=backend)
    out, stats, _ = run(model, prompts, 50, cfg)
    assert out == ref
    assert stats["preemptions"] > 0
    if offload:
        assert stats["offloaded_pages"] > 0 and stats["recomputed_tokens"] == 0
        assert stats["restored_pages"] == stats["offloaded_pages"]


@pytest.mark.parametrize("backend", ["auto", pytest.param("sdpa", marks=pytest.mark.slow),
                                     pytest.param("flex", marks=pytest.mark.slow)])
def test_mistral_many_requests_with_offload_is_exact(backend):
    model = make_model("mistral", sliding_window=24)
    prompts = random_prompts(4, 20, 60, seed=5)
    ref = [hf_greedy(model, p, 40) for p in prompts]
    cfg = ContinuousBatchingConfig(page_size=PS, num_blocks=7, max_batch_tokens=64, cpu_offload_space=0.25,
                                   attn_backend=backend)
    out, stats, _ = run(model, prompts, 40, cfg)
    assert out == ref
    assert stats["preemptions"] > 0 and stats["offloaded_pages"] > 0 and stats["recomputed_tokens"] == 0


# ------------------------------------------------------------------------------------- sizing


def test_default_config_grows_rss_by_little():
    model = make_model("qwen3")
    prompts = random_prompts(8, 10, 60, seed=2)
    proc = psutil.Process()
    before = proc.memory_info().rss
    out, stats, core = run(model, prompts, 40, ContinuousBatchingConfig())
    grown = proc.memory_info().rss - before
    print(f"\ndefault config: {stats['num_blocks']} pages of {stats['page_size']} "
          f"({stats['kv_bytes'] / 2**20:.0f} MiB reserved, lazily touched), max_batch_tokens="
          f"{stats['max_batch_tokens']}; RSS grew by {grown / 2**20:.1f} MiB")
    assert out == [hf_greedy(model, p, 40) for p in prompts]
    assert 256 <= stats["max_batch_tokens"] <= 8192
    assert grown < 1 << 30  # the CPU cache budget is min(5% of available RAM, 1 GiB)


# --------------------------------------------------------------------------- too big for the cache


def test_requests_larger_than_the_cache_are_refused_or_fail_alone():
    full = EngineCore(make_model("qwen3"), GREEDY, ContinuousBatchingConfig(page_size=PS, num_blocks=4))
    with pytest.raises(ValueError, match="KV pages"):
        full.make_request(list(range(1, 60)), max_new_tokens=10)  # 69 tokens > 64
    # one that slipped past submission fails alone with an error; the others finish
    big = Request("big", list(range(1, 70)), 10, SamplingParams(temperature=0.0))
    small = full.make_request([1, 2, 3], request_id="small", max_new_tokens=3)
    full.add(big)
    full.add(small)
    for _ in range(20):
        if not full.has_work():
            break
        full.step()
    assert big.status == RequestStatus.FAILED and "KV pages" in big.error
    assert small.status == RequestStatus.FINISHED and len(small.generated) == 3
    assert full.cache_stats()["free_blocks"] == 4


def test_sliding_only_bound_is_the_window_not_the_length():
    model = make_model("mistral", sliding_window=24)
    core = EngineCore(model, GREEDY, ContinuousBatchingConfig(page_size=PS, num_blocks=3))
    core.make_request([1] * 100, max_new_tokens=500)  # 600 tokens, but only 3 pages live at once
    small = EngineCore(model, GREEDY, ContinuousBatchingConfig(page_size=PS, num_blocks=2))
    with pytest.raises(ValueError, match="KV pages"):
        small.make_request([1] * 100, max_new_tokens=5)
    # a long prompt on a tiny sliding cache is prefilled in chunks that fit
    prompt = torch.randint(1, VOCAB, (100,), generator=torch.Generator().manual_seed(0)).tolist()
    out, stats, _ = run(model, [prompt], 5, ContinuousBatchingConfig(page_size=PS, num_blocks=3))
    assert out == [hf_greedy(model, prompt, 5)]
    assert stats["peak_used_pages"] <= 3


@pytest.mark.slow
def test_random_memory_pressure_workloads_are_exact():
    """Random architectures, page sizes, budgets, policies, offload, prefix sharing and caches just
    big enough for the largest request: outputs exact, every page back in the pool."""
    import random

    rng = random.Random(0)
    models = {"qwen3": make_model("qwen3"), "mistral": make_model("mistral", sliding_window=20),
              "gemma2": make_model("gemma2"), "gpt2": make_model("gpt2")}
    for _ in range(24):
        arch = rng.choice(list(models))
        n = rng.randint(2, 7)
        prompts = random_prompts(n, 3, 50, seed=rng.randint(0, 5), shared_prefix=20, n_shared=rng.randint(0, n))
        news = [rng.randint(1, 60) for _ in prompts]
        kw = dict(page_size=rng.choice([4, 8, 16]), max_batch_tokens=rng.choice([8, 16, 48, 256]),
                  scheduler_type=rng.choice(["fifo", "prefill_first"]), cpu_offload_space=rng.choice([0.0, 0.01]),
                  allow_block_sharing=rng.choice([True, False]))
        probe = EngineCore(models[arch], GREEDY, ContinuousBatchingConfig(num_blocks=10_000, **kw))
        need = max(probe.scheduler.max_pages(len(p) + k) for p, k in zip(prompts, news, strict=True))
        cfg = ContinuousBatchingConfig(num_blocks=need + rng.randint(0, need), **kw)
        out, stats, _ = run(models[arch], prompts, news, cfg)
        assert out == [hf_greedy(models[arch], p, k) for p, k in zip(prompts, news, strict=True)], (arch, cfg)
        assert stats["free_blocks"] == cfg.num_blocks
        assert stats["restored_pages"] == stats["offloaded_pages"]
