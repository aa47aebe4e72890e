"""Losses, aggregations, advantage estimators and the algorithm registry against hand-computed numbers."""

from __future__ import annotations

import dataclasses
import math
import subprocess
import sys

import pytest
import torch
from support import numerics
from support.numerics import F64, t

from trainers.algorithms import ALGORITHMS, Algorithm, get_algorithm, nonconstant_group_mask
from trainers.losses import (
    clipped_policy_loss,
    entropy_from_logits,
    gae,
    group_advantages,
    kl_k3,
    masked_mean,
    masked_sum,
    token_logprobs,
    truncated_importance_weights,
    value_loss,
)

ATOL = 1e-5  # this file's default closeness


def close(actual, expected, atol: float = ATOL) -> None:
    numerics.close(actual, expected, atol)


# --------------------------------------------------------------------------- masked reductions


def test_masked_sum_and_mean_hand_values():
    x = t([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [7.0, 8.0, 9.0]])  # [3, 3]
    mask = t([[1, 1, 0], [1, 0, 0], [0, 0, 0]], dtype=torch.bool)  # [3, 3]
    close(masked_sum(x, mask), 7.0)
    close(masked_mean(x, mask), 7.0 / 3.0)
    close(masked_sum(x, mask, dim=-1), [3.0, 4.0, 0.0])
    # an all-masked row has mean 0, not NaN
    close(masked_mean(x, mask, dim=-1), [1.5, 4.0, 0.0])
    close(masked_mean(x, mask, dim=0), [2.5, 2.0, 0.0])


def test_masked_reductions_ignore_nan_and_inf_under_the_mask():
    x = t([[1.0, float("nan"), float("inf")]], requires_grad=True)
    mask = t([[1, 0, 0]], dtype=torch.bool)
    out = masked_mean(x, mask)
    out.backward()
    close(out, 1.0)
    assert x.grad.tolist() == [[1.0, 0.0, 0.0]]


def test_masked_mean_accepts_float_mask_and_empty_selection():
    x = t([2.0, 4.0])
    close(masked_mean(x, t([1.0, 0.0])), 2.0)
    close(masked_mean(x, t([0.0, 0.0])), 0.0)


# --------------------------------------------------------------------------- group advantages


def test_group_advantages_std_scaled_hand_values():
    # group [1, 0, 1, 0]: mean 0.5, unbiased std sqrt(1/3) = 0.577350 -> +-0.5 / 0.577350 = +-0.866025
    # group [3, 3, 3, 3]: all equal -> 0 (std 0, divided by eps)
    rewards = t([1.0, 0.0, 1.0, 0.0, 3.0, 3.0, 3.0, 3.0])
    adv = group_advantages(rewards, group_size=4, scale="std")
    close(adv, [0.866025, -0.866025, 0.866025, -0.866025, 0, 0, 0, 0])


def test_group_advantages_groups_are_contiguous_and_eps_is_added_to_std():
    # groups [0, 2] and [5, 5]; std of [0, 2] is sqrt(2) = 1.414214
    rewards = t([0.0, 2.0, 5.0, 5.0])
    close(group_advantages(rewards, 2, scale="std"), [-0.707107, 0.707107, 0.0, 0.0])
    # eps = 1: -1 / (1.414214 + 1) = -0.414214
    close(group_advantages(rewards, 2, scale="std", eps=1.0), [-0.414214, 0.414214, 0.0, 0.0])
    close(group_advantages(rewards, 2, scale=None), [-1.0, 1.0, 0.0, 0.0])


def test_group_advantages_unscaled_and_int_rewards_and_group_of_one():
    adv = group_advantages(torch.tensor([1, 0, 0, 0, 1, 1]), group_size=3, scale=None)
    assert adv.is_floating_point()
    close(adv, [2 / 3, -1 / 3, -1 / 3, -2 / 3, 1 / 3, 1 / 3])
    # a group of one carries no signal and must not be NaN
    assert group_advantages(t([1.0, 5.0]), group_size=1).tolist() == [0.0, 0.0]


