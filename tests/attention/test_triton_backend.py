"""The `triton` attention backend (`rollout.attention.backends.triton`) in the engine.

On a CPU the kernels (decode rows, and prompt chunks through the varlen kernel) run under Triton's interpreter
(`support.triton_interpreter`), on a CUDA machine compiled: greedy tokens equal `model.generate` and raw logprobs equal
teacher forcing on the correctness workload (chunked prefill, prefix-cache hits, prompt chunks mixed with decode rows),
on RoPE + GQA (Qwen3), a sliding window (Mistral), logit softcap (Gemma 2) and attention sinks (gpt-oss). It is chosen
by name only; without triton, or on a CPU outside the interpreter, the name is a ValueError saying why.
Skipped with the reason without triton.
"""

from __future__ import annotations

import copy
import sys

import pytest
import torch
from support.greedy import BUDGET, PS, run_engine
from support.tiny_models import hf_greedy, make_model, random_prompts, teacher_forced_logprobs
from support.triton_interpreter import device, load
from transformers import GenerationConfig

from rollout import ContinuousBatchingConfig
from rollout.attention import backends
from rollout.attention.backends.triton import TritonBackend
from rollout.engine.core import EngineCore

pytestmark = [pytest.mark.triton, pytest.mark.timeout(180)]
GREEDY = GenerationConfig(do_sample=False, eos_token_id=None)


@pytest.fixture(scope="module")
def kernel_module():
    return load()


@pytest.mark.parametrize("arch", ["qwen3", "mistral", "gemma2", "gpt_oss"])
def test_greedy_and_logprobs_match_the_oracles(kernel_module, arch):
    model = make_model(arch).to(device())
    # NOTE: 2 of 4 prompts share a 20-token prefix (prefix-cache hits where the model has no window); the longest
    # is prefilled in chunks of the 48-token budget, beside other rows' decodes
    prompts = random_prompts(4, 5, 64, seed=2, shared_prefix=20, n_shared=2)
    cfg = ContinuousBatchingConfig(page_size=PS, num_blocks=64, max_batch_tokens=BUDGET, return_logprobs=True,
                                   logprobs_mode="raw", attn_backend="triton")
    core = EngineCore(model, GREEDY, cfg)
    assert type(core.backend) is TritonBackend
    calls = []
    kernel = core.backend.kernel

    def counting(q, *args):
        calls.append(q.shape[0])
        return kernel(q, *args)

    core.backend.kernel = counting
    chunks = []
    prefill = core.backend.prefill_kernel

    def counting_prefill(q, k, v, table, row, q_start, pos_start, lens, *args):
        chunks.extend(lens)
        return prefill(q, k, v, table, row, q_start, pos_start, lens, *args)

    core.backend.prefill_kernel = counting_prefill
    reqs, _, step_tokens = run_engine(core, prompts, max_new_tokens=4)
    assert max(step_tokens) <= BUDGET and sum(calls) > 0, "the Triton kernel should have attended the decode rows"
    assert chunks and min(chunks) > 1, "the varlen kernel should have attended the prompt chunks"
    assert max(map(len, prompts)) > BUDGET, "no prompt is long enough to be chunked"
    for p, r in zip(prompts, reqs, strict=True):
        assert r.generated == hf_greedy(model, p, 4), f"{arch}: greedy differs from generate"
        want = teacher_forced_logprobs(model, p, r.generated).tolist()
        assert r.logprobs == pytest.approx(want, abs=1e-4)


def test_auto_never_picks_triton_and_the_name_resolves():
    assert backends.resolve("auto", torch.device("cpu"), torch.float32) != "triton"
    assert backends.select("auto", torch.device("cpu"), torch.float32, has_sinks=True) != "triton"
    assert backends.resolve("triton", torch.device("cpu"), torch.float32) == "triton"


def test_cannot_run_here_is_a_value_error_saying_why(kernel_module, monkeypatch):
    monkeypatch.setattr(kernel_module, "available", lambda device: False)
    with pytest.raises(ValueError, match=r"attn_backend='triton' runs on CUDA \(or on a CPU under Triton's"):
        TritonBackend.create(torch.device("cpu"), torch.float32)
    with pytest.raises(ValueError, match="supports fp32, bf16 and fp16 caches"):
        TritonBackend.create(torch.device("cpu"), torch.float64)


def test_without_triton_the_name_is_a_value_error_naming_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "rollout.kernels.triton_decode", None)  # NOTE: its import now fails
    with pytest.raises(ValueError, match=r"needs the triton extra .*pip install 'rollout\[triton\]'"):
        TritonBackend.create(torch.device("cpu"), torch.float32)


