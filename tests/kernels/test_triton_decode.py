"""The Triton paged decode kernel (`rollout.kernels.triton_decode`), exact on random paged caches.

On a CPU it runs under Triton's interpreter (`support.triton_interpreter`), on a CUDA machine compiled; either
way against the C++ per-row kernel (`cpu_kernels.paged_decode_attention`, computed on the CPU) and an fp64
reference, on the cascade tests' cases (`support.paged_cases`): GRPO-like groups of forks sharing scattered
pages, partial last pages, sliding-window starts, softcap, gpt-oss sinks, fp32 / bf16 / fp16 caches, GQA and
MHA, page sizes 4 and 16, int32 and int64 tables. Skipped with the reason without triton.
"""

from __future__ import annotations

import pytest
import torch
from support.paged_cases import forked_case, reference, shared_case
from support.triton_interpreter import device, load

from rollout.kernels import cpu_kernels

pytestmark = [pytest.mark.triton, pytest.mark.timeout(120)]


@pytest.fixture(scope="module")
def kernel():
    return load().paged_decode_attention


def random_cache(case_seed: int, ps: int, window, heads: int, kv_heads: int, head_dim: int, dtype):
    table, row, start, end, blocks = shared_case(ps, window, case_seed)
    g = torch.Generator().manual_seed(case_seed)
    k = torch.randn(kv_heads, blocks * ps, head_dim, generator=g).to(dtype)
    v = torch.randn(kv_heads, blocks * ps, head_dim, generator=g).to(dtype)
    q = torch.randn(len(row), heads, head_dim, generator=g)
    return q, k, v, table, row, start, end


def on_device(kernel, q, k, v, table, row, start, end, ps, scale, softcap, sinks=None, out_dtype=torch.float32):
    dev = device()
    out = torch.empty(q.shape, dtype=out_dtype, device=dev)
    kernel(q.to(dev), k.to(dev), v.to(dev), table.to(dev), row.to(dev), start.to(dev), end.to(dev), ps, scale,
           softcap, out, None if sinks is None else sinks.to(dev))
    return out.cpu()


CASES = [(None, 0.0, 16), (None, 5.0, 4), (21, 0.0, 4), (40, 5.0, 16)]


@pytest.mark.parametrize("dtype,window,softcap,ps", [(d, *c) for d in (torch.float32, torch.bfloat16) for c in CASES]
                         + [(torch.float16, *CASES[0]), (torch.float16, *CASES[3])])
def test_kernel_equals_the_cpu_kernel_and_fp64(kernel, dtype, window, softcap, ps):
    q, k, v, table, row, start, end = random_cache(11 + ps + (window or 0), ps, window, 4, 2, 64, dtype)
    got = on_device(kernel, q, k, v, table.to(torch.int32), row, start, end, ps, 0.125, softcap)
    torch.testing.assert_close(got.double(), reference(q, k, v, table, row, start, end, ps, 0.125, softcap),
                               atol=2e-5, rtol=1e-5)
    paged = cpu_kernels.paged_decode_attention()
    if paged is not None:  # NOTE: None without a C++ compiler; the fp64 reference still holds
        want = torch.empty_like(q)
        paged(q, k, v, table, row, start, end, ps, 0.125, softcap, want)
        torch.testing.assert_close(got, want, atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("heads,kv_heads,head_dim", [(12, 4, 64), (2, 2, 128), (5, 1, 80), (16, 2, 32)])
def test_head_layouts_and_int64_tables(kernel, heads, kv_heads, head_dim):
    """GQA groups of 3, 1, 5 and 8 query heads, head sizes that are not a power of two, an int64 table."""
    q, k, v, table, row, start, end = random_cache(heads * head_dim, 16, None, heads, kv_heads, head_dim,
                                                   torch.float32)
    scale = head_dim**-0.5
    got = on_device(kernel, q, k, v, table, row, start, end, 16, scale, 0.0)
    torch.testing.assert_close(got.double(), reference(q, k, v, table, row, start, end, 16, scale, 0.0),
                               atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window,softcap", [(None, 0.0), (21, 5.0)])
def test_sinks(kernel, dtype, window, softcap):
    """gpt-oss's sinks: one more logit per head in the denominator; strong sinks (std 2) so they matter."""
    q, k, v, table, row, start, end = random_cache(5, 4, window, 8, 2, 64, dtype)
    sinks = torch.randn(8, generator=torch.Generator().manual_seed(1)) * 2
    got = on_device(kernel, q, k, v, table, row, start, end, 4, 0.125, softcap, sinks)
    want = reference(q, k, v, table, row, start, end, 4, 0.125, softcap, sinks)
    torch.testing.assert_close(got.double(), want, atol=2e-5, rtol=1e-5)
    without = reference(q, k, v, table, row, start, end, 4, 0.125, softcap)
    assert (want - without).abs().max() > 1e-2, "the sinks should change the result (else this tests nothing)"


def test_half_outputs_and_forked_pages(kernel):
    """A bf16 output (a bf16 model's rows) and forks reading their own copies of the leader's partial page."""
    table, _, end, k, v = forked_case(8, 6, 3, 5, True, 3, kv_heads=2, head_dim=64, dtype=torch.bfloat16)
    row, start = torch.arange(6), torch.zeros(6, dtype=torch.long)
    q = torch.randn(6, 4, 64, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    got = on_device(kernel, q, k, v, table, row, start, end, 8, 0.125, 0.0, out_dtype=torch.bfloat16)
    want = reference(q, k, v, table, row, start, end, 8, 0.125, 0.0)
    torch.testing.assert_close(got.double(), want, atol=1e-2, rtol=1e-2)  # NOTE: one bf16 rounding of the output
    assert torch.equal(got, want.to(torch.bfloat16)) or (got.double() - want).abs().max() < 8e-3


def test_bad_shapes_are_value_errors_naming_the_argument(kernel):
    q, k, v, table, row, start, end = random_cache(1, 4, None, 4, 2, 64, torch.float32)
    out = torch.empty_like(q)
    with pytest.raises(ValueError, match="not a multiple of 3 KV heads"):
        kernel(q, k[:1].expand(3, -1, -1), v[:1].expand(3, -1, -1), table, row, start, end, 4, 0.1, 0.0, out)
    with pytest.raises(ValueError, match="out must be q's shape"):
        kernel(q, k, v, table, row, start, end, 4, 0.1, 0.0, out[:1])
    with pytest.raises(ValueError, match=r"sinks must be \[4\]"):
        kernel(q, k, v, table, row, start, end, 4, 0.1, 0.0, out, torch.zeros(3))
    with pytest.raises(ValueError, match="k_cache/v_cache must be"):
        kernel(q, k[..., :32], v[..., :32], table, row, start, end, 4, 0.1, 0.0, out)