@pytest.mark.parametrize(
    ("n", "group_size", "scale"),
    [(5, 2, "std"), (4, 0, "std"), (4, 3, None), (4, 2, "zscore"), (4, 2, "mean")],
)
def test_group_advantages_value_errors(n, group_size, scale):
    with pytest.raises(ValueError):
        group_advantages(torch.zeros(n), group_size, scale=scale)


def test_group_advantages_rejects_2d_rewards():
    with pytest.raises(ValueError):
        group_advantages(torch.zeros(2, 2), 2)


# --------------------------------------------------------------------------- clipped policy loss
#
# Hand example, clip 0.2 / 0.2, old logprobs 0 so ratio = exp(logprobs):
#   row 0, A = +1, ratios [1.0, 1.5, 0.5], all valid
#       r=1.0: -min(1.0, 1.0)            = -1.0
#       r=1.5: -min(1.5, 1.2)            = -1.2   clip active (high)
#       r=0.5: -min(0.5, 0.8)            = -0.5   not active (low side, positive A)
#   row 1, A = -2, ratios [0.5, 2.0, <garbage>], last token padded
#       r=0.5: -min(-1.0, 0.8 * -2)      =  1.6   clip active (low)
#       r=2.0: -min(-4.0, 1.2 * -2)      =  4.0   not active (high side, negative A)
#   token_mean              = (-2.7 + 5.6) / 5            = 0.58
#   seq_mean_token_mean     = mean(-2.7 / 3, 5.6 / 2)     = mean(-0.9, 2.8) = 0.95
#   seq_mean_token_sum_norm = mean(-2.7 / 3, 5.6 / 3)     = 2.9 / 6 = 0.483333
#   clip_fraction 2/5, ratio_mean (1 + 1.5 + 0.5 + 0.5 + 2) / 5 = 1.1, ratio_max 2.0


def hand_case(extra_empty_row: bool = False):
    ratios = [[1.0, 1.5, 0.5], [0.5, 2.0, 1.0]]
    mask = [[1, 1, 1], [1, 1, 0]]
    advantages = [1.0, -2.0]
    if extra_empty_row:
        ratios.append([3.0, 3.0, 3.0])
        mask.append([0, 0, 0])
        advantages.append(5.0)
    logprobs = torch.log(t(ratios))
    logprobs[1, 2] = 1000.0  # garbage at a padded position: exp would overflow to inf
    logprobs.requires_grad_(True)
    old = torch.zeros_like(logprobs)
    return logprobs, old, t(advantages), t(mask, dtype=torch.bool)


@pytest.mark.parametrize(
    ("agg", "expected"),
    [("token_mean", 0.58), ("seq_mean_token_mean", 0.95), ("seq_mean_token_sum_norm", 2.9 / 6)],
)
def test_clipped_policy_loss_aggregations_hand_values(agg, expected):
    logprobs, old, adv, mask = hand_case()
    loss, metrics = clipped_policy_loss(logprobs, old, adv, mask, agg=agg)
    close(loss, expected)
    close(metrics["clip_fraction"], 0.4)
    close(metrics["clip_low_fraction"], 0.2)
    close(metrics["clip_high_fraction"], 0.2)
    close(metrics["ratio_mean"], 1.1)
    close(metrics["ratio_max"], 2.0)
    assert loss.ndim == 0
    for value in metrics.values():
        assert value.ndim == 0 and not value.requires_grad


def test_clipped_policy_loss_gradient_hand_values_and_padding_gets_zero_gradient():
    # d(-r*A)/d(logprob) = -r*A on the unclipped path, 0 where the clip is active; token_mean / 5.
    logprobs, old, adv, mask = hand_case()
    loss, _ = clipped_policy_loss(logprobs, old, adv, mask, agg="token_mean")
    loss.backward()
    assert torch.isfinite(loss)
    close(logprobs.grad, [[-1.0 / 5, 0.0, -0.5 / 5], [0.0, 4.0 / 5, 0.0]])
    assert logprobs.grad[1, 2].item() == 0.0  # exactly zero, not NaN


