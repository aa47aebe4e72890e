"""The C++ CPU decode-attention kernel (rollout/csrc/decode_attention.cpp, loaded by rollout.cpu_kernels).

Checked against an fp64 softmax(q K^T * scale) V on lanes read at their own lengths, over
the shapes the kernel special-cases (head size 64 and 128 with GQA groups 1, 2, 4, and the generic loop; key
counts that are and are not multiples of its 2- and 4-key blocks; one key), with Gemma 2's softcap, with
two intra-op threads, and on bad input. Engine-level exactness (greedy equals `model.generate`
with the kernel on) is in test_lanes.py and in every architecture test of test_correctness.py.
"""

from __future__ import annotations

import logging
import shutil

import pytest
import torch
from tiny_models import make_model
from transformers import GenerationConfig

from rollout import ContinuousBatchingConfig, cpu_kernels
from rollout.core import EngineCore

HAVE_COMPILER = shutil.which("c++") is not None or shutil.which("g++") is not None


@pytest.fixture(scope="module")
def kernel():
    op = cpu_kernels.decode_attention()
    if op is None and not HAVE_COMPILER:
        pytest.skip("no C++ compiler: the kernel cannot be built here (the engine falls back to SDPA)")
    assert op is not None, "a C++ compiler is present but the decode-attention kernel did not build"
    return op


