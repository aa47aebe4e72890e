"""The static decode step (`rollout.model.static_decode`) and the guide's compile configs.

`ContinuousBatchingConfig(decode_compile_config=CompileConfig(fullgraph=True, dynamic=False))` runs decode-only
steps through persistent buffers, rows padded to buckets (1, 2, 4, 8, then multiples of 8), and compiles one
graph per bucket: on Qwen3, Llama and Gemma 2 (two layer groups: sliding and full), for a batch that drifts
from 40 rows down to 1 (requests of staggered lengths finish one by one; Llama and Gemma 2 from 3 in the default
suite, 40 in the `slow` one): no graph break, no fallback to eager,
exactly one graph per bucket met, none compiled again when the same engine reruns the workload; greedy tokens
and seeded samples identical to the eager engine's, raw logprobs within 1e-5. The default suite compiles with
dynamo's `aot_eager` backend (the graph capture: 6-15 s a bucket on 2 busy cores); the `slow` twin uses
inductor (the config's default, ~40 s a bucket there).

Also: a step reads nothing back from the device (`support.host_reads`) but the sampler's one copy of tokens
and logprobs; padded rows write into the null page, outside the pool; requests wider than
`max_blocks_per_request` run the general path; `max_blocks_per_request=0` turns static decode off.
"""

from __future__ import annotations

import logging

import pytest
from support.host_reads import HostReads
from support.tiny_models import make_model, random_prompts
from torch._dynamo.utils import counters
from transformers import CompileConfig, GenerationConfig

from rollout import ContinuousBatchingConfig
from rollout.engine.core import EngineCore
from rollout.model.static_decode import bucket

SAMPLE = GenerationConfig(do_sample=True, temperature=1.0, top_k=0, eos_token_id=None)
BASE = dict(page_size=16, num_blocks=160, max_batch_tokens=256, return_logprobs=True, logprobs_mode="raw")


def submit(core: EngineCore, rows: int, seed: int = 1) -> list:
    """`rows` requests finishing one step apart (the batch drifts from `rows` down to 1): every third greedy,
    the others seeded samples at temperature 0.9, some with top-k."""
    prompts = random_prompts(rows, 5, 20, seed=seed)
    reqs = []
    for i, p in enumerate(prompts):
        sampled = i % 3 != 0
        reqs.append(core.make_request(p, request_id=f"r{i}", max_new_tokens=2 + i, temperature=0.9 if sampled else 0.0,
                                      seed=100 + i if sampled else None, top_k=8 if i % 3 == 2 else None))
    for r in reqs:
        core.add(r)
    return reqs


def drive(core: EngineCore, rows: int) -> tuple[list, list]:
    reqs = submit(core, rows)
    while core.has_work():
        core.step()
    return [r.generated for r in reqs], [r.logprobs for r in reqs]


def graphs() -> tuple[int, int]:
    return counters["stats"].get("unique_graphs", 0), sum(counters["graph_break"].values())


def check_compiled(arch: str, rows: int, backend: str) -> None:
    model = make_model(arch)
    want, want_lp = drive(EngineCore(model, SAMPLE, ContinuousBatchingConfig(**BASE)), rows)
    config = CompileConfig(fullgraph=True, dynamic=False, backend=backend)
    core = EngineCore(model, SAMPLE, ContinuousBatchingConfig(**BASE, decode_compile_config=config))
    static = core.runner.static
    graphs0, breaks0 = graphs()
    got, got_lp = drive(core, rows)
    assert got == want, f"{arch}: static decode tokens differ from the eager engine's"
    for a, b in zip(got_lp, want_lp, strict=True):
        assert a == pytest.approx(b, abs=1e-5)
    met = sorted(static.buckets)
    assert met == sorted({bucket(n) for n in range(1, rows + 1)}), met
    assert static.eager_fallbacks == 0
    graphs1, breaks1 = graphs()
    assert breaks1 == breaks0, "the decode step has a graph break"
    assert graphs1 - graphs0 == len(met), "one graph per bucket"
    assert static.steps >= rows - 1, "most decode steps should be static"
    steps = static.steps
    again, again_lp = drive(core, rows)  # NOTE: prompts now hit the prefix cache: other chunks, same tokens
    assert again == got, "a rerun of the same seeded workload should repeat its tokens"
    for a, b in zip(again_lp, got_lp, strict=True):
        assert a == pytest.approx(b, abs=1e-5)
    assert graphs() == (graphs1, breaks1), "the rerun compiled again"
    assert static.steps == 2 * steps


def test_buckets():
    assert [bucket(n) for n in (1, 2, 3, 4, 5, 8, 9, 16, 17, 40, 41)] == [1, 2, 4, 4, 8, 8, 16, 16, 24, 40, 48]
    with pytest.raises(ValueError, match="at least one row"):
        bucket(0)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("arch,rows", [("qwen3", 40), ("llama", 3), ("gemma2", 3)])
