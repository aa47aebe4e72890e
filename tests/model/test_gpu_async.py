"""GPU-only checks of issue 61 (`pytest -m gpu`; run by benchmarks/device_check.sh on a CUDA device).

Prepared without a GPU (their CPU counterparts pass: tests/sampling/test_counter_seed.py,
tests/engine/test_async_batching.py), NOT yet run on one:
- the counter-based generator on CUDA (the Triton launch and the torch ops) gives the CPU's words bit for bit,
  its noise within two fp32 ulps, and a seeded fp32 run on CUDA samples the CPU run's tokens;
- `use_async_batching=True` with `use_cuda_graph=True` (static decode steps captured in CUDA graphs, the hand-off
  written on the device, one pinned copy a step) gives the synchronous engine's tokens and logprobs, overlaps
  its steps, and a steady overlapped step runs under `set_sync_debug_mode("error")` (no host sync but the
  previous step's event).
"""

from __future__ import annotations

import pytest
import torch
from support.tiny_models import make_model, random_prompts
from transformers import GenerationConfig

from rollout import ContinuousBatchingConfig
from rollout.engine.core import EngineCore
from rollout.kernels.philox import counter_words, exponential_from_words

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

SAMPLE = GenerationConfig(do_sample=True, temperature=1.0, top_k=0, eos_token_id=None)
SEEDS, POSITIONS = [0, 1, 2**63 - 1, 123456789123, (1 << 64) - 1], [0, 5, 2**32 + 3, 77, 1]


def test_counter_words_on_cuda_are_the_cpu_words():
    cpu = counter_words(SEEDS, POSITIONS, 151936, "cpu")
    assert torch.equal(counter_words(SEEDS, POSITIONS, 151936, "cuda").cpu(), cpu)  # NOTE: the torch ops
    pytest.importorskip("triton", reason="the triton extra is not installed")
    from rollout.kernels import triton_sampling

    assert torch.equal(triton_sampling.counter_words(SEEDS, POSITIONS, 151936, "cuda").cpu(), cpu)
    noise = triton_sampling.counter_exponential(SEEDS, POSITIONS, 151936, "cuda").cpu()
    ulps = (noise.view(torch.int32).long() - exponential_from_words(cpu).view(torch.int32).long()).abs()
    assert int(ulps.max()) <= 2


def run(core: EngineCore, stops=None, new=12):
    prompts = random_prompts(12, 5, 60, seed=4)
    reqs = [core.make_request(p, request_id=f"r{i}", max_new_tokens=new + i, temperature=0.0 if i % 3 == 0 else 0.9,
                              seed=None if i % 3 == 0 else 40 + i, eos_token_ids=stops if i % 2 else None)
            for i, p in enumerate(prompts)]
    for r in reqs:
        core.add(r)
    while core.has_work():
        core.step()
    return [(r.generated, r.finish_reason) for r in reqs], [r.logprobs for r in reqs]


def test_counter_seeded_tokens_on_cuda_are_the_cpu_tokens():
    torch.backends.cuda.matmul.allow_tf32 = False
    model = make_model("llama")
    cfg = ContinuousBatchingConfig(page_size=16, num_blocks=64, return_logprobs=True, seed_stream="counter")
    cpu, cpu_lp = run(EngineCore(model, SAMPLE, cfg))
    gpu, gpu_lp = run(EngineCore(model.cuda(), SAMPLE, cfg))
    assert gpu == cpu
    for a, b in zip(gpu_lp, cpu_lp, strict=True):
        assert a == pytest.approx(b, abs=1e-4)


@pytest.mark.parametrize("backend", ["triton", "flex"])
def test_async_batching_on_cuda_gives_the_synchronous_outputs(backend):
    if backend == "triton":
        pytest.importorskip("triton", reason="the triton extra is not installed")
    torch.backends.cuda.matmul.allow_tf32 = False
    model = make_model("qwen3").cuda()
    base = dict(page_size=16, num_blocks=96, return_logprobs=True, attn_backend=backend, use_cuda_graph=True)
    want, want_lp = run(EngineCore(model, SAMPLE, ContinuousBatchingConfig(**base)), stops=[5, 9])
    core = EngineCore(model, SAMPLE, ContinuousBatchingConfig(**base, use_async_batching=True))
    assert core.pipeline is not None
    got, got_lp = run(core, stops=[5, 9])
    assert got == want
    for a, b in zip(got_lp, want_lp, strict=True):
        assert a == pytest.approx(b, abs=1e-5)
    assert core.pipeline.overlapped > 5


def test_a_steady_overlapped_step_never_synchronises():
    pytest.importorskip("triton", reason="the triton extra is not installed")
    model = make_model("qwen3").cuda()
    core = EngineCore(model, SAMPLE, ContinuousBatchingConfig(page_size=16, num_blocks=96, attn_backend="triton",
                                                              use_cuda_graph=True, use_async_batching=True))
    for i, p in enumerate(random_prompts(8, 5, 30, seed=2)):
        core.add(core.make_request(p, request_id=f"r{i}", max_new_tokens=40, temperature=0.9, seed=i))
    for _ in range(8):  # NOTE: prefill, then the bucket's warm-up and capture
        core.step()
    overlapped = core.pipeline.overlapped
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(4):
            core.step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert core.pipeline.overlapped == overlapped + 4
    assert core.runner.static is not None and core.runner.static.replays > 0
    while core.has_work():
        core.step()