@pytest.mark.parametrize(
    ("agg", "expected"),
    [("token_mean", 0.58), ("seq_mean_token_mean", 0.95), ("seq_mean_token_sum_norm", 2.9 / 9)],
)
def test_sequence_with_no_tokens_is_finite_and_left_out_of_the_mean(agg, expected):
    # seq_mean_token_mean skips empty rows; Dr. GRPO keeps its constant normaliser (N rows, T).
    logprobs, old, adv, mask = hand_case(extra_empty_row=True)
    loss, metrics = clipped_policy_loss(logprobs, old, adv, mask, agg=agg)
    loss.backward()
    close(loss, expected)
    close(metrics["clip_fraction"], 0.4)
    assert torch.isfinite(logprobs.grad).all()
    assert logprobs.grad[2].tolist() == [0.0, 0.0, 0.0]


@pytest.mark.parametrize("agg", ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"])
def test_all_masked_batch_gives_zero_loss_not_nan(agg):
    logprobs = torch.randn(2, 3, dtype=F64, requires_grad=True)
    mask = torch.zeros(2, 3, dtype=torch.bool)
    loss, metrics = clipped_policy_loss(logprobs, torch.zeros(2, 3, dtype=F64), t([1.0, -1.0]), mask, agg=agg)
    loss.backward()
    assert loss.item() == 0.0
    assert metrics["clip_fraction"].item() == 0.0 and metrics["ratio_mean"].item() == 0.0
    assert logprobs.grad.abs().sum().item() == 0.0


def test_per_token_advantages_match_broadcast_sequence_advantages():
    logprobs, old, adv, mask = hand_case()
    loss_seq, _ = clipped_policy_loss(logprobs, old, adv, mask, agg="seq_mean_token_mean")
    loss_tok, _ = clipped_policy_loss(
        logprobs, old, adv[:, None].expand(2, 3), mask, agg="seq_mean_token_mean"
    )
    close(loss_tok, loss_seq.item())
    # and per-token values really are used per token: row 0 A = [1, 0, -1] ->
    # tokens: -min(1, 1) = -1 ; 0 ; r=0.5, A=-1: -min(-0.5, -0.8) = 0.8 -> row 0 sum -0.2
    # row 1 as before: 5.6 -> token_mean = 5.4 / 5 = 1.08
    per_token_adv = t([[1.0, 0.0, -1.0], [-2.0, -2.0, -2.0]])
    loss, metrics = clipped_policy_loss(logprobs, old, per_token_adv, mask)
    close(loss, 1.08)
    close(metrics["clip_fraction"], 0.4)  # row 0 token 2 is clipped low now; token 1 (A=0) is not


@pytest.mark.parametrize(
    ("ratio", "advantage", "loss", "grad", "clipped"),
    [
        # exactly on the edge: the clip is not active, the full gradient -r*A flows
        (1.2, 1.0, -1.2, -1.2, 0.0),
        (0.8, -1.0, 0.8, 0.8, 0.0),
        # just past the edge, on the side where the clip bites: constant loss, zero gradient
        (1.2 + 1e-6, 1.0, -1.2, 0.0, 1.0),
        (0.8 - 1e-6, -1.0, 0.8, 0.0, 1.0),
        # past the edge on the side where it does not bite: unclipped term, full gradient
        (1.5, -1.0, 1.5, 1.5, 0.0),
        (0.5, 1.0, -0.5, -0.5, 0.0),
        # inside the trust region
        (1.1, -3.0, 3.3, 3.3, 0.0),
    ],
)
def test_clip_edges_symmetric(ratio, advantage, loss, grad, clipped):
    logprobs = torch.log(t([[ratio]])).requires_grad_(True)
    out, metrics = clipped_policy_loss(
        logprobs, torch.zeros(1, 1, dtype=F64), t([advantage]), torch.ones(1, 1, dtype=torch.bool)
    )
    out.backward()
    close(out, loss, atol=1e-5)
    close(logprobs.grad, [[grad]], atol=1e-5)
    assert metrics["clip_fraction"].item() == clipped


@pytest.mark.parametrize(
    ("ratio", "advantage", "loss", "clipped"),
    [
        (1.25, 1.0, -1.25, 0.0),  # would be clipped at 1.2; clip_high 0.28 lets it through
        (1.28, 1.0, -1.28, 0.0),  # exactly at 1 + clip_high
        (1.3, 1.0, -1.28, 1.0),
        (0.75, -1.0, 0.8, 1.0),  # the low side still clips at 1 - 0.2
        (0.8, -1.0, 0.8, 0.0),
    ],
)
def test_clip_edges_asymmetric(ratio, advantage, loss, clipped):
    logprobs = torch.log(t([[ratio]]))
    out, metrics = clipped_policy_loss(
        logprobs,
        torch.zeros(1, 1, dtype=F64),
        t([advantage]),
        torch.ones(1, 1, dtype=torch.bool),
        clip_low=0.2,
        clip_high=0.28,
    )
    close(out, loss, atol=1e-6)
    assert metrics["clip_fraction"].item() == clipped


def test_clip_fraction_constructed_case():
    # 8 valid tokens (+1 padded, clipped-looking, must not count):
    # clipped: (1.5, +), (0.5, -), (3.0, +)   not: (1.5, -), (0.5, +), (1.0, +), (1.19, +), (0.81, -)
    ratios = t([[1.5, 0.5, 3.0, 1.5, 0.5], [1.0, 1.19, 0.81, 9.0, 9.0]])
    adv = t([[1.0, -1.0, 1.0, -1.0, 1.0], [1.0, 1.0, -1.0, 1.0, 1.0]])
    mask = t([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]], dtype=torch.bool)
    _, metrics = clipped_policy_loss(torch.log(ratios), torch.zeros_like(ratios), adv, mask)
    close(metrics["clip_fraction"], 3 / 8)
    close(metrics["clip_high_fraction"], 2 / 8)
    close(metrics["clip_low_fraction"], 1 / 8)