def test_decode_compile_config_compiles_one_graph_per_bucket(arch, rows):
    check_compiled(arch, rows, "aot_eager")


@pytest.mark.slow
@pytest.mark.timeout(1800)
@pytest.mark.parametrize("arch", ["qwen3", "llama", "gemma2"])
def test_decode_compile_config_with_inductor(arch):
    check_compiled(arch, 40, "inductor")


def eager_static(model, **extra) -> EngineCore:
    """An engine whose decode steps are static but run eagerly (the buffers and the op, without dynamo)."""
    core = EngineCore(model, SAMPLE, ContinuousBatchingConfig(**BASE, decode_compile_config=CompileConfig(), **extra))
    core.runner.static.compile_kwargs = None
    return core


@pytest.mark.parametrize("arch", ["qwen3", "gemma2"])
def test_a_decode_step_reads_nothing_back_but_its_tokens(arch):
    """Under `HostReads` (every `.item()`, `.tolist()`, `nonzero`, Python branch on a tensor...): the runner's
    static step reads nothing; the whole engine step reads once, the sampler's copy of tokens and logprobs."""
    core = eager_static(make_model(arch))
    submit(core, 6)
    while not core.scheduler.running or any(r.num_computed_tokens < len(r.token_ids) - 1
                                            for r in core.scheduler.running):
        core.step()  # NOTE: prefill, until every row decodes
    core.step()  # NOTE: the first decode-only step (the general path checks our attention ran in every layer)
    steps = core.runner.static.steps
    execute = core.runner.execute
    # NOTE: the compiled forward's step handle is a CPU scalar on every device (its op finds the step's metadata by it)
    host = (core.runner.forward.step,)
    for _ in range(3):
        with HostReads(host) as reads:
            in_execute = []

            def guarded(out, reads=reads, in_execute=in_execute):
                assert out.decode_only
                before = len(reads.found)
                result = execute(out)
                in_execute.extend(reads.found[before:])
                return result

            core.runner.execute = guarded
            core.step()
        assert in_execute == [], f"the static step read the device: {in_execute}"
        assert [what for what, _ in reads.found] == ["Tensor.tolist"], reads.found
        assert reads.found[0][1].startswith("sampling/sampler.py")
    assert core.runner.static.steps == steps + 3


def test_padded_rows_write_the_null_page_outside_the_pool():
    core = eager_static(make_model("qwen3"))
    null = core.runner.static.null_page
    assert null == core.cache.num_pages - 1 == core.page_pool.num_pages, "the pool must not hand out the null page"
    drive(core, 5)  # NOTE: 5 rows pad to 8, then 3 to 4
    k = next(iter(core.cache.keys.values()))  # [Hkv, slots, D] of the first storage
    ps = core.page_size
    assert k[:, null * ps].abs().sum() > 0, "padded rows should have written their K into the null page"


def test_wide_requests_take_the_general_path_and_zero_turns_it_off(caplog):
    model = make_model("llama")
    want, want_lp = drive(EngineCore(model, SAMPLE, ContinuousBatchingConfig(**BASE)), 6)
    wide = eager_static(model)
    narrow = eager_static(model, max_blocks_per_request=1)  # NOTE: one page of 16: rows past 16 tokens are too wide
    for core in (wide, narrow):
        got, got_lp = drive(core, 6)
        assert got == want
        for a, b in zip(got_lp, want_lp, strict=True):
            assert a == pytest.approx(b, abs=1e-5)
    assert wide.runner.static.max_pages == 1024 // 16, "by default the model's context in pages"
    assert 0 < narrow.runner.static.steps < wide.runner.static.steps, "wide rows should run the general path"
    off = EngineCore(model, SAMPLE, ContinuousBatchingConfig(**BASE, decode_compile_config=CompileConfig(),
                                                             max_blocks_per_request=0))
    assert off.runner.static is None and off.cache.num_pages == off.page_pool.num_pages
    with caplog.at_level(logging.WARNING, logger="rollout"):
        sdpa = EngineCore(model, SAMPLE, ContinuousBatchingConfig(**BASE, decode_compile_config=CompileConfig(),
                                                                  attn_backend="sdpa"))
    assert sdpa.runner.static is None
    assert any("no in-place decode kernel" in r.getMessage() for r in caplog.records)


def test_a_compile_config_that_is_not_one_is_a_value_error_naming_the_field():
    model = make_model("llama")
    with pytest.raises(ValueError, match="decode_compile_config must be a transformers CompileConfig"):
        EngineCore(model, SAMPLE, ContinuousBatchingConfig(**BASE, decode_compile_config=object()))
    with pytest.raises(ValueError, match="varlen_compile_config must be a transformers CompileConfig"):
        EngineCore(model, SAMPLE, ContinuousBatchingConfig(**BASE, varlen_compile_config={"fullgraph": True}))
