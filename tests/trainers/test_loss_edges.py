"""Edges of `trainers/losses.py` that the hand-value tests in `test_losses.py` left open.

Each test here kills mutants that survived `mutmut` on the losses (see tests/README.md): the ratio
computed against non-zero old logprobs, TIS against non-zero rollout logprobs, `approx_kl`, the low-clip
count at A = 0 and 0 < A < 1, `ratio_max` next to padding, empty batches, broadcasting masks, integer
and float64 dtypes kept, the defaults callers rely on, error messages, and the row chunking of the
fp32 upcast (a memory bound: no temporary of all rows at once).
"""

from __future__ import annotations

import math

import pytest
import torch
from support import numerics
from support.numerics import F64, t
from torch.utils._python_dispatch import TorchDispatchMode

from trainers.losses import (
    aggregate,
    clipped_policy_loss,
    entropy_from_logits,
    group_advantages,
    masked_mean,
    masked_sum,
    token_logprobs,
    truncated_importance_weights,
    value_loss,
)

ATOL = 1e-9  # this file's default closeness


def close(actual, expected, atol: float = ATOL) -> None:
    numerics.close(actual, expected, atol)


# --------------------------------------------------------------------------- reductions


def test_masked_sum_keeps_an_integer_dtype_exactly():
    # 2**40 + 1 is not a float32: a float zero in the `where` would promote and round it
    x = torch.tensor([[2**40 + 1, 7], [3, 5]])
    mask = torch.tensor([[True, False], [True, True]])
    total = masked_sum(x, mask)
    assert total.dtype == torch.int64 and total.item() == 2**40 + 9
    assert masked_sum(x, mask, dim=-1).tolist() == [2**40 + 1, 8]


