"""The Triton cascade decode kernel (`rollout.kernels.triton_cascade`): a group's shared pages read once.

Under Triton's interpreter on a CPU (compiled on CUDA): on the cascade tests' random paged caches
(`support.paged_cases.shared_case`: GRPO-like groups of forks over scattered pages, windows) and a GRPO-sized group,
with the C++ kernel's own plan (`cpu_kernels.cascade_plan`), equal to the C++ cascade kernel and the fp64 reference;
softcap, sinks, bf16 caches, GQA. A plan whose shared span is one page too long fails the check. Small: seconds.
"""

from __future__ import annotations

import pytest
import torch
from support.paged_cases import reference, shared_case
from support.triton_interpreter import device, load

from rollout.kernels import cpu_kernels

pytestmark = [pytest.mark.triton, pytest.mark.timeout(180)]


@pytest.fixture(scope="module")
def kernel():
    if cpu_kernels.cascade_plan() is None:
        pytest.skip("the C++ kernels (and their cascade plan) cannot be built here")
    return load("rollout.kernels.triton_cascade").cascade_decode_attention


def run(kernel, q, k, v, table, row, start, end, ps, scale, softcap, groups, sinks=None):
    dev = device()
    out = torch.full(q.shape, float("nan"), device=dev)
    kernel(q.to(dev), k.to(dev), v.to(dev), table.to(dev), row.to(dev), start.to(dev), end.to(dev), ps, scale,
           softcap, out, groups, None if sinks is None else sinks.to(dev), ends=end.tolist())
    return out.cpu()


@pytest.mark.parametrize("dtype,window,softcap,ps", [(torch.float32, None, 0.0, 16), (torch.float32, 21, 5.0, 4),
                                                     (torch.bfloat16, None, 5.0, 4), (torch.bfloat16, 40, 0.0, 16)])
def test_cascade_equals_the_cpp_cascade_and_fp64(kernel, dtype, window, softcap, ps):
    seed = 7 + ps + (window or 0)
    table, row, start, end, blocks = shared_case(ps, window, seed)
    groups = cpu_kernels.cascade_plan()(table, row, start, end, ps)
    assert groups, "the case has no shared pages: it would test nothing"
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(2, blocks * ps, 64, generator=g).to(dtype)
    v = torch.randn(2, blocks * ps, 64, generator=g).to(dtype)
    q = torch.randn(len(row), 4, 64, generator=g)
    got = run(kernel, q, k, v, table, row, start, end, ps, 0.125, softcap, groups)
    want = torch.empty_like(q)
    cpu_kernels.cascade_decode_attention()(q, k, v, table, row, start, end, ps, 0.125, softcap, want)
    torch.testing.assert_close(got, want, atol=2e-6, rtol=1e-5)
    torch.testing.assert_close(got.double(), reference(q, k, v, table, row, start, end, ps, 0.125, softcap),
                               atol=2e-5, rtol=1e-5)


def test_a_grpo_sized_group_with_sinks(kernel):
    ps, shared, members, heads = 16, 5, 12, 8
    g = torch.Generator().manual_seed(3)
    blocks = shared + 3 * members + 1
    table = torch.zeros(members, shared + 3, dtype=torch.long)
    for i in range(members):
        table[i] = torch.tensor(list(range(shared)) + [shared + 3 * i + j for j in range(3)])
    table = torch.randperm(blocks, generator=g)[table]
    end = torch.tensor([shared * ps + 1 + (7 * i) % 40 for i in range(members)])
    row, start = torch.arange(members), torch.zeros(members, dtype=torch.long)
    groups = cpu_kernels.cascade_plan()(table, row, start, end, ps)
    assert len(groups) == 1 and groups[0][1] == shared and len(groups[0][2]) == members
    k = torch.randn(2, blocks * ps, 64, generator=g)
    v = torch.randn(2, blocks * ps, 64, generator=g)
    q = torch.randn(members, heads, 64, generator=g)
    sinks = torch.randn(heads, generator=g) * 2
    got = run(kernel, q, k, v, table, row, start, end, ps, 0.125, 0.0, groups, sinks)
    torch.testing.assert_close(got.double(), reference(q, k, v, table, row, start, end, ps, 0.125, 0.0, sinks),
                               atol=2e-5, rtol=1e-5)
    wrong = [(groups[0][0], groups[0][1] + 1, *groups[0][2:])]  # NOTE: one page too many counted as shared
    bad = run(kernel, q, k, v, table, row, start, end, ps, 0.125, 0.0, wrong, sinks)
    assert not torch.allclose(bad.double(), reference(q, k, v, table, row, start, end, ps, 0.125, 0.0, sinks),
                              atol=2e-5, rtol=1e-5)
