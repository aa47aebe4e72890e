"""The C++ CPU decode-attention kernel (rollout/kernels/csrc/decode_attention.cpp, loaded by
rollout.kernels.cpu_kernels): decode rows attended in place over the paged cache through block tables (fp32, bf16 and
fp16 caches).

Checked against an fp64 softmax(q K^T * scale) V over each row's keys laid out contiguously, over
the shapes the kernel special-cases (head size 64 and 128 with GQA groups 1-4, 6, 7, 8, head size 256
with groups 1 and 2, and the generic loop (group 5, head sizes 32 and 80);
key counts that are and are not multiples of its 2- and 4-key blocks; one key; rows starting inside a
page), with Gemma 2's softcap, int32 and int64 block tables, two intra-op threads, and on bad input.
Engine-level exactness (greedy equals `model.generate` with the kernel on) is in every architecture
test of test_correctness.py (sliding windows, softcap, GQA, MHA). Threads, the GIL and the build lock
are in test_kernel_runtime.py.
"""

from __future__ import annotations

import logging
import shutil

import pytest
import torch
from support.tiny_models import hf_greedy, make_model, random_prompts
from transformers import GenerationConfig

from rollout import ContinuousBatchingConfig, RequestStatus
from rollout.engine.core import EngineCore
from rollout.kernels import cpu_kernels

HAVE_COMPILER = shutil.which("c++") is not None or shutil.which("g++") is not None


@pytest.fixture(scope="module")
def paged():
    op = cpu_kernels.paged_decode_attention()
    if op is None and not HAVE_COMPILER:
        pytest.skip("no C++ compiler: the kernel cannot be built here (the engine falls back to SDPA)")
    assert op is not None, "a C++ compiler is present but the decode-attention kernel did not build"
    return op