def reference(q, k, v, lanes, lens, scale, softcap=0.0):
    """fp64 softmax(q K^T * scale) V per row, reading lane `lanes[i]` up to `lens[i]`."""
    n, h, d = q.shape
    hkv = k.shape[1]
    out = torch.empty(n, h, d, dtype=torch.float64)
    for i in range(n):
        kk = k[lanes[i], :, : lens[i]].double().repeat_interleave(h // hkv, 0)  # [H, L, D]
        vv = v[lanes[i], :, : lens[i]].double().repeat_interleave(h // hkv, 0)
        s = torch.einsum("hd,hld->hl", q[i].double(), kk) * scale
        if softcap:
            s = torch.tanh(s / softcap) * softcap
        out[i] = torch.einsum("hl,hld->hd", torch.softmax(s, -1), vv)
    return out


def run(kernel, q, k, v, lanes, lens, scale, softcap=0.0):
    out = torch.empty_like(q)
    kernel(q, k, v, torch.tensor(lanes), torch.tensor(lens), scale, softcap, out)
    return out


@pytest.mark.parametrize("heads,kv_heads,head_dim", [
    (4, 2, 64), (8, 2, 64), (2, 2, 64), (2, 2, 128), (4, 1, 128), (8, 2, 32), (3, 1, 80),
])
@pytest.mark.parametrize("softcap", [0.0, 5.0])
def test_matches_fp64_reference(kernel, heads, kv_heads, head_dim, softcap):
    g = torch.Generator().manual_seed(heads * 1000 + head_dim)
    num_lanes, lane_len = 9, 300
    k = torch.randn(num_lanes, kv_heads, lane_len, head_dim, generator=g)
    v = torch.randn(num_lanes, kv_heads, lane_len, head_dim, generator=g)
    lanes = [7, 0, 3, 8, 5, 1]  # NOTE: out of order, lanes 2, 4 and 6 unused (holes)
    lens = [1, 2, 5, 128, 299, 300]  # NOTE: one key, 4-key blocks with and without a tail, a full lane
    q = torch.randn(len(lanes), heads, head_dim, generator=g) * 2
    scale = head_dim**-0.5
    out = run(kernel, q, k, v, lanes, lens, scale, softcap)
    ref = reference(q, k, v, lanes, lens, scale, softcap)
    torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=1e-5)
    assert torch.equal(out[0], v[7, :, 0].repeat_interleave(heads // kv_heads, 0))  # one key: its value


def test_large_scores_do_not_overflow(kernel):
    """Scores in the hundreds: the max is subtracted before exp, so nothing overflows to inf or nan."""
    g = torch.Generator().manual_seed(1)
    k = torch.randn(2, 1, 64, 64, generator=g) * 10
    v = torch.randn(2, 1, 64, 64, generator=g)
    q = torch.randn(2, 2, 64, generator=g) * 10
    out = run(kernel, q, k, v, [1, 0], [64, 33], 1.0)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.double(), reference(q, k, v, [1, 0], [64, 33], 1.0), atol=1e-4, rtol=1e-4)


def test_two_threads_give_the_same_result(kernel):
    g = torch.Generator().manual_seed(2)
    k = torch.randn(16, 2, 200, 64, generator=g)
    v = torch.randn(16, 2, 200, 64, generator=g)
    q = torch.randn(16, 4, 64, generator=g)
    lanes, lens = list(range(16)), [10 * i + 7 for i in range(16)]
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = run(kernel, q, k, v, lanes, lens, 0.125)
        torch.set_num_threads(2)
        two = run(kernel, q, k, v, lanes, lens, 0.125)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, two)  # NOTE: each (row, KV head) is computed whole by one thread


@pytest.mark.parametrize("case,message", [
    ("lane", "lane or length out of range"),
    ("len0", "lane or length out of range"),
    ("long", "lane or length out of range"),
    ("dtype", "fp32 only"),
    ("strided", "contiguous tensors only"),
    ("heads", "shapes disagree"),
])
def test_bad_input_is_a_clear_error(kernel, case, message):
    k = torch.zeros(2, 1, 8, 16)
    v = torch.zeros(2, 1, 8, 16)
    q = torch.zeros(1, 2, 16)
    lanes, lens = torch.tensor([0]), torch.tensor([4])
    out = torch.empty_like(q)
    if case == "lane":
        lanes = torch.tensor([2])
    elif case == "len0":
        lens = torch.tensor([0])
    elif case == "long":
        lens = torch.tensor([9])
    elif case == "dtype":
        q, out = q.double(), out.double()
    elif case == "strided":
        k = torch.zeros(2, 1, 16, 8).transpose(2, 3)
    elif case == "heads":
        k, v = torch.zeros(2, 2, 8, 16), torch.zeros(2, 2, 8, 16)  # NOTE: 3 query heads over 2 KV heads
        q, out = torch.zeros(1, 3, 16), torch.empty(1, 3, 16)
    with pytest.raises(RuntimeError, match=message):
        kernel(q, k, v, lanes, lens, 1.0, 0.0, out)


GREEDY = GenerationConfig(do_sample=False, eos_token_id=None)


def test_env_switch_turns_the_kernel_off(monkeypatch):
    monkeypatch.setenv("ROLLOUT_CPU_KERNELS", "0")
    assert cpu_kernels.decode_attention() is None
    core = EngineCore(make_model("qwen3"), GREEDY, ContinuousBatchingConfig())
    assert core.cache.lanes is not None and core.cache.lanes.kernel is None


def test_a_failed_build_warns_once_and_falls_back_to_sdpa(monkeypatch, caplog):
    def broken():
        raise RuntimeError("Error building extension 'rollout_cpu': c++: command not found")

    monkeypatch.setattr(cpu_kernels, "_state", {})
    monkeypatch.setattr(cpu_kernels, "_build", broken)
    with caplog.at_level(logging.WARNING, logger="rollout"):
        assert cpu_kernels.decode_attention() is None
        assert cpu_kernels.decode_attention() is None  # remembered: no second build, no second warning
    warnings = [r.getMessage() for r in caplog.records if "decode-attention kernel unavailable" in r.getMessage()]
    assert len(warnings) == 1 and "command not found" in warnings[0]
    core = EngineCore(make_model("qwen3"), GREEDY, ContinuousBatchingConfig())
    assert core.cache.lanes.kernel is None  # the engine still runs, on SDPA over lane buckets
    r = core.make_request([5, 6, 7, 8], request_id="x", max_new_tokens=4)
    core.add(r)
    while core.has_work():
        core.step()
    assert len(r.generated) == 4
