"""The Triton varlen (prefill / chunked-prefill) paged attention kernel (`rollout.kernels.triton_prefill`).

Under Triton's interpreter on a CPU (compiled on a CUDA machine): random paged caches with scattered pages, three
sequences per step of 1, 7 and 21 query tokens starting at positions 0, 37 and 9 (a new prompt, a decode row, a
later chunk), causal; sliding windows, softcap, gpt-oss sinks; fp32 / bf16 / fp16 caches; GQA groups 1, 2, 3 and 8.
Each query token is checked against the fp64 reference of `support.paged_cases` over its own positions [max(0,
p - window + 1), p] and against the C++ decode kernel run on the same tokens as decode rows. Kept small: seconds.
"""

from __future__ import annotations

import pytest
import torch
from support.paged_cases import reference
from support.triton_interpreter import device, load

from rollout.kernels import cpu_kernels

pytestmark = [pytest.mark.triton, pytest.mark.timeout(180)]

LENS, POS = [7, 1, 21], [0, 37, 9]  # NOTE: a prompt chunk, a decode row, a later chunk of a longer prompt


@pytest.fixture(scope="module")
def kernel():
    return load("rollout.kernels.triton_prefill").paged_prefill_attention


def case(ps: int, heads: int, kv_heads: int, dim: int, dtype, seed: int = 0):
    """Packed queries, a cache of scattered pages and each sequence's table row; per token its row and range."""
    g = torch.Generator().manual_seed(seed)
    ends = [p + n for p, n in zip(POS, LENS, strict=True)]
    pages = [-(-e // ps) for e in ends]
    blocks = sum(pages) + 3
    perm = torch.randperm(blocks, generator=g)
    width = max(pages)
    table, used = torch.zeros(len(LENS), width, dtype=torch.long), 0
    for b, n in enumerate(pages):
        table[b, :n] = perm[used : used + n]
        used += n
    k = torch.randn(kv_heads, blocks * ps, dim, generator=g).to(dtype)
    v = torch.randn(kv_heads, blocks * ps, dim, generator=g).to(dtype)
    q = torch.randn(sum(LENS), heads, dim, generator=g).to(dtype)
    row = torch.tensor([2, 0, 1])  # NOTE: sequences read other table rows than their own index
    tables = table[torch.argsort(row)]
    tok_row = torch.tensor([int(row[b]) for b, n in enumerate(LENS) for _ in range(n)])
    tok_pos = torch.tensor([POS[b] + i for b, n in enumerate(LENS) for i in range(n)])
    return q, k, v, tables, row, tok_row, tok_pos


def run(kernel, q, k, v, table, row, ps, scale, softcap, window, sinks=None):
    dev = device()
    starts = torch.tensor([0, *torch.tensor(LENS).cumsum(0)[:-1].tolist()])
    out = torch.full(q.shape, float("nan"), dtype=q.dtype, device=dev)
    kernel(q.to(dev), k.to(dev), v.to(dev), table.to(dev), row.to(dev), starts.to(dev), torch.tensor(POS).to(dev),
           LENS, ps, scale, softcap, window, out, None if sinks is None else sinks.to(dev))
    return out.cpu()


def token_ranges(tok_pos, window):
    end = tok_pos + 1
    return (torch.zeros_like(end) if window is None else (end - window).clamp_min(0)), end


CASES = [(None, 0.0, 16), (None, 5.0, 4), (8, 0.0, 4), (13, 5.0, 16)]


@pytest.mark.parametrize("dtype,window,softcap,ps", [(d, *c) for d in (torch.float32, torch.bfloat16) for c in CASES]
                         + [(torch.float16, *CASES[0]), (torch.float16, *CASES[3])])
def test_kernel_equals_fp64_and_the_cpu_decode_kernel(kernel, dtype, window, softcap, ps):
    q, k, v, table, row, tok_row, tok_pos = case(ps, 4, 2, 64, dtype, seed=ps + (window or 0))
    got = run(kernel, q, k, v, table.to(torch.int32), row, ps, 0.125, softcap, window)
    start, end = token_ranges(tok_pos, window)
    want = reference(q.float(), k, v, table, tok_row, start, end, ps, 0.125, softcap)
    tol = dict(atol=2e-5, rtol=1e-5) if dtype is torch.float32 else dict(atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(got.double(), want, **tol)
    paged = cpu_kernels.paged_decode_attention()
    if paged is not None and dtype is torch.float32:  # NOTE: None without a C++ compiler
        cpp = torch.empty_like(q)
        paged(q, k, v, table, tok_row, start, end, ps, 0.125, softcap, cpp)
        torch.testing.assert_close(got, cpp, atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("heads,kv_heads,dim", [(3, 3, 32), (6, 2, 80), (16, 2, 32)])
def test_head_layouts_and_int64_tables(kernel, heads, kv_heads, dim):
    q, k, v, table, row, tok_row, tok_pos = case(16, heads, kv_heads, dim, torch.float32, seed=heads)
    got = run(kernel, q, k, v, table, row, 16, dim**-0.5, 0.0, None)
    start, end = token_ranges(tok_pos, None)
    torch.testing.assert_close(got.double(), reference(q, k, v, table, tok_row, start, end, 16, dim**-0.5, 0.0),
                               atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("window", [None, 8])
def test_sinks(kernel, window):
    q, k, v, table, row, tok_row, tok_pos = case(4, 8, 2, 64, torch.float32, seed=3)
    sinks = torch.randn(8, generator=torch.Generator().manual_seed(1)) * 2
    got = run(kernel, q, k, v, table, row, 4, 0.125, 5.0, window, sinks)
    start, end = token_ranges(tok_pos, window)
    want = reference(q, k, v, table, tok_row, start, end, 4, 0.125, 5.0, sinks)
    torch.testing.assert_close(got.double(), want, atol=2e-5, rtol=1e-5)


def test_bad_shapes_are_value_errors(kernel):
    q, k, v, table, row, *_ = case(16, 4, 2, 64, torch.float32)
    with pytest.raises(ValueError, match="lens"):
        run_lens = [7, 1, 0]
        kernel(q, k, v, table, row, torch.zeros(3, dtype=torch.long), torch.zeros(3, dtype=torch.long), run_lens,
               16, 0.125, 0.0, None, torch.empty_like(q))
    with pytest.raises(ValueError, match="multiple"):
        kernel(torch.empty(29, 3, 64), k, v, table, row, torch.zeros(3, dtype=torch.long),
               torch.zeros(3, dtype=torch.long), LENS, 16, 0.125, 0.0, None, torch.empty(29, 3, 64))
