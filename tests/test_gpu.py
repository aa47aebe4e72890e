"""GPU-only checks (`pytest -m gpu`; deselected by default, run by benchmarks/device_check.sh on a CUDA device).

Prepared on a CPU-only machine and NOT yet run: they are what "flex on CUDA", "no host sync per
step" and "pinned offload" mean once a GPU is lent.
"""

from __future__ import annotations

import pytest
import torch
from tiny_models import hf_greedy, make_model, random_prompts, teacher_forced_logits
from transformers import GenerationConfig

from rollout import ContinuousBatchingConfig
from rollout.core import EngineCore

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

GREEDY = GenerationConfig(do_sample=False, eos_token_id=None, max_new_tokens=8)


def run(core: EngineCore, prompts: list[list[int]], n: int):
    reqs = [core.make_request(p, request_id=f"r{i}", max_new_tokens=n) for i, p in enumerate(prompts)]
    for r in reqs:
        core.add(r)
    while core.has_work():
        core.step()
    return reqs


@pytest.mark.parametrize("arch", ["llama", "mistral", "gemma2"])
@pytest.mark.parametrize("backend", ["auto", "flex", "sdpa"])
def test_cuda_greedy_matches_generate_and_logprobs_match_teacher_forcing(arch, backend):
    model = make_model(arch).cuda()
    prompts = random_prompts(6, 5, 70, seed=1, shared_prefix=20, n_shared=3)
    cfg = ContinuousBatchingConfig(page_size=16, num_blocks=64, max_batch_tokens=48, return_logprobs=True,
                                   logprobs_mode="raw", attn_backend=backend)
    core = EngineCore(model, GREEDY, cfg)
    assert core.backend.name == ("flex" if backend == "auto" else backend)
    reqs = run(core, prompts, 8)
    for p, r in zip(prompts, reqs, strict=True):
        assert r.generated == hf_greedy(model, p, 8)
        ref = teacher_forced_logits(model, p, r.generated).log_softmax(-1)
        want = ref[torch.arange(len(r.generated)), torch.tensor(r.generated, device=ref.device)].tolist()
        assert r.logprobs == pytest.approx(want, abs=1e-4)


def test_flex_step_runs_without_host_synchronisation():
    """Everything up to the logits of a flex step (metadata, every layer's compiled attention) runs
    under `set_sync_debug_mode("error")`: the sampled tokens are the step's only sync."""
    model = make_model("llama").cuda()
    core = EngineCore(model, GREEDY, ContinuousBatchingConfig(page_size=16, num_blocks=64, max_batch_tokens=48,
                                                              attn_backend="flex"))
    for i, p in enumerate(random_prompts(4, 20, 60, seed=2)):
        core.add(core.make_request(p, request_id=f"r{i}", max_new_tokens=6))
    core.step()
    core.step()  # NOTE: compiles outside the checked region
    out = core.scheduler.schedule()
    torch.cuda.set_sync_debug_mode("error")
    try:
        logits, _ = core.runner.execute(out)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert logits.is_cuda and torch.isfinite(logits).all()


@pytest.mark.parametrize("backend", ["flex", "sdpa"])
def test_pinned_offload_under_pressure_is_exact(backend):
    model = make_model("qwen3").cuda()
    prompts = random_prompts(8, 20, 60, seed=3)
    cfg = ContinuousBatchingConfig(page_size=16, num_blocks=12, max_batch_tokens=64, cpu_offload_space=0.25,
                                   attn_backend=backend)
    core = EngineCore(model, GREEDY, cfg)
    reqs = run(core, prompts, 24)
    assert [r.generated for r in reqs] == [hf_greedy(model, p, 24) for p in prompts]
    stats = core.cache_stats()
    assert stats["offloaded_blocks"] > 0 and stats["recomputed_tokens"] == 0
    host = [t for pair in core.cache.offload.host.values() for t in pair]
    assert host and all(t.is_pinned() for t in host)


def test_flash_is_refused_with_a_reason():
    model = make_model("llama").cuda()
    with pytest.raises(ValueError, match="attn_backend='flash'"):
        EngineCore(model, GREEDY, ContinuousBatchingConfig(page_size=16, num_blocks=8, attn_backend="flash"))
