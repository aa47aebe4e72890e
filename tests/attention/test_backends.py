"""The attention-backend choice (`ContinuousBatchingConfig.attn_backend`) and what each backend promises.

Exactness of every backend against `model.generate` and teacher forcing is in test_correctness,
test_logprobs and test_memory (parametrized over backends); the flex kernel against a dense
reference in test_flex_backend.
"""

from __future__ import annotations

import logging

import pytest
import torch
from support.tiny_models import make_model
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import GenerationConfig

from rollout import ContinuousBatchingConfig
from rollout.attention.backends.cpu import CpuBackend
from rollout.attention.backends.flex import FlexBackend
from rollout.attention.backends.sdpa import SdpaBackend
from rollout.engine.core import EngineCore

GREEDY = GenerationConfig(do_sample=False, eos_token_id=None, max_new_tokens=4)


@pytest.fixture(scope="module")
def model():
    return make_model("llama")


def test_unknown_backend_is_a_value_error_naming_the_field():
    with pytest.raises(ValueError, match="attn_backend must be one of"):
        ContinuousBatchingConfig(attn_backend="xformers")
    assert ContinuousBatchingConfig().attn_backend == "auto"


def test_a_backend_that_cannot_run_here_is_a_value_error_naming_it(model):
    with pytest.raises(ValueError, match="attn_backend='flash' needs a CUDA device"):
        EngineCore(model, GREEDY, ContinuousBatchingConfig(page_size=16, num_blocks=8, attn_backend="flash"))


@pytest.mark.parametrize("name, kind, zeroed", [("auto", CpuBackend, False), ("cpu", CpuBackend, False),
                                                ("sdpa", SdpaBackend, False), ("flex", FlexBackend, True)])
def test_the_engine_builds_the_backend_the_config_names(model, name, kind, zeroed):
    core = EngineCore(model, GREEDY, ContinuousBatchingConfig(page_size=16, num_blocks=8, attn_backend=name))
    assert type(core.backend) is kind and core.runner.backend is core.backend
    assert core.backend.name == ("cpu" if name == "auto" else name)
    # NOTE: flex weighs unwritten slots by zero: its cache must hold no NaN garbage
    assert core.cache.zeroed is zeroed
    assert (getattr(core.backend, "kernel", None) is not None) == (core.backend.name == "cpu")


def test_auto_falls_back_to_sdpa_with_a_warning_and_cpu_refuses_without_the_kernel(model, monkeypatch, caplog):
    monkeypatch.setenv("ROLLOUT_CPU_KERNELS", "0")
    with caplog.at_level(logging.INFO, logger="rollout"):  # NOTE: info: rollout.kernels.cpu_kernels warns, once
        core = EngineCore(model, GREEDY, ContinuousBatchingConfig(page_size=16, num_blocks=8))
    assert core.backend.name == "sdpa"
    assert sum("using 'sdpa'" in r.getMessage() for r in caplog.records) == 1
    with pytest.raises(ValueError, match="attn_backend='cpu' needs rollout's C\\+\\+ kernel"):
        EngineCore(model, GREEDY, ContinuousBatchingConfig(page_size=16, num_blocks=8, attn_backend="cpu"))


SYNC_OPS = ("aten._local_scalar_dense", "aten.nonzero", "aten.equal", "aten.is_nonzero", "aten.masked_select",
            "aten.unique", "aten._unique")


class SyncCounter(TorchDispatchMode):
    """Counts ops that read device values back to the host (a CUDA synchronisation)."""

    def __init__(self) -> None:
        super().__init__()
        self.syncs: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = str(func)
        sized = name.startswith("aten.repeat_interleave.Tensor") and kwargs.get("output_size") is None
        if name.startswith(SYNC_OPS) or sized:
            self.syncs.append(name)
        return func(*args, **kwargs)


