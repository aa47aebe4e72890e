"""The greedy-exactness workload shared by the correctness matrix and the tests that rerun it (compiled
forward, oneDNN linears): prompts of 3-80 tokens, several sharing a 40-token prefix, a 48-token step budget
and 16-token pages, HF `generate` as the oracle, and a driver that records chunk sizes per request."""

from __future__ import annotations

import functools
from collections import defaultdict

import pytest
import torch
from transformers import GenerationConfig

from rollout.engine.core import EngineCore
from support.tiny_models import VOCAB, hf_greedy, make_model

ARCHS = ["llama", "qwen3", "mistral", "gemma2", "gpt2", "gpt_neox", "phi3"]
FLEX_FAST = ("llama", "qwen3", "mistral", "gemma2")  # NOTE: one compiled flex kernel layout (and its softcap twin)


def backend_matrix(archs: list[str], flex_fast: tuple[str, ...] = FLEX_FAST) -> list:
    """(arch, backend) params: every backend on every arch; flex outside `flex_fast` marked slow."""
    out = []
    for arch in archs:
        for backend in ("cpu", "sdpa", "flex"):
            marks = [pytest.mark.slow] if backend == "flex" and arch not in flex_fast else []
            out.append(pytest.param(arch, backend, marks=marks, id=f"{arch}-{backend}"))
    return out


MAX_NEW = 6
BUDGET = 48
PS = 16
LONG = 80  # the longest prompt, unshared: 80 > 48 query tokens, so it needs two steps at least
GREEDY_GC = GenerationConfig(do_sample=False, eos_token_id=None, max_new_tokens=MAX_NEW)


def make_prompts() -> list[list[int]]:
    """6 unrelated prompts (3..80 tokens) and 4 sharing a 40-token prefix (43..76 tokens), interleaved."""
    g = torch.Generator().manual_seed(1234)

    def rand(n: int) -> list[int]:
        return torch.randint(1, VOCAB, (n,), generator=g).tolist()

    prefix = rand(40)
    unshared = [rand(n) for n in (3, 9, 16, 17, 31, LONG)]
    shared = [prefix + rand(n) for n in (3, 10, 24, 36)]
    return [
        unshared[0],
        shared[0],
        unshared[1],
        unshared[5],
        shared[1],
        unshared[2],
        unshared[3],
        shared[2],
        unshared[4],
        shared[3],
    ]


PROMPTS = make_prompts()


@functools.cache
def reference(arch: str) -> tuple[torch.nn.Module, list[list[int]]]:
    model = make_model(arch)
    return model, [hf_greedy(model, p, MAX_NEW) for p in PROMPTS]


def run_engine(core: EngineCore, prompts: list[list[int]], max_new_tokens: int = MAX_NEW):
    """Drive the core to completion; returns (requests, per-request chunk sizes, per-step token counts)."""
    reqs = [
        core.make_request(p, request_id=f"r{i}", max_new_tokens=max_new_tokens) for i, p in enumerate(prompts)
    ]
    for r in reqs:
        core.add(r)
    chunks: dict[str, list[int]] = defaultdict(list)
    step_tokens: list[int] = []
    schedule = core.scheduler.schedule

    def recording_schedule():
        out = schedule()
        step_tokens.append(out.num_tokens)
        for s in out.scheduled:
            chunks[s.request.request_id].append(s.num_new_tokens)
        return out

    core.scheduler.schedule = recording_schedule  # NOTE: instance attribute, this core only
    while core.has_work():
        core.step()
        assert len(step_tokens) < 500, "engine made no progress"
    return reqs, chunks, step_tokens