def test_zero_advantages_give_zero_loss_and_zero_gradient():
    logprobs = torch.randn(3, 4, dtype=F64, requires_grad=True)
    old = torch.randn(3, 4, dtype=F64)
    mask = torch.ones(3, 4, dtype=torch.bool)
    for agg in ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"):
        logprobs.grad = None
        loss, _ = clipped_policy_loss(logprobs, old, torch.zeros(3, dtype=F64), mask, agg=agg)
        loss.backward()
        assert loss.item() == 0.0
        assert logprobs.grad.abs().max().item() == 0.0


def test_gradient_flows_only_into_logprobs():
    logprobs, old, adv, mask = hand_case()
    old.requires_grad_(True)
    adv.requires_grad_(True)
    loss, _ = clipped_policy_loss(logprobs, old, adv, mask)
    loss.backward()
    assert old.grad is None and adv.grad is None


def test_unknown_aggregation_raises():
    logprobs, old, adv, mask = hand_case()
    with pytest.raises(ValueError, match="token_mean"):
        clipped_policy_loss(logprobs, old, adv, mask, agg="sequence_sum")


# --------------------------------------------------------------------------- TIS and KL


def test_truncated_importance_weights_hand_values_and_detached():
    old = torch.log(t([[1.0, 3.0, 0.5]])).requires_grad_(True)
    rollout = torch.zeros(1, 3, dtype=F64)
    w = truncated_importance_weights(old, rollout, cap=2.0)
    close(w, [[1.0, 2.0, 0.5]])
    assert not w.requires_grad
    close(truncated_importance_weights(old, rollout, cap=5.0), [[1.0, 3.0, 0.5]])


