"""The C++ CPU decode-attention kernels (rollout/csrc/decode_attention.cpp, loaded by rollout.cpu_kernels):
over decode lanes, and over the paged cache in place (the default for fp32 and bf16 caches).

Checked against an fp64 softmax(q K^T * scale) V on lanes read at their own lengths, over
the shapes the kernels special-case (head size 64 and 128 with GQA groups 1, 2, 4, and the generic loop; key
counts that are and are not multiples of its 2- and 4-key blocks; one key), with Gemma 2's softcap, with
two intra-op threads, and on bad input. Engine-level exactness (greedy equals `model.generate`
with the kernels on) is in test_lanes.py (lanes) and in every architecture test of test_correctness.py
(the paged kernel: sliding windows, softcap, GQA, MHA).
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


def test_env_switch_turns_the_kernels_off(monkeypatch):
    monkeypatch.setenv("ROLLOUT_CPU_KERNELS", "0")
    assert cpu_kernels.decode_attention() is None and cpu_kernels.paged_decode_attention() is None
    core = EngineCore(make_model("qwen3"), GREEDY, ContinuousBatchingConfig())
    assert core.cache.paged_kernel is None
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
    assert core.cache.paged_kernel is None
    assert core.cache.lanes.kernel is None  # the engine still runs, on SDPA over lane buckets
    r = core.make_request([5, 6, 7, 8], request_id="x", max_new_tokens=4)
    core.add(r)
    while core.has_work():
        core.step()
    assert len(r.generated) == 4


# ------------------------------------------------------------------ the paged kernel (default CPU decode)


@pytest.fixture(scope="module")
def paged(kernel):
    return cpu_kernels.paged_decode_attention()


def paged_case(heads, kv_heads, head_dim, dtype, page_size=16, seed=0):
    """A head-major cache [Hkv, blocks * page_size, D] with rows whose pages are scattered, and a copy of
    each row's keys and values laid out contiguously (what the reference reads)."""
    g = torch.Generator().manual_seed(seed)
    blocks = 40
    k = torch.randn(kv_heads, blocks * page_size, head_dim, generator=g).to(dtype)
    v = torch.randn(kv_heads, blocks * page_size, head_dim, generator=g).to(dtype)
    spans = [(0, 1), (0, 3), (0, page_size), (5, page_size + 7), (0, 3 * page_size + 2), (page_size + 3, 4 * page_size)]
    width = 5
    table = torch.stack([torch.randperm(blocks, generator=g)[:width] for _ in spans])  # NOTE: scattered pages
    start = torch.tensor([s for s, _ in spans])
    end = torch.tensor([e for _, e in spans])
    q = torch.randn(len(spans), heads, head_dim, generator=g) * 2
    lane_len = max(e for _, e in spans)
    lk = torch.zeros(len(spans), kv_heads, lane_len, head_dim)
    lv = torch.zeros(len(spans), kv_heads, lane_len, head_dim)
    for i, (s, e) in enumerate(spans):
        pos = torch.arange(s, e)
        slots = table[i, pos // page_size] * page_size + pos % page_size
        lk[i, :, : e - s] = k[:, slots].float()
        lv[i, :, : e - s] = v[:, slots].float()
    lens = [e - s for s, e in spans]
    return q, k, v, table, start, end, lk, lv, lens


@pytest.mark.parametrize("heads,kv_heads,head_dim", [(4, 2, 64), (8, 2, 64), (2, 2, 128), (3, 1, 80)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("softcap", [0.0, 5.0])
def test_paged_matches_fp64_reference(paged, heads, kv_heads, head_dim, dtype, softcap):
    """Rows start at 0 or inside a page (a sliding window), end inside or at the end of a page, span one
    to four scattered pages; bf16 caches are widened exactly, so the reference reads the same values."""
    q, k, v, table, start, end, lk, lv, lens = paged_case(heads, kv_heads, head_dim, dtype, seed=heads + head_dim)
    out = torch.empty_like(q)
    scale = head_dim**-0.5
    paged(q, k, v, table, start, end, 16, scale, softcap, out)
    ref = reference(q, lk, lv, list(range(len(lens))), lens, scale, softcap)
    torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=1e-5)


def test_paged_equals_the_lane_kernel_on_the_same_keys(kernel, paged):
    """Same arithmetic, other addressing: bitwise equal on fp32."""
    q, k, v, table, start, end, lk, lv, lens = paged_case(4, 2, 64, torch.float32)
    a, b = torch.empty_like(q), torch.empty_like(q)
    paged(q, k, v, table, start, end, 16, 0.125, 0.0, a)
    kernel(q, lk, lv, torch.arange(len(lens)), torch.tensor(lens), 0.125, 0.0, b)
    assert torch.equal(a, b)


@pytest.mark.parametrize("case,message", [
    ("block", "block id out of range"),
    ("end", "positions out of range"),
    ("empty", "positions out of range"),
    ("dtype", "fp32 or bf16 cache only"),
    ("qdtype", "fp32 queries and output only"),
    ("page", "bad page size"),
])
def test_paged_bad_input_is_a_clear_error(paged, case, message):
    q, k, v, table, start, end, *_ = paged_case(4, 2, 64, torch.float32)
    page_size, out = 16, torch.empty_like(q)
    if case == "block":
        table = table.clone()
        table[1, 0] = 40
    elif case == "end":
        end = end.clone()
        end[0] = 5 * 16 + 1
    elif case == "empty":
        start = end.clone()
    elif case == "dtype":
        k, v = k.half(), v.half()
    elif case == "qdtype":
        q, out = q.double(), out.double()
    elif case == "page":
        page_size = 7
    with pytest.raises(RuntimeError, match=message):
        paged(q, k, v, table, start, end, page_size, 1.0, 0.0, out)


@pytest.mark.parametrize("dtype,uses_paged", [(torch.float32, True), (torch.bfloat16, True), (torch.float16, False)])
def test_engine_decodes_through_the_paged_kernel_by_default(paged, dtype, uses_paged):
    """fp32 and bf16 caches: the paged kernel, no lanes; fp16: decode lanes (fp32) and the lane kernel."""
    core = EngineCore(make_model("qwen3", dtype=dtype), GREEDY, ContinuousBatchingConfig(page_size=16))
    assert (core.cache.paged_kernel is not None) == uses_paged
    assert (core.cache.lanes is None) == uses_paged
    r = core.make_request(list(range(3, 40)), request_id="x", max_new_tokens=20)
    core.add(r)
    while core.has_work():
        core.step()
    assert len(r.generated) == 20
    assert (core.cache_stats()["lane_bytes"] == 0) == uses_paged


def test_paged_kernel_off_by_env(monkeypatch):
    monkeypatch.setenv("ROLLOUT_PAGED_KERNEL", "0")
    core = EngineCore(make_model("qwen3"), GREEDY, ContinuousBatchingConfig())
    assert core.cache.paged_kernel is None and core.cache.lanes is not None and core.cache.lanes.kernel is not None
