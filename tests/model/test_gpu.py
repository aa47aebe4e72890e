"""GPU-only checks (`pytest -m gpu`; deselected by default, run by benchmarks/device_check.sh on a CUDA device).

What "flex on CUDA", "no host sync per step" and "pinned offload" mean once a GPU is lent.

The `triton` parametrisations (and `use_cuda_graph=True` in the RL loop) were added for issue 40 without a GPU:
prepared, NOT yet run on one.

Run on one H200 on 2026-11-30 (21 passed: benchmarks/logs/gpu/device_check_h200_run2_tests.log), except the
last two, `test_seeded_sampling_on_cuda_is_reproducible_and_scored` and `test_grpo_trainer_colocated_on_cuda`,
written after that session's device time was spent: prepared (their bodies pass on a CPU with the
device checks taken out), NOT yet run on a GPU.
"""

from __future__ import annotations

import pytest
import torch
from support.tiny_models import hf_greedy, make_model, random_prompts, teacher_forced_logprobs
from transformers import GenerationConfig

from rollout import ContinuousBatchingConfig
from rollout.engine.core import EngineCore

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

GREEDY = GenerationConfig(do_sample=False, eos_token_id=None, max_new_tokens=8)


@pytest.mark.parametrize("dtype, atol", [(torch.float32, 2e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("window, softcap", [(None, None), (24, None), (None, 20.0)])
def test_cuda_flex_kernel_matches_dense_reference(window, softcap, dtype, atol):
    """The paged flex kernel alone on CUDA (Triton) against the fp64 reference of test_flex_backend."""
    from test_flex_backend import check_kernel

    torch.backends.cuda.matmul.allow_tf32 = False
    check_kernel(window, softcap, dtype, atol, "cuda")


def run(core: EngineCore, prompts: list[list[int]], n: int):
    reqs = [core.make_request(p, request_id=f"r{i}", max_new_tokens=n) for i, p in enumerate(prompts)]
    for r in reqs:
        core.add(r)
    while core.has_work():
        core.step()
    return reqs


@pytest.mark.parametrize("arch", ["llama", "mistral", "gemma2"])
@pytest.mark.parametrize("backend", ["auto", "flex", "sdpa", "triton"])
def test_cuda_greedy_matches_generate_and_logprobs_match_teacher_forcing(arch, backend):
    if backend == "triton":
        pytest.importorskip("triton", reason="the triton extra is not installed")
    model = make_model(arch).cuda()
    prompts = random_prompts(6, 5, 70, seed=1, shared_prefix=20, n_shared=3)
    cfg = ContinuousBatchingConfig(page_size=16, num_blocks=64, max_batch_tokens=48, return_logprobs=True,
                                   logprobs_mode="raw", attn_backend=backend)
    core = EngineCore(model, GREEDY, cfg)
    assert core.backend.name == ("flex" if backend == "auto" else backend)
    reqs = run(core, prompts, 8)
    for p, r in zip(prompts, reqs, strict=True):
        assert r.generated == hf_greedy(model, p, 8)
        assert r.logprobs == pytest.approx(teacher_forced_logprobs(model, p, r.generated).tolist(), abs=1e-4)


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
        logits, *_ = core.runner.execute(out)
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
    assert stats["offloaded_pages"] > 0 and stats["recomputed_tokens"] == 0
    host = [t for pair in core.cache.offload.host.values() for t in pair]
    assert host and all(t.is_pinned() for t in host)


def test_flash_is_refused_with_a_reason():
    model = make_model("llama").cuda()
    with pytest.raises(ValueError, match="attn_backend='flash'"):
        EngineCore(model, GREEDY, ContinuousBatchingConfig(page_size=16, num_blocks=8, attn_backend="flash"))


@pytest.mark.parametrize("backend,extra", [("flex", {}), ("sdpa", {}), ("triton", {}),
                                           ("triton", {"use_cuda_graph": True})])
def test_rl_loop_on_cuda_update_sleep_wake_close(backend, extra):
    """The RL loop on a CUDA model: rollouts exact (tokens vs `generate`, logprobs vs teacher forcing), an
    AdamW step on the trainer's own parameters then `update_weights` (new weights used), `sleep` gives
    the cache's GPU memory back, `wake` takes it again, and `close` leaves no GPU memory behind."""
    from rollout import RolloutEngine

    torch.backends.cuda.matmul.allow_tf32 = False
    model = make_model("qwen3").cuda()
    prompts = random_prompts(4, 10, 40, seed=5)
    if backend == "triton":
        pytest.importorskip("triton", reason="the triton extra is not installed")
    cfg = ContinuousBatchingConfig(page_size=16, num_blocks=128, attn_backend=backend, **extra)
    gc = GenerationConfig(do_sample=False, eos_token_id=None, max_new_tokens=8)
    torch.cuda.synchronize()
    torch._C._cuda_clearCublasWorkspaces()  # NOTE: torch keeps a cuBLAS workspace per handle (32 MiB on Hopper)
    base = torch.cuda.memory_allocated()

    def check(engine) -> None:
        batch = engine.generate(prompts, temps=0.0, max_new_tokens=8)
        for i, p in enumerate(prompts):
            got = batch.completion_ids[i][batch.completion_mask[i].bool()].tolist()
            assert got == hf_greedy(model, p, 8)
            want = teacher_forced_logprobs(model, p, got).tolist()
            assert batch.logprobs[i][: len(got)].tolist() == pytest.approx(want, abs=1e-4)

    engine = RolloutEngine(model, config=cfg, generation_config=gc)
    try:
        check(engine)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        model.train()
        ids = torch.tensor([prompts[0]], device="cuda")
        model(ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        model.eval()
        engine.update_weights(model)
        check(engine)  # NOTE: the oracle runs the updated model
        held = engine.cache_stats()["kv_bytes"]
        before = torch.cuda.memory_allocated()
        assert engine.sleep() == held > 0
        torch.cuda.synchronize()
        assert before - torch.cuda.memory_allocated() >= held
        assert engine.wake() == held
        check(engine)
    finally:
        engine.close()
    del opt
    model.zero_grad(set_to_none=True)
    import gc as _gc

    _gc.collect()
    torch.cuda.synchronize()
    # NOTE: the engine thread's cuBLAS handle goes back to torch's pool with its workspace (first run
    # on the device: +32 MiB, seen); that is torch's cache, not the engine's
    torch._C._cuda_clearCublasWorkspaces()
    # NOTE: what is left is the model's own (its parameters, AdamW's state freed above)
    assert torch.cuda.memory_allocated() <= base + 1024, torch.cuda.memory_allocated() - base


def test_seeded_sampling_on_cuda_is_reproducible_and_scored():
    """Sampling on CUDA (per-request generators on the device): a seed reproduces the call, another seed
    differs, every sampled token's logprob is the temperature-scaled log-softmax of teacher forcing."""
    from rollout import RolloutEngine

    torch.backends.cuda.matmul.allow_tf32 = False
    model = make_model("llama").cuda()
    prompts = random_prompts(3, 10, 30, seed=7)
    cfg = ContinuousBatchingConfig(page_size=16, num_blocks=128)
    gc = GenerationConfig(do_sample=True, eos_token_id=None, max_new_tokens=8, top_k=0, top_p=1.0)
    with RolloutEngine(model, config=cfg, generation_config=gc) as engine:
        a = engine.generate(prompts, temps=0.8, group_size=4, seed=11)
        b = engine.generate(prompts, temps=0.8, group_size=4, seed=11)
        c = engine.generate(prompts, temps=0.8, group_size=4, seed=12)
        assert a.completion_ids.is_cuda and torch.equal(a.completion_ids, b.completion_ids)
        assert not torch.equal(a.completion_ids, c.completion_ids)
        for row in range(len(a)):
            p = prompts[int(a.group_ids[row])]
            got = a.completion_ids[row][a.completion_mask[row].bool()].tolist()
            want = teacher_forced_logprobs(model, p, got, 0.8).tolist()
            assert a.logprobs[row][: len(got)].tolist() == pytest.approx(want, abs=1e-4)


def test_grpo_trainer_colocated_on_cuda(tmp_path):
    """The GRPO loop on one GPU (accelerate places the policy there): the engine shares the device, so
    it sleeps around each update by default; after two steps the engine's logprobs still equal the
    trainer's own recomputation (the weights reached the engine), and closing frees the engine's cache."""
    from test_grpo import engine_vs_trainer, small_trainer

    from trainers.tasks import AdditionTask, make_addition_tokenizer

    torch.backends.cuda.matmul.allow_tf32 = False
    tokenizer = make_addition_tokenizer()
    dataset = AdditionTask(num_digits=3, seed=0).to_dataset(64)
    trainer = small_trainer(tokenizer, dataset, tmp_path, algorithm="dapo", max_resample_rounds=1, beta=0.05)
    try:
        assert trainer.engine.device.type == "cuda" and trainer.sleeps is True
        for _ in range(2):
            metrics = trainer.step()
            assert all(v == v for v in metrics.values() if isinstance(v, float))  # NOTE: no NaN
        assert trainer.engine.cache_stats()["kv_bytes"] > 0  # awake again after the update
        assert engine_vs_trainer(trainer, tokenizer) < 1e-4
    finally:
        trainer.close()