def test_tis_weights_multiply_the_per_token_loss():
    # per-token losses [[-1, -1.2, -0.5], [1.6, 4.0, pad]] x weights [[1, 2, 0.5], [2, 1, 7]]
    # = [[-1, -2.4, -0.25], [3.2, 4.0]] -> token_mean 3.55 / 5 = 0.71
    logprobs, old, adv, mask = hand_case()
    weights = t([[1.0, 2.0, 0.5], [2.0, 1.0, 7.0]])
    loss, _ = clipped_policy_loss(logprobs, old, adv, mask, tis_weights=weights)
    loss.backward()
    close(loss, 0.71)
    # gradient scales with the weight too: row 0 token 0 -1 * 1 / 5, row 1 token 1 4 * 1 / 5
    close(logprobs.grad, [[-0.2, 0.0, -0.5 * 0.5 / 5], [0.0, 0.8, 0.0]])


def test_kl_k3_hand_values():
    logprobs = t([[0.0, 0.0, -1.0]])
    ref = t([[math.log(2.0), math.log(0.5), -1.0]])
    # d = ref - lp: exp(d) - d - 1 -> 2 - 0.693147 - 1 ; 0.5 + 0.693147 - 1 ; 0
    close(kl_k3(logprobs, ref), [[0.306853, 0.193147, 0.0]])


def test_kl_k3_mask_zeroes_garbage_positions_and_their_gradient():
    logprobs = t([[0.0, -1000.0]], requires_grad=True)
    ref = t([[math.log(2.0), 0.0]])
    kl = kl_k3(logprobs, ref, mask=t([[1, 0]], dtype=torch.bool))
    kl.sum().backward()
    close(kl, [[0.306853, 0.0]])
    # d/dlp = 1 - exp(ref - lp) = 1 - 2 = -1 on the valid token, exactly 0 on the masked one
    close(logprobs.grad, [[-1.0, 0.0]])
    assert torch.isfinite(logprobs.grad).all()


# --------------------------------------------------------------------------- GAE


def test_gae_three_steps_hand_values():
    # gamma 0.9, lam 0.8, rewards [0, 0, 1], values [0.5, 0.6, 0.7], no bootstrap after the end
    #   t=2: delta = 1 - 0.7 = 0.3                    A = 0.3
    #   t=1: delta = 0.9 * 0.7 - 0.6 = 0.03           A = 0.03 + 0.72 * 0.3 = 0.246
    #   t=0: delta = 0.9 * 0.6 - 0.5 = 0.04           A = 0.04 + 0.72 * 0.246 = 0.21712
    # row 1 right-padded: rewards [0, 1, (5)], values [0.5, 0.2, (9)]
    #   t=1: delta = 1 - 0.2 = 0.8                    A = 0.8
    #   t=0: delta = 0.9 * 0.2 - 0.5 = -0.32          A = -0.32 + 0.72 * 0.8 = 0.256
    rewards = t([[0.0, 0.0, 1.0], [0.0, 1.0, 5.0]])
    values = t([[0.5, 0.6, 0.7], [0.5, 0.2, 9.0]])
    mask = t([[1, 1, 1], [1, 1, 0]], dtype=torch.bool)
    adv, ret = gae(rewards, values, mask, gamma=0.9, lam=0.8)
    close(adv, [[0.21712, 0.246, 0.3], [0.256, 0.8, 0.0]])
    close(ret, [[0.71712, 0.846, 1.0], [0.756, 1.0, 0.0]])


def test_gae_defaults_gamma_1_lam_095():
    #   A2 = 0.3 ; A1 = (0.7 - 0.6) + 0.95 * 0.3 = 0.385 ; A0 = (0.6 - 0.5) + 0.95 * 0.385 = 0.46575
    adv, ret = gae(t([[0.0, 0.0, 1.0]]), t([[0.5, 0.6, 0.7]]), torch.ones(1, 3, dtype=torch.bool))
    close(adv, [[0.46575, 0.385, 0.3]])
    close(ret, [[0.96575, 0.985, 1.0]])


