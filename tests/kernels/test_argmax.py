"""`argmax_rows` (`rollout/kernels/csrc/argmax.cpp`) against torch's `argmax(dim=-1)`, index for index: ties, NaNs,
infinities, signed zeros, every tail length, and the sampler's greedy tokens through it."""

from __future__ import annotations

import pytest
import torch

from rollout.kernels import cpu_kernels
from rollout.requests import SamplingParams
from rollout.sampling.sampler import Sampler, row_argmax

argmax = cpu_kernels.argmax_rows()
pytestmark = pytest.mark.skipif(argmax is None, reason="rollout's C++ CPU kernels are unavailable here")


@pytest.mark.parametrize("V", [1, 2, 15, 16, 17, 31, 32, 33, 47, 48, 100, 4096, 32768 + 5])
def test_random_rows_and_ties(V):
    g = torch.Generator().manual_seed(V)
    x = torch.randn(9, V, generator=g)
    x[1] = 0.0  # all tied: index 0
    x[2] = torch.randint(0, 3, (V,), generator=g).float()  # many ties of the max
    x[3, -1] = 100.0  # the max in the tail
    x[4] = float("-inf")  # all -inf: index 0
    x[5, V // 2] = float("inf")
    x[6] = -0.0
    x[6, V - 1] = 0.0  # -0.0 and 0.0 are equal: the first wins
    x[7, V // 3] = float("nan")  # the first NaN wins over anything
    x[7, V - 1] = float("nan")
    x[8] = float("-inf")
    x[8, V - 1] = -1e30
    assert torch.equal(argmax(x), x.argmax(dim=-1))


def test_ties_across_lanes_take_the_first_index():
    x = torch.zeros(1, 64)
    x[0, [40, 7, 23, 63]] = 5.0  # lanes 8, 7, 7, 15 of the 16-wide pass
    assert int(argmax(x)) == 7
    x = torch.zeros(1, 64)
    x[0, [49, 18]] = 5.0  # lane 1 holds index 49, lane 2 index 18: the lower lane does not win, the first index does
    assert int(argmax(x)) == 18


def test_many_rows_split_across_threads_and_views():
    x = torch.randn(300, 777)
    assert torch.equal(argmax(x), x.argmax(dim=-1))
    wide = torch.randn(8, 1000)
    view = wide[:, 100:900]  # not contiguous
    assert torch.equal(argmax(view), view.argmax(dim=-1))


def test_bad_input_is_refused():
    with pytest.raises(RuntimeError, match="argmax_rows"):
        argmax(torch.randn(4, 8, dtype=torch.float64))
    with pytest.raises(RuntimeError, match="argmax_rows"):
        argmax(torch.randn(8))
    with pytest.raises(RuntimeError, match="argmax_rows"):
        argmax(torch.randn(3, 0))


def test_row_argmax_falls_back_where_the_kernel_does_not_apply():
    for x in (torch.randn(4, 10, dtype=torch.bfloat16), torch.randn(4, 10, dtype=torch.float64), torch.randn(2, 3, 10)):
        assert torch.equal(row_argmax(x), x.argmax(dim=-1))


def test_greedy_sampler_tokens_equal_torch_argmax():
    torch.manual_seed(0)
    logits = torch.randn(6, 5000)
    logits[2, [10, 4000]] = 50.0  # a tie: the first
    params = [SamplingParams(temperature=0.0) for _ in range(6)]
    out = Sampler(torch.device("cpu"), seed=0)(logits, params, [f"r{i}" for i in range(6)], None)
    assert out.tokens == logits.argmax(dim=-1).tolist()
    assert out.tokens[2] == 10


def _greedy_verify_reference(x: torch.Tensor, lens: list[int], drafts: list[int]) -> list[float]:
    """What `greedy_verify` returns, by definition: torch's argmax and log_softmax, position after position."""
    am, lp = x.argmax(dim=-1).tolist(), torch.log_softmax(x.double(), dim=-1)
    out, p, d0 = [-1.0, 0.0] * x.shape[0], 0, 0
    for n in lens:
        for j in range(n):
            out[2 * (p + j)], out[2 * (p + j) + 1] = float(am[p + j]), float(lp[p + j, am[p + j]])
            if j == n - 1 or drafts[d0 + j] != am[p + j]:
                break
        p, d0 = p + n, d0 + n - 1
    return out


@pytest.mark.parametrize("V", [1, 5, 16, 17, 100, 4096, 32768 + 5])
def test_greedy_verify_stops_at_the_first_rejected_draft(V):
    """Each row's argmax position after position (torch's, index for index) until its drafted token differs, the
    emitted positions' log-softmax at the argmax within float rounding of torch's (large and small logits, ties),
    the positions after a row's stop (-1, 0)."""
    kernel = cpu_kernels.greedy_verify()
    g = torch.Generator().manual_seed(V)
    for trial in range(20):
        lens = torch.randint(1, 10, (1 + trial % 5,), generator=g).tolist()
        x = torch.randn(sum(lens), V, generator=g) * [0.1, 1.0, 30.0, 300.0][trial % 4]
        if trial % 5 == 4:
            x = torch.randint(-2, 2, x.shape, generator=g).float()  # ties of the max
        am = x.argmax(dim=-1).tolist()
        drafts, p = [], 0
        for n in lens:  # NOTE: drafts mostly right: rows stop anywhere, or run to their end
            drafts += [am[p + j] if torch.rand(1, generator=g) < 0.8 else (am[p + j] + 1) % V for j in range(n - 1)]
            p += n
        got, want = kernel(x, lens, drafts, True), _greedy_verify_reference(x, lens, drafts)
        assert got[0::2] == want[0::2], trial
        assert max(abs(a - b) / max(1.0, abs(b)) for a, b in zip(got[1::2], want[1::2], strict=True)) < 1e-6, trial
        assert kernel(x, lens, drafts, False)[0::2] == want[0::2]
    with pytest.raises(RuntimeError, match="lens sum"):
        kernel(torch.zeros(3, V), [2], [0], True)