def reference(q, k, v, lens, scale, softcap=0.0):
    """fp64 softmax(q K^T * scale) V per row, reading k[i], v[i] ([Hkv, L, D]) up to `lens[i]`."""
    n, h, d = q.shape
    hkv = k.shape[1]
    out = torch.empty(n, h, d, dtype=torch.float64)
    for i in range(n):
        kk = k[i, :, : lens[i]].double().repeat_interleave(h // hkv, 0)  # [H, L, D]
        vv = v[i, :, : lens[i]].double().repeat_interleave(h // hkv, 0)
        s = torch.einsum("hd,hld->hl", q[i].double(), kk) * scale
        if softcap:
            s = torch.tanh(s / softcap) * softcap
        out[i] = torch.einsum("hl,hld->hd", torch.softmax(s, -1), vv)
    return out


def paged_case(heads, kv_heads, head_dim, dtype, page_size=16, seed=0, index=torch.long):
    """A head-major cache [Hkv, blocks * page_size, D] with rows whose pages are scattered, a block table
    with more rows than queries (each query names its row), and each row's keys and values laid out
    contiguously (what the reference reads)."""
    g = torch.Generator().manual_seed(seed)
    blocks = 40
    k = torch.randn(kv_heads, blocks * page_size, head_dim, generator=g).to(dtype)
    v = torch.randn(kv_heads, blocks * page_size, head_dim, generator=g).to(dtype)
    spans = [(0, 1), (0, 2), (0, 3), (0, 5), (0, page_size), (5, page_size + 7), (0, 3 * page_size + 2),
             (page_size + 3, 4 * page_size)]
    width = 5
    table = torch.stack([torch.randperm(blocks, generator=g)[:width] for _ in range(len(spans) + 3)])  # [R, P]
    row = torch.randperm(len(spans) + 3, generator=g)[: len(spans)]  # NOTE: queries name their table rows
    start = torch.tensor([s for s, _ in spans])
    end = torch.tensor([e for _, e in spans])
    q = torch.randn(len(spans), heads, head_dim, generator=g) * 2
    longest = max(e - s for s, e in spans)
    lk = torch.zeros(len(spans), kv_heads, longest, head_dim)
    lv = torch.zeros(len(spans), kv_heads, longest, head_dim)
    for i, (s, e) in enumerate(spans):
        pos = torch.arange(s, e)
        slots = table[row[i], pos // page_size] * page_size + pos % page_size
        lk[i, :, : e - s] = k[:, slots].float()
        lv[i, :, : e - s] = v[:, slots].float()
    lens = [e - s for s, e in spans]
    return q, k, v, table.to(index), row, start, end, lk, lv, lens


def run(paged, q, k, v, table, row, start, end, scale, softcap=0.0, page_size=16):
    out = torch.empty_like(q)
    paged(q, k, v, table, row, start, end, page_size, scale, softcap, out)
    return out


@pytest.mark.parametrize("heads,kv_heads,head_dim", [
    (4, 2, 64), (8, 2, 64), (2, 2, 64), (2, 2, 128), (4, 1, 128), (8, 2, 32), (3, 1, 80),
    (12, 4, 64), (12, 2, 64), (16, 2, 64), (14, 2, 128), (16, 2, 128), (32, 8, 128), (4, 2, 256), (5, 1, 64),
])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("softcap", [0.0, 5.0])
def test_paged_matches_fp64_reference(paged, heads, kv_heads, head_dim, dtype, softcap):
    """Rows start at 0 or inside a page (a sliding window), end inside or at the end of a page, span one
    to four scattered pages; half-precision caches are widened exactly, so the reference reads the same values."""
    q, k, v, table, row, start, end, lk, lv, lens = paged_case(heads, kv_heads, head_dim, dtype, seed=heads + head_dim)
    scale = head_dim**-0.5
    out = run(paged, q, k, v, table, row, start, end, scale, softcap)
    ref = reference(q, lk, lv, lens, scale, softcap)
    torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=1e-5)
    one = lv[0, :, 0].repeat_interleave(heads // kv_heads, 0)  # NOTE: one key: its value, exactly
    assert torch.equal(out[0], one)


def test_int32_and_int64_tables_agree(paged):
    """The engine's persistent table is int32; per-query tables may be int64: same result, bitwise."""
    a = paged_case(4, 2, 64, torch.float32, index=torch.int32)
    b = paged_case(4, 2, 64, torch.float32, index=torch.long)
    assert a[3].dtype == torch.int32
    assert torch.equal(run(paged, *a[:7], 0.125), run(paged, *b[:7], 0.125))


def test_large_scores_do_not_overflow(paged):
    """Scores in the hundreds: the max is subtracted before exp, so nothing overflows to inf or nan."""
    q, k, v, table, row, start, end, lk, lv, lens = paged_case(2, 1, 64, torch.float32, seed=1)
    q, k, v = q * 10, k * 10, v
    lk = lk * 10
    out = run(paged, q, k, v, table, row, start, end, 1.0)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.double(), reference(q, lk, lv, lens, 1.0), atol=1e-4, rtol=1e-4)


def test_two_threads_give_the_same_result(paged):
    case = paged_case(4, 2, 64, torch.float32, seed=2)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = run(paged, *case[:7], 0.125)
        torch.set_num_threads(2)
        two = run(paged, *case[:7], 0.125)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, two)  # NOTE: each (row, KV head) is computed whole by one thread


@pytest.mark.parametrize("case,message", [
    ("block", "block id out of range"),
    ("row", "table row out of range"),
    ("end", "positions out of range"),
    ("empty", "positions out of range"),
    ("dtype", "fp32, bf16 or fp16 cache only"),
    ("qdtype", "fp32 queries and output only"),
    ("table", "int32 or int64 block table"),
    ("page", "bad page size"),
    ("strided", "contiguous tensors only"),
    ("heads", "shapes disagree"),
])
def test_paged_bad_input_is_a_clear_error(paged, case, message):
    q, k, v, table, row, start, end, *_ = paged_case(4, 2, 64, torch.float32)
    page_size, out = 16, torch.empty_like(q)
    if case == "block":
        table = table.clone()
        table[row[1], 0] = 40
    elif case == "row":
        row = row.clone()
        row[0] = table.shape[0]
    elif case == "end":
        end = end.clone()
        end[0] = 5 * 16 + 1
    elif case == "empty":
        start = end.clone()
    elif case == "dtype":
        k, v = k.double(), v.double()
    elif case == "qdtype":
        q, out = q.double(), out.double()
    elif case == "table":
        table = table.float()
    elif case == "page":
        page_size = 7
    elif case == "strided":
        k = k.transpose(0, 1).contiguous().transpose(0, 1)
    elif case == "heads":
        q, out = q[:, :3].contiguous(), out[:, :3].contiguous()  # NOTE: 3 query heads over 2 KV heads
    with pytest.raises(RuntimeError, match=message):
        paged(q, k, v, table, row, start, end, page_size, 1.0, 0.0, out)


GREEDY = GenerationConfig(do_sample=False, eos_token_id=None)


def _decode(core, n=20):
    r = core.make_request(list(range(3, 40)), request_id="x", max_new_tokens=n)
    core.add(r)
    while core.has_work():
        core.step()
    return r


def test_env_switch_turns_the_kernel_off(monkeypatch):
    monkeypatch.setenv("ROLLOUT_CPU_KERNELS", "0")
    assert cpu_kernels.paged_decode_attention() is None
    core = EngineCore(make_model("qwen3"), GREEDY, ContinuousBatchingConfig())
    assert core.backend.name == "sdpa"  # NOTE: "auto" falls back: decode rows take the gather + SDPA buckets
    assert len(_decode(core).generated) == 20


def test_a_failed_build_warns_once_and_falls_back_to_sdpa(monkeypatch, caplog):
    def broken():
        raise RuntimeError("Error building extension 'rollout_cpu': c++: command not found")

    monkeypatch.setattr(cpu_kernels, "STATE", {})
    monkeypatch.setattr(cpu_kernels, "build", broken)
    with caplog.at_level(logging.WARNING, logger="rollout"):
        assert cpu_kernels.paged_decode_attention() is None
        assert cpu_kernels.paged_decode_attention() is None  # remembered: no second build, no second warning
    warnings = [r.getMessage() for r in caplog.records if "C++ CPU kernels are off" in r.getMessage()]
    assert len(warnings) == 1 and "command not found" in warnings[0], warnings
    assert all(name in warnings[0] for name in ("decode attention", "linears", "RMSNorm", "SiLU", "KV writes"))
    core = EngineCore(make_model("qwen3"), GREEDY, ContinuousBatchingConfig())
    assert core.backend.name == "sdpa"  # the engine still runs, on the gather + SDPA buckets
    assert len(_decode(core, 4).generated) == 4


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_engine_decodes_through_the_paged_kernel(paged, dtype):
    """Every CPU dtype decodes in place over the pages; the kernel is the one that ran (counted)."""
    model = make_model("qwen3", dtype=dtype)
    core = EngineCore(model, GREEDY, ContinuousBatchingConfig(page_size=16))
    assert core.backend.name == "cpu" and core.backend.kernel is not None
    calls = []
    kernel = core.backend.kernel
    core.backend.kernel = lambda *a: (calls.append(1), kernel(*a))
    assert len(_decode(core).generated) == 20
    assert len(calls) >= 19 * model.config.num_hidden_layers


# ------------------------------------------------------------------ engine exactness, kernel and gather path


def mixed_workload(seed: int = 0, n: int = 14):
    g = torch.Generator().manual_seed(seed)
    prompts = random_prompts(n, 3, 300, seed=seed, shared_prefix=30, n_shared=4)
    max_new = torch.randint(1, 40, (n,), generator=g).tolist()
    return prompts, max_new


@pytest.mark.parametrize("kernel", ["1", "0"])
def test_mixed_workload_matches_generate_with_arrivals(monkeypatch, kernel):
    """Chunked prefill (budget 64), staggered decode entry, late arrivals, shared prefixes: decode rows
    through the paged kernel and through the gather + SDPA buckets (no compiler) both equal `generate`."""
    monkeypatch.setenv("ROLLOUT_CPU_KERNELS", kernel)
    model = make_model("qwen3")
    prompts, max_new = mixed_workload()
    late = list(zip(*mixed_workload(seed=1, n=6), strict=True))
    core = EngineCore(model, GREEDY, ContinuousBatchingConfig(page_size=16, max_batch_tokens=64, num_blocks=512))
    assert (core.backend.name == "cpu") == (kernel == "1") or not HAVE_COMPILER
    reqs = [
        core.make_request(p, request_id=f"r{i}", max_new_tokens=n)
        for i, (p, n) in enumerate(zip(prompts, max_new, strict=True))
    ]
    late_reqs = [core.make_request(p, request_id=f"late{i}", max_new_tokens=n) for i, (p, n) in enumerate(late)]
    for r in reqs:
        core.add(r)
    steps = 0
    while core.has_work() or late_reqs:
        if steps == 12:
            for r in late_reqs:
                core.add(r)
            reqs += late_reqs
            late_reqs = []
        core.step()
        steps += 1
        assert steps < 2000
    for r, (p, n) in zip(reqs, list(zip(prompts, max_new, strict=True)) + late, strict=True):
        assert r.status == RequestStatus.FINISHED
        assert r.generated == hf_greedy(model, p, n), f"{r.request_id} ({len(p)}-token prompt) differs"
    assert core.cache_stats()["free_blocks"] == core.cache_stats()["num_blocks"]


def test_kernel_and_gather_give_the_same_tokens_under_preemption(monkeypatch):
    """A pool too small for the workload: preempted requests are recomputed; both decode paths agree."""
    model = make_model("qwen3")
    prompts = random_prompts(8, 20, 60, seed=3)
    cfg = ContinuousBatchingConfig(page_size=16, num_blocks=14, max_batch_tokens=64)
    outs = {}
    for flag in ("1", "0"):
        monkeypatch.setenv("ROLLOUT_CPU_KERNELS", flag)
        core = EngineCore(model, GREEDY, cfg)
        reqs = [core.make_request(p, request_id=f"r{i}", max_new_tokens=40) for i, p in enumerate(prompts)]
        for r in reqs:
            core.add(r)
        while core.has_work():
            core.step()
        assert core.cache_stats()["preemptions"] > 0
        outs[flag] = [r.generated for r in reqs]
    assert outs["1"] == outs["0"]
    assert outs["1"][0] == hf_greedy(model, prompts[0], 40)