def test_gae_lam_1_gamma_1_returns_are_the_reward_to_go():
    rewards = t([[0.5, 0.0, 2.0, 1.0]])
    values = t([[3.0, -1.0, 0.25, 7.0]])
    _, ret = gae(rewards, values, torch.ones(1, 4, dtype=torch.bool), gamma=1.0, lam=1.0)
    close(ret, [[3.5, 3.0, 3.0, 1.0]])


def test_gae_skips_interior_masked_tokens():
    # mask [1, 0, 1]: the hole passes value and advantage through untouched
    #   t=2: A = 1 - 0.7 = 0.3 ; t=0: delta = 0.9 * 0.7 - 0.5 = 0.13, A = 0.13 + 0.72 * 0.3 = 0.346
    adv, ret = gae(
        t([[0.0, 7.0, 1.0]]), t([[0.5, 9.0, 0.7]]), t([[1, 0, 1]], dtype=torch.bool), gamma=0.9, lam=0.8
    )
    close(adv, [[0.346, 0.0, 0.3]])
    close(ret, [[0.846, 0.0, 1.0]])


def test_gae_outputs_carry_no_gradient():
    values = t([[0.5, 0.6]], requires_grad=True)
    adv, ret = gae(t([[0.0, 1.0]]), values, torch.ones(1, 2, dtype=torch.bool))
    assert not adv.requires_grad and not ret.requires_grad


# --------------------------------------------------------------------------- value loss


def test_value_loss_hand_values_and_gradient():
    # tok0: v=1, old=1, R=2 -> both terms 1             -> 0.5
    # tok1: v=2, old=1 -> clipped v 1.2; max(1, 3.24)   -> 1.62  (clipped term wins)
    # tok2: v=0, old=0.5 -> clipped v 0.3; max(0, 0.09) -> 0.045 (clipped term wins)
    # tok3 padded. token_mean = 2.165 / 3 = 0.721667
    values = t([[1.0, 2.0, 0.0, 50.0]], requires_grad=True)
    old = t([[1.0, 1.0, 0.5, 0.0]])
    returns = t([[2.0, 3.0, 0.0, 0.0]])
    mask = t([[1, 1, 1, 0]], dtype=torch.bool)
    loss, metrics = value_loss(values, old, returns, mask, clip=0.2)
    loss.backward()
    close(loss, 2.165 / 3)
    close(metrics["value_clip_fraction"], 2 / 3)
    close(metrics["value_mean"], 1.0)
    # where the clipped (constant) term wins there is no gradient; tok0: (v - R) / 3
    close(values.grad, [[-1 / 3, 0.0, 0.0, 0.0]])


def test_value_loss_without_clip_and_seq_aggregation():
    values = t([[1.0, 2.0, 0.0]])
    old = t([[1.0, 1.0, 0.5]])
    returns = t([[2.0, 3.0, 0.0]])
    mask = t([[1, 1, 0]], dtype=torch.bool)
    loss, metrics = value_loss(values, old, returns, mask, clip=None)
    close(loss, 0.5)  # 0.5 * (1 + 1) / 2
    close(metrics["value_clip_fraction"], 0.0)
    loss, _ = value_loss(values, old, returns, mask, clip=0.2, agg="seq_mean_token_sum_norm")
    close(loss, (0.5 + 1.62) / 3)


# --------------------------------------------------------------------------- logits helpers


def test_entropy_from_logits_hand_values():
    probs = t([0.1, 0.2, 0.3, 0.4])
    logits = torch.stack([torch.log(probs), torch.zeros(4, dtype=F64)]).view(1, 2, 4)  # [1, 2, 4]
    # -(0.1 ln 0.1 + 0.2 ln 0.2 + 0.3 ln 0.3 + 0.4 ln 0.4) = 1.279854 ; uniform over 4 = ln 4
    ent = entropy_from_logits(logits)
    assert ent.shape == (1, 2) and ent.dtype == torch.float32
    close(ent, [[1.279854, math.log(4.0)]], atol=1e-5)