def test_flex_step_metadata_reads_nothing_back_from_the_device(model):
    """The runner's step inputs and the flex block masks are built with no device-to-host read: on the
    flex path the only synchronisation of a step is the sampled tokens coming back."""
    core = EngineCore(model, GREEDY, ContinuousBatchingConfig(page_size=16, num_blocks=32, max_batch_tokens=40,
                                                              attn_backend="flex"))
    for i, n in enumerate((30, 7, 52)):
        core.add(core.make_request(list(range(1, n + 1)), request_id=f"r{i}", max_new_tokens=4))
    core.step()  # NOTE: the first prompt chunks run; the next step mixes chunks and decodes
    out = core.scheduler.schedule()
    assert {s.num_new_tokens for s in out.scheduled} != {1}
    with SyncCounter() as counter:
        torch.tensor([3]).item()  # NOTE: the counter sees a sync when there is one
        assert counter.syncs == ["aten._local_scalar_dense.default"]
        counter.syncs.clear()
        core.runner.prepare(out)
    assert counter.syncs == []


class LargestFloat(TorchDispatchMode):
    """Records the largest floating-point tensor any op produces."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if isinstance(out, torch.Tensor) and out.is_floating_point():
            self.largest = max(self.largest, out.numel() * out.element_size())
        return out


@pytest.mark.parametrize("masked", [False, True])
def test_softcap_scores_are_built_in_bounded_chunks(monkeypatch, masked):
    """The gather path's softcap attention (Gemma 2) equals a dense fp64 reference while no temporary
    passes the chunk budget: a 96-row chunk against 160 keys would need 4 x 96 x 160 x 4 bytes."""
    from rollout.attention.backends import sdpa

    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 4, 96, 16, generator=g)
    k, v = torch.randn(1, 2, 160, 16, generator=g), torch.randn(1, 2, 160, 16, generator=g)
    qp, kp = torch.arange(64, 160)[:, None], torch.arange(160)[None, :]
    allowed = (kp <= qp) & (kp > qp - 40) if masked else kp <= qp  # [96, 160]
    budget = 4 * 4 * 10 * 160  # NOTE: 10 query rows of fp32 scores at a time
    monkeypatch.setattr(sdpa, "SOFTCAP_SCORE_BYTES", budget)
    with LargestFloat() as seen:
        out = sdpa.attend_dense(q, k, v, allowed[None, None] if masked else None, 0.25, 20.0, is_causal=True)
    s = q.double() @ k.double().repeat_interleave(2, 1).transpose(-1, -2) * 0.25
    s = (torch.tanh(s / 20.0) * 20.0).masked_fill(~allowed, float("-inf"))
    ref = s.softmax(-1) @ v.double().repeat_interleave(2, 1)
    assert (out.double() - ref).abs().max() < 1e-5
    assert seen.largest <= max(budget, q.numel() * 4, k.numel() * 4)


def test_the_memory_plan_counts_attention_temporaries():
    """The gather backends' copies and the flex block masks shrink the cache a budget holds."""
    from rollout.attention.backends import attention_memory
    from rollout.kv.memory_plan import GiB, KVShape, plan_cache

    shape = KVShape(4, 2, 64, torch.bfloat16)
    plans = {}
    for name in ("sdpa", "flex"):
        mem = attention_memory(name, shape, 16, 8192, softcap=True, max_pages=256)
        plans[name] = plan_cache(shape, 16, None, 8192, 0.8, torch.device("cpu"), attn=mem)[0]
    plain = plan_cache(shape, 16, None, 8192, 0.8, torch.device("cpu"))[0]
    page = 16 * shape.bytes_per_token
    # sdpa: one layer's gather, widened to fp32, is 2 x 3 / 4 of the cache: the cache gets 1 / 2.5 of the budget
    assert plans["sdpa"] * page * 2.5 <= plain * page + page
    assert plans["flex"] < plain and plans["sdpa"] < plans["flex"]
    assert all(n * page <= GiB for n in (*plans.values(), plain))
