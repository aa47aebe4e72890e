"""The `triton` attention backend (`rollout.attention.backends.triton`) in the engine.

On a CPU the kernels (decode rows, and prompt chunks through the varlen kernel) run under Triton's interpreter
(`support.triton_interpreter`), on a CUDA machine compiled: greedy tokens equal `model.generate` and raw logprobs equal
teacher forcing on the correctness workload (chunked prefill, prefix-cache hits, prompt chunks mixed with decode rows),
on RoPE + GQA (Qwen3), a sliding window (Mistral), logit softcap (Gemma 2) and attention sinks (gpt-oss). It is chosen
by name only; without triton, or on a CPU outside the interpreter, the name is a ValueError saying why.
Skipped with the reason without triton.
"""

from __future__ import annotations

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