def test_token_logprobs_hand_values_fp32_and_chunking():
    probs = t([0.1, 0.2, 0.3, 0.4])
    logits = torch.log(probs).repeat(2, 3, 1).to(torch.bfloat16)  # [2, 3, 4]
    tokens = torch.tensor([[3, 0, 1], [2, 2, 3]])
    lp = token_logprobs(logits, tokens, chunk_size=None)
    assert lp.shape == (2, 3) and lp.dtype == torch.float32
    expected = [[math.log(0.4), math.log(0.1), math.log(0.2)], [math.log(0.3), math.log(0.3), math.log(0.4)]]
    close(lp, expected, atol=1e-2)  # bf16 inputs
    for chunk in (1, 2, 5, 100):
        assert torch.equal(token_logprobs(logits, tokens, chunk_size=chunk), lp)
        assert torch.equal(entropy_from_logits(logits, chunk_size=chunk), entropy_from_logits(logits, None))


def test_token_logprobs_gradient_matches_log_softmax():
    logits = torch.randn(2, 3, 5, dtype=torch.float32, requires_grad=True)
    tokens = torch.randint(0, 5, (2, 3))
    token_logprobs(logits, tokens, chunk_size=2).sum().backward()
    ours = logits.grad.clone()
    logits.grad = None
    torch.log_softmax(logits, -1).gather(-1, tokens[..., None]).sum().backward()
    torch.testing.assert_close(ours, logits.grad)


# --------------------------------------------------------------------------- algorithms


def test_algorithm_registry_entries():
    grpo, dr, dapo, ppo = (get_algorithm(n) for n in ("grpo", "dr_grpo", "dapo", "ppo"))
    assert (grpo.advantage_scale, grpo.agg, grpo.clip_low, grpo.clip_high) == (
        "std",
        "seq_mean_token_mean",
        0.2,
        0.2,
    )
    assert (dr.advantage_scale, dr.agg) == (None, "seq_mean_token_sum_norm")
    assert (dapo.agg, dapo.clip_low, dapo.clip_high, dapo.drop_constant_groups) == (
        "token_mean",
        0.2,
        0.28,
        True,
    )
    assert ppo.use_gae and ppo.agg == "token_mean"
    assert not (grpo.use_gae or dr.use_gae or dapo.use_gae)
    assert not (grpo.drop_constant_groups or dr.drop_constant_groups or ppo.drop_constant_groups)
    assert set(ALGORITHMS) == {"grpo", "dr_grpo", "dapo", "ppo"}


def test_algorithm_advantages_follow_scale():
    rewards = t([0.0, 2.0, 5.0, 5.0])
    close(get_algorithm("grpo").advantages(rewards, 2), [-0.707107, 0.707107, 0.0, 0.0])
    close(get_algorithm("dr_grpo").advantages(rewards, 2), [-1.0, 1.0, 0.0, 0.0])


def test_get_algorithm_unknown_name_lists_valid_names():
    with pytest.raises(ValueError) as err:
        get_algorithm("reinforce")
    for name in ("grpo", "dr_grpo", "dapo", "ppo"):
        assert name in str(err.value)


def test_algorithm_is_frozen_and_validated():
    with pytest.raises(dataclasses.FrozenInstanceError):
        get_algorithm("grpo").clip_low = 0.5  # type: ignore[misc]
    with pytest.raises(ValueError):
        Algorithm("x", advantage_scale="std", agg="nope", clip_low=0.2, clip_high=0.2)
    with pytest.raises(ValueError):
        Algorithm("x", advantage_scale="rank", agg="token_mean", clip_low=0.2, clip_high=0.2)
    with pytest.raises(ValueError):
        Algorithm("x", advantage_scale=None, agg="token_mean", clip_low=1.0, clip_high=0.2)