def test_masked_mean_counts_a_broadcast_mask_and_a_broadcast_x():
    x = t([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    row_mask = torch.tensor([[True], [False]])  # [2, 1] -> the whole first row: 6 / 3
    close(masked_mean(x, row_mask), 2.0)
    close(masked_mean(x, row_mask, dim=-1), [2.0, 0.0])
    col = t([[10.0], [20.0]])  # [2, 1] against a [2, 3] mask: 10 counted twice, 20 once
    mask = torch.tensor([[True, True, False], [False, True, False]])
    close(masked_mean(col, mask), 40.0 / 3)
    close(masked_mean(col, mask, dim=-1), [10.0, 20.0])


def test_aggregate_defaults_to_token_mean_and_accepts_a_budget_of_one():
    per_token = t([[1.0, 2.0, 30.0], [4.0, 0.0, 0.0]])
    mask = torch.tensor([[True, True, False], [True, False, False]])
    close(aggregate(per_token, mask), 7.0 / 3)
    # norm_len 1 is a valid generation budget: the row sums divided by 1
    close(aggregate(per_token, mask, "seq_mean_token_sum_norm", norm_len=1), (3.0 + 4.0) / 2)
    with pytest.raises(ValueError, match="norm_len must be a positive int, got 0"):
        aggregate(per_token, mask, "seq_mean_token_sum_norm", norm_len=0)


# --------------------------------------------------------------------------- advantages


def test_group_advantages_errors_name_the_problem():
    with pytest.raises(ValueError, match=r"unknown scale 'mad'; valid: \['std', None\]"):
        group_advantages(torch.zeros(4), 2, scale="mad")
    with pytest.raises(ValueError, match=r"rewards must be 1-d \[N\], got shape \(2, 2\)"):
        group_advantages(torch.zeros(2, 2), 2)
    with pytest.raises(ValueError, match="5 rewards do not split into groups of 2"):
        group_advantages(torch.zeros(5), 2)


def test_group_advantages_keep_float64_and_accept_bool_rewards():
    # a float32 round trip would turn 1e9 + 0.5 into 1e9: the advantages would be 0
    rewards = t([1e9 + 0.5, 1e9 - 0.5])
    adv = group_advantages(rewards, 2, scale=None)
    assert adv.dtype == F64
    close(adv, [0.5, -0.5])
    passed = torch.tensor([True, False, False, False])  # a verifier's pass / fail
    adv = group_advantages(passed, 4, scale=None)
    assert adv.is_floating_point()
    close(adv, [0.75, -0.25, -0.25, -0.25], atol=1e-7)


def test_truncated_importance_weights_against_nonzero_rollout_logprobs_and_default_cap():
    old = t([[-1.0, -0.5, -3.0]])
    rollout = t([[-2.0, -0.5, -2.0]])
    # exp(old - rollout) = [e, 1, 1/e]; the default cap is 2
    close(truncated_importance_weights(old, rollout), [[2.0, 1.0, math.exp(-1.0)]])
    close(truncated_importance_weights(old, rollout, cap=10.0), [[math.e, 1.0, math.exp(-1.0)]])


# --------------------------------------------------------------------------- clipped policy loss


def test_clipped_policy_loss_ratio_is_against_nonzero_old_logprobs():
    # ratios exp(lp - old) = [1.5, 0.5] at lp = [-1, -2]; A = +1: -min(1.5, 1.2) = -1.2, -min(0.5, 0.8) = -0.5
    old = t([[-1.0 - math.log(1.5), -2.0 - math.log(0.5)]])
    logprobs = t([[-1.0, -2.0]], requires_grad=True)
    loss, metrics = clipped_policy_loss(logprobs, old, t([1.0]), torch.ones(1, 2, dtype=torch.bool))
    loss.backward()
    close(loss, (-1.2 - 0.5) / 2)
    close(metrics["ratio_mean"], 1.0)
    close(metrics["ratio_max"], 1.5)
    # the clipped token has no gradient; the other one -r * A / 2
    close(logprobs.grad, [[0.0, -0.25]])


def test_approx_kl_is_the_k3_estimate_over_valid_tokens():
    ratios = t([[2.0, 0.5, 1.0], [1.25, 9.0, 9.0]])
    mask = torch.tensor([[True, True, True], [True, False, False]])
    _, metrics = clipped_policy_loss(torch.log(ratios), torch.zeros_like(ratios), t([1.0, 1.0]), mask)
    # k3 of KL(old || new) per token: r - 1 - log r
    k3 = [r - 1 - math.log(r) for r in (2.0, 0.5, 1.0, 1.25)]
    close(metrics["approx_kl"], sum(k3) / 4)


def test_low_clip_counts_only_negative_advantages():
    # every ratio below 1 - 0.2; A = 0 and A = 0.5 are not clipped, A = -0.5 is
    ratios = t([[0.5, 0.5, 0.5]])
    adv = t([[0.0, 0.5, -0.5]])
    _, metrics = clipped_policy_loss(torch.log(ratios), torch.zeros_like(ratios), adv,
                                     torch.ones(1, 3, dtype=torch.bool))
    close(metrics["clip_low_fraction"], 1 / 3)
    close(metrics["clip_fraction"], 1 / 3)


def test_ratio_max_ignores_padding_when_every_ratio_is_below_one():
    ratios = t([[0.5, 0.75, 0.9]])
    mask = torch.tensor([[True, True, False]])
    _, metrics = clipped_policy_loss(torch.log(ratios), torch.zeros_like(ratios), t([1.0]), mask)
    close(metrics["ratio_max"], 0.75)


@pytest.mark.parametrize("shape", [(0, 3), (2, 0)])
def test_an_empty_batch_gives_zero_loss_and_zero_metrics(shape):
    logprobs = torch.zeros(shape, dtype=F64, requires_grad=True)
    adv = torch.zeros(shape[0], dtype=F64)
    loss, metrics = clipped_policy_loss(logprobs, torch.zeros(shape, dtype=F64), adv,
                                        torch.ones(shape, dtype=torch.bool))
    assert loss.item() == 0.0
    assert metrics["ratio_max"].shape == () and metrics["ratio_max"].item() == 0.0
    assert all(v.item() == 0.0 for v in metrics.values())


# --------------------------------------------------------------------------- value loss


def test_value_loss_default_clip_and_unclipped_hand_values():
    values = t([[2.0, 0.0]], requires_grad=True)
    old = t([[1.0, 0.0]])
    returns = t([[5.0, 1.0]])
    mask = torch.ones(1, 2, dtype=torch.bool)
    # no clip: 0.5 * ((2 - 5)^2 + (0 - 1)^2) / 2 = 2.5
    loss, _ = value_loss(values, old, returns, mask, clip=None)
    close(loss, 2.5)
    # default clip 0.2: tok0 clipped v 1.2 -> max(9, 14.44); tok1 v = old -> 1: 0.5 * 15.44 / 2
    loss, metrics = value_loss(values, old, returns, mask)
    close(loss, 0.5 * (14.44 + 1.0) / 2)
    close(metrics["value_clip_fraction"], 0.5)


# --------------------------------------------------------------------------- logits helpers


def test_logits_helpers_on_empty_rows_give_fp32_of_the_batch_shape():
    logits = torch.zeros(2, 0, 5, dtype=torch.bfloat16)
    for out in (entropy_from_logits(logits), token_logprobs(logits, torch.zeros(2, 0, dtype=torch.long))):
        assert out.shape == (2, 0) and out.dtype == torch.float32


class LargestFp32(TorchDispatchMode):
    """Records the largest fp32 tensor any op produces (the bf16 input's views are not the upcast)."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for o in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(o, torch.Tensor) and o.dtype == torch.float32:
                self.largest = max(self.largest, o.numel() * o.element_size())
        return out


def test_the_fp32_upcast_runs_4096_rows_at_a_time_by_default():
    """bf16 logits of 2 x 4100 rows: by default no fp32 temporary holds more than 4096 rows, and the
    values equal a plain fp32 computation over all rows."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 4100, 16, generator=g).to(torch.bfloat16)
    tokens = torch.randint(0, 16, (2, 4100), generator=g)
    bound = 4096 * 16 * 4
    with LargestFp32() as seen:
        ent = entropy_from_logits(logits)
    assert seen.largest <= bound, seen.largest
    with LargestFp32() as seen:
        lp = token_logprobs(logits, tokens)
    assert seen.largest <= bound, seen.largest
    ref = logits.float().log_softmax(-1)
    torch.testing.assert_close(ent, -(ref.exp() * ref).sum(-1), atol=1e-5, rtol=0)
    torch.testing.assert_close(lp, ref.gather(-1, tokens[..., None])[..., 0], atol=1e-5, rtol=0)