def test_the_host_plan_is_the_cpp_kernels_plan():
    """`plan_cascades` (the backend's host grouping) forms the C++ kernel's groups on the cascade tests' cases."""
    from support.paged_cases import shared_case

    from rollout.attention.backends.triton import plan_cascades
    from rollout.kernels import cpu_kernels

    plan = cpu_kernels.cascade_plan()
    if plan is None:
        pytest.skip("the C++ kernels (and their cascade plan) cannot be built here")
    for ps, window, seed in [(16, None, 1), (4, 21, 2), (4, None, 3), (16, 40, 4), (8, None, 5)]:
        table, row, start, end, _ = shared_case(ps, window, seed)
        want = sorted((f, p, sorted(r)) for f, p, r, *_ in plan(table, row, start, end, ps))
        got = plan_cascades([table[r].tolist() for r in row.tolist()], start.tolist(), end.tolist(), ps)
        assert want and sorted((f, p, sorted(r)) for f, p, r in got) == want


def _grpo(model, arch: str, cascade: bool):
    """2 prompts x G=3 forked samples (each its own length) and a long unrelated prompt prefilled in chunks beside
    their decodes, through the triton backend; (prompts, completions, raw logprobs, cascade groups' sizes per call,
    steps that had both prompt chunks and cascade groups)."""
    cfg = ContinuousBatchingConfig(page_size=PS, num_blocks=64, max_batch_tokens=BUDGET, return_logprobs=True,
                                   logprobs_mode="raw", attn_backend="triton")
    core = EngineCore(model, GREEDY, cfg)
    calls, mixed = [], []
    if cascade:
        kernel, build = core.backend.cascade_kernel, core.backend.build_group

        def counting(q, k, v, table, row, start, end, ps, scale, cap, out, groups, *args, **kwargs):
            calls.append([len(g[2]) for g in groups])
            return kernel(q, k, v, table, row, start, end, ps, scale, cap, out, groups, *args, **kwargs)

        def building(*args):
            g = build(*args)
            mixed.append(getattr(g, "prefill", None) is not None and getattr(g, "cascade", None) is not None)
            return g

        core.backend.cascade_kernel, core.backend.build_group = counting, building
    else:
        core.backend.cascade_kernel = None  # NOTE: every decode row through the per-row kernel
    prompts = random_prompts(2, 18, 22, seed=5) + random_prompts(1, 70, 70, seed=6)
    reqs = [core.make_request(p, request_id=f"{i}-{j}", max_new_tokens=4 + j)
            for i, p in enumerate(prompts[:2]) for j in range(3)]
    for r in reqs:
        core.add(r)
    for _ in range(2):  # NOTE: the groups decode by now; the long prompt's chunks then run beside them
        core.step()
    reqs.append(core.make_request(prompts[2], request_id="long", max_new_tokens=2))
    core.add(reqs[-1])
    while core.has_work():
        core.step()
    return prompts, [r.generated for r in reqs], [r.logprobs for r in reqs], calls, any(mixed)


@pytest.mark.parametrize("arch", ["qwen3", "gpt_oss"])
def test_grpo_groups_read_their_prompt_once_and_equal_the_per_row_kernel(kernel_module, arch):
    """A GRPO group's forks share their prompt's full pages: the decode steps (also those beside another prompt's
    chunks) go through the Triton cascade kernel with one group per prompt (counted on its arguments), and the
    completions and logprobs equal the per-row kernel's (cascade off) and a teacher-forced pass in fp64 (gpt-oss:
    fp32, with the sinks)."""
    model = make_model(arch).to(device())
    prompts, toks, lps, calls, mixed = _grpo(model, arch, cascade=True)
    assert calls and max(len(c) for c in calls) == 2, f"each prompt's samples should form a group: {calls}"
    assert max(max(c) for c in calls) == 3, f"the leader and its forks should form one group: {calls}"
    assert mixed, f"no cascade group beside a prompt chunk: {calls}"
    _, toks0, lps0, calls0, _ = _grpo(model, arch, cascade=False)
    assert not calls0 and toks == toks0
    # NOTE: fp32, summed in another order (the prompt's pages once a group, then each row's own): 2.3e-6 apart on an AMD
    # EPYC of family 26 (~20 ulps of a logprob near 1), under 2e-6 on family 25; each is within 5e-5 of fp64 below
    for a, b in zip(lps, lps0, strict=True):
        assert a == pytest.approx(b, abs=1e-5)
    # NOTE: gpt-oss's experts run torch's grouped GEMM, which has no fp64: its reference is fp32
    ref = copy.deepcopy(model).double() if arch != "gpt_oss" else model
    owners = [p for p in prompts[:2] for _ in range(3)] + prompts[2:]
    for p, t, lp in zip(owners, toks, lps, strict=True):
        want = teacher_forced_logprobs(ref, p, t).tolist()
        assert lp == pytest.approx(want, abs=5e-5)