def test_dapo_drops_constant_groups():
    rewards = t([1.0, 1.0, 1.0, 0.0, 1.0, 0.0, 2.0, 2.0, 2.0, 0.0, 0.0, 0.5])
    expected = [False] * 3 + [True] * 3 + [False] * 3 + [True] * 3
    assert nonconstant_group_mask(rewards, 3).tolist() == expected
    assert get_algorithm("dapo").keep_mask(rewards, 3).tolist() == expected
    assert get_algorithm("grpo").keep_mask(rewards, 3).tolist() == [True] * 12
    with pytest.raises(ValueError):
        nonconstant_group_mask(rewards, 5)


def test_trainers_package_exports_lazily_without_torch():
    code = "import sys, trainers; assert 'torch' not in sys.modules, 'eager torch import'"
    subprocess.run([sys.executable, "-c", code], check=True)
    import trainers

    assert trainers.clipped_policy_loss is clipped_policy_loss
    assert trainers.get_algorithm is get_algorithm
    with pytest.raises(AttributeError):
        _ = trainers.not_a_thing


# ------------------------------------------------------------------- Dr. GRPO's constant length


def test_dr_grpo_norm_len_is_a_constant_divisor():
    logprobs, old, adv, mask = hand_case()
    loss, _ = clipped_policy_loss(logprobs, old, adv, mask, agg="seq_mean_token_sum_norm", norm_len=10)
    close(loss, 2.9 / 20)  # mean(-2.7 / 10, 5.6 / 10)
    with pytest.raises(ValueError, match="norm_len"):
        clipped_policy_loss(logprobs, old, adv, mask, agg="seq_mean_token_sum_norm", norm_len=0)


def test_dr_grpo_row_gradient_does_not_depend_on_the_other_rows_lengths():
    """Padding the batch wider (a longer other row) must leave row 0's gradient alone with norm_len;
    without it (divisor = padded T) the gradient shrinks as the batch gets wider."""

    def row0_grad(width: int, norm_len: int | None) -> torch.Tensor:
        logprobs = torch.zeros(2, width, dtype=F64, requires_grad=True)
        mask = torch.zeros(2, width, dtype=torch.bool)
        mask[0, :2] = True
        mask[1, :width] = True  # the other row fills the padded width
        loss, _ = clipped_policy_loss(
            logprobs, torch.zeros_like(logprobs), t([1.0, -1.0]), mask, agg="seq_mean_token_sum_norm",
            norm_len=norm_len,
        )
        loss.backward()
        return logprobs.grad[0, :2]

    close(row0_grad(3, 16), row0_grad(9, 16).tolist())
    close(row0_grad(3, 16), [-1.0 / 32, -1.0 / 32])  # -A / (N x norm_len)
    assert not torch.allclose(row0_grad(3, None), row0_grad(9, None))


# ------------------------------------------------------------------ unscorable rows (TRL's None)


def test_group_advantages_leave_nan_rewards_out_and_give_them_zero():
    rewards = t([1.0, math.nan, 3.0, 0.0, 0.0, 1.0])
    adv = group_advantages(rewards, 3, scale="std", eps=0.0)
    # group 0: present [1, 3], mean 2, unbiased std sqrt(2); group 1: [0, 0, 1], mean 1/3, std 1/sqrt(3)
    close(
        adv,
        [-1 / math.sqrt(2), 0.0, 1 / math.sqrt(2), -1 / 3 * math.sqrt(3), -1 / 3 * math.sqrt(3), 2 / 3 * math.sqrt(3)],
    )
    close(group_advantages(rewards, 3, scale=None), [-1.0, 0.0, 1.0, -1 / 3, -1 / 3, 2 / 3])
    # a constant group with a NaN carries no signal for DAPO either
    assert nonconstant_group_mask(t([2.0, math.nan, 2.0, 0.0, 1.0, math.nan]), 3).tolist() == [False] * 3 + [True] * 3
