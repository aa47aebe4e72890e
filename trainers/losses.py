"""Pure loss and advantage functions for GRPO / Dr. GRPO / DAPO / PPO.

Every function maps tensors to tensors (plus a metrics dict for the losses); none logs,
touches an optimizer or reads global state. Shapes: ``N`` sequences (rows), ``T`` padded
response length, ``V`` vocabulary. Masks are boolean (or 0/1) ``[N, T]`` tensors marking the
tokens that count; every reduction goes through :func:`masked_sum` / :func:`masked_mean`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

Metrics = dict[str, Tensor]
Aggregation = Callable[..., Tensor]  # (per_token [N, T], mask [N, T], norm_len) -> []


# --------------------------------------------------------------------------- reductions


def masked_sum(x: Tensor, mask: Tensor, dim: int | tuple[int, ...] | None = None) -> Tensor:
    """Sum of ``x`` over the positions where ``mask`` is set.

    ``x`` and ``mask`` broadcast together. Masked positions are selected away (not multiplied
    by 0), so a NaN or inf there never reaches the result and gets exactly zero gradient.
    """
    # x: [*], mask: [*] (bool or 0/1)
    selected = torch.where(mask.bool(), x, torch.zeros((), dtype=x.dtype, device=x.device))  # [*]
    return selected.sum() if dim is None else selected.sum(dim=dim)


def masked_mean(x: Tensor, mask: Tensor, dim: int | tuple[int, ...] | None = None) -> Tensor:
    """Mean of ``x`` over the positions where ``mask`` is set; 0 where nothing is set."""
    # x: [*], mask: [*] (bool or 0/1)
    count_mask = torch.broadcast_to(mask.bool(), torch.broadcast_shapes(x.shape, mask.shape))  # [*]
    count = count_mask.sum() if dim is None else count_mask.sum(dim=dim)
    # NOTE: an empty selection gives 0 / 1 = 0, never NaN.
    return masked_sum(x, mask, dim) / count.clamp_min(1).to(x.dtype)


# --------------------------------------------------------------------------- aggregations


def _token_mean(per_token: Tensor, mask: Tensor, norm_len: int | None = None) -> Tensor:
    # per_token: [N, T], mask: [N, T] -> [] ; every unmasked token weighs the same (DAPO).
    return masked_mean(per_token, mask)


def _seq_mean_token_mean(per_token: Tensor, mask: Tensor, norm_len: int | None = None) -> Tensor:
    # per_token: [N, T], mask: [N, T] -> [] ; every sequence weighs the same (GRPO paper).
    seq_means = masked_mean(per_token, mask, dim=-1)  # [N]
    # NOTE: a sequence with no unmasked token has no mean; it is left out of the average.
    has_tokens = mask.bool().any(dim=-1)  # [N]
    return masked_mean(seq_means, has_tokens)


def _seq_mean_token_sum_norm(per_token: Tensor, mask: Tensor, norm_len: int | None = None) -> Tensor:
    # per_token: [N, T], mask: [N, T] -> [] ; constant normaliser, no length bias (Dr. GRPO).
    # NOTE: the trainers pass the generation budget; the padded T (the fallback) depends on the
    # longest row of the batch, so a row's gradient would change with the other rows' lengths.
    norm = per_token.shape[-1] if norm_len is None else norm_len
    seq_sums = masked_sum(per_token, mask, dim=-1) / norm  # [N]
    return seq_sums.mean()


AGGREGATIONS: dict[str, Aggregation] = {
    "token_mean": _token_mean,
    "seq_mean_token_mean": _seq_mean_token_mean,
    "seq_mean_token_sum_norm": _seq_mean_token_sum_norm,
}


def aggregate(
    per_token: Tensor, mask: Tensor, agg: str = "token_mean", norm_len: int | None = None
) -> Tensor:
    """Reduce a per-token ``[N, T]`` quantity to a 0-d tensor with the named aggregation.

    ``norm_len`` is the constant divisor of ``"seq_mean_token_sum_norm"`` (default: the padded T)."""
    try:
        fn = AGGREGATIONS[agg]
    except KeyError:
        raise ValueError(f"unknown agg {agg!r}; valid: {sorted(AGGREGATIONS)}") from None
    if norm_len is not None and norm_len < 1:
        raise ValueError(f"norm_len must be a positive int, got {norm_len}")
    return fn(per_token, mask, norm_len)


# --------------------------------------------------------------------------- advantages

ADVANTAGE_SCALES: tuple[str | None, ...] = ("std", None)


def group_advantages(
    rewards: Tensor, group_size: int, scale: str | None = "std", eps: float = 1e-6
) -> Tensor:
    """Group-relative advantages (GRPO).

    Args:
        rewards: ``[N]`` scalar rewards, ``N = num_groups * group_size``, groups contiguous.
        group_size: completions per prompt.
        scale: ``"std"`` divides by the group's unbiased std + ``eps``; ``None`` does not (Dr. GRPO).
    Returns:
        ``[N]`` advantages ``r - mean(group)`` (optionally scaled), float; NaN rewards (unscorable
        samples) are left out of their group's statistics and get 0.
    """
    if scale not in ADVANTAGE_SCALES:
        raise ValueError(f"unknown scale {scale!r}; valid: {list(ADVANTAGE_SCALES)}")
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be 1-d [N], got shape {tuple(rewards.shape)}")
    if group_size < 1 or rewards.numel() % group_size != 0:
        raise ValueError(f"{rewards.numel()} rewards do not split into groups of {group_size}")
    rewards = rewards if rewards.is_floating_point() else rewards.float()
    grouped = rewards.view(-1, group_size)  # [G, group_size]
    # NOTE: NaN marks an unscorable sample (every reward function returned None): it is left out of
    # its group's mean and std and gets advantage 0, as in TRL. Without NaN this is the plain formula.
    present = ~grouped.isnan()  # [G, group_size]
    count = present.sum(dim=1, keepdim=True)  # [G, 1]
    mean = grouped.nansum(dim=1, keepdim=True) / count.clamp_min(1)  # [G, 1]
    centred = torch.where(present, grouped - mean, 0.0)  # [G, group_size]
    if scale == "std":
        # NOTE: the unbiased std of a single sample is undefined; its centred reward is 0 anyway.
        var = centred.square().sum(dim=1, keepdim=True) / (count - 1).clamp_min(1)  # [G, 1]
        centred = centred / (var.sqrt() + eps)
    return centred.reshape(-1)  # [N]


@torch.no_grad()
def gae(
    rewards: Tensor, values: Tensor, mask: Tensor, gamma: float = 1.0, lam: float = 0.95
) -> tuple[Tensor, Tensor]:
    """Generalised advantage estimation over the unmasked tokens of each row.

    Masked positions are skipped: they carry the next value and running advantage through
    unchanged, so the value after the last valid token is 0 (no bootstrap) and interior holes
    (e.g. tool output) are transparent. Rewards and values at masked positions are ignored.

    Args:
        rewards: ``[N, T]`` per-token rewards (usually the score on the last token, maybe - KL).
        values: ``[N, T]`` value-head estimates ``V(s_t)``.
        mask: ``[N, T]`` tokens that are actions.
    Returns:
        ``(advantages [N, T], returns [N, T])``, both 0 at masked positions.
    """
    valid = mask.bool()  # [N, T]
    rewards = rewards.detach().to(values.dtype)  # [N, T]
    values = values.detach()  # [N, T]
    next_value = torch.zeros_like(values[:, 0])  # [N]
    running = torch.zeros_like(values[:, 0])  # [N]
    advantages = torch.zeros_like(values)  # [N, T]
    for t in range(values.shape[1] - 1, -1, -1):
        delta = rewards[:, t] + gamma * next_value - values[:, t]  # [N]
        step = delta + gamma * lam * running  # [N]
        running = torch.where(valid[:, t], step, running)
        next_value = torch.where(valid[:, t], values[:, t], next_value)
        advantages[:, t] = torch.where(valid[:, t], step, 0.0)
    returns = torch.where(valid, advantages + values, 0.0)  # [N, T]
    return advantages, returns


# --------------------------------------------------------------------------- per-token terms


def kl_k3(logprobs: Tensor, ref_logprobs: Tensor, mask: Tensor | None = None) -> Tensor:
    """Per-token k3 estimate of KL(policy || ref): ``exp(ref - lp) - (ref - lp) - 1`` (>= 0).

    With ``mask`` given, masked positions give exactly 0 (and zero gradient even if garbage).
    """
    # logprobs, ref_logprobs: [N, T] -> [N, T]
    log_ratio = ref_logprobs - logprobs  # [N, T]
    if mask is not None:
        log_ratio = torch.where(mask.bool(), log_ratio, 0.0)
    return torch.exp(log_ratio) - log_ratio - 1.0


def truncated_importance_weights(
    trainer_old_logprobs: Tensor, rollout_logprobs: Tensor, cap: float = 2.0
) -> Tensor:
    """Truncated importance sampling (TIS) weights ``min(exp(old - rollout), cap)``, detached.

    Corrects for the rollout engine sampling from a slightly different distribution than the
    trainer's own recomputation of the same policy.
    """
    # trainer_old_logprobs, rollout_logprobs: [N, T] -> [N, T]
    return torch.exp(trainer_old_logprobs - rollout_logprobs).clamp(max=cap).detach()


def entropy_from_logits(logits: Tensor, chunk_size: int | None = 4096) -> Tensor:
    """Per-token entropy of ``softmax(logits)`` in fp32; ``[N, T, V] -> [N, T]``.

    Computed ``chunk_size`` token rows at a time so only one chunk is upcast to fp32 at once.
    """
    return _chunked_rows(_entropy_rows, logits, None, chunk_size)


def token_logprobs(logits: Tensor, tokens: Tensor, chunk_size: int | None = 4096) -> Tensor:
    """fp32 ``log_softmax(logits)`` gathered at ``tokens``; ``[N, T, V], [N, T] -> [N, T]``.

    ``log_softmax`` then a gather, ``chunk_size`` token rows at a time (upcast to fp32 a chunk at a
    time, so the full ``[N, T, V]`` fp32 log-softmax is never materialised).
    """
    return _chunked_rows(_logprob_rows, logits, tokens, chunk_size)


def _entropy_rows(logits: Tensor, _: Tensor | None) -> Tensor:
    # logits: [R, V] -> [R]
    logp = torch.log_softmax(logits.float(), dim=-1)  # [R, V]
    return -(logp.exp() * logp).sum(dim=-1)


def _logprob_rows(logits: Tensor, tokens: Tensor | None) -> Tensor:
    # logits: [R, V], tokens: [R] -> [R]
    assert tokens is not None
    # NOTE: log_softmax then gather, as the engine's sampler does (rollout.sampling.sampler): under
    # batch_invariant the trainer and the engine then get the same bits for the same logits.
    logp = logits.float().log_softmax(dim=-1)  # [R, V]
    return logp.gather(-1, tokens.long().unsqueeze(-1)).squeeze(-1)


def _chunked_rows(
    fn: Callable[[Tensor, Tensor | None], Tensor],
    logits: Tensor,
    tokens: Tensor | None,
    chunk_size: int | None,
) -> Tensor:
    # logits: [*B, V], tokens: [*B] or None -> [*B] fp32
    batch_shape = logits.shape[:-1]
    flat = logits.reshape(-1, logits.shape[-1])  # [R, V]
    flat_tokens = None if tokens is None else tokens.reshape(-1)  # [R]
    step = flat.shape[0] if chunk_size is None else max(1, chunk_size)
    pieces = [
        fn(flat[i : i + step], None if flat_tokens is None else flat_tokens[i : i + step])
        for i in range(0, flat.shape[0], step)
    ]
    out = torch.cat(pieces) if pieces else flat.new_zeros(0, dtype=torch.float32)  # [R]
    return out.reshape(batch_shape)


# --------------------------------------------------------------------------- losses


def clipped_policy_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    agg: str = "token_mean",
    tis_weights: Tensor | None = None,
    norm_len: int | None = None,
) -> tuple[Tensor, Metrics]:
    """PPO clipped surrogate ``-min(r*A, clip(r, 1-clip_low, 1+clip_high)*A)``, ``r = exp(lp - old)``.

    Args:
        logprobs: ``[N, T]`` current policy logprobs of the sampled tokens (with grad).
        old_logprobs: ``[N, T]`` logprobs of the policy that sampled (no grad needed).
        advantages: ``[N]`` (broadcast over tokens) or ``[N, T]``.
        mask: ``[N, T]`` response tokens that count.
        agg: a key of :data:`AGGREGATIONS`.
        norm_len: the constant length ``"seq_mean_token_sum_norm"`` divides by (the trainers pass
            ``max_new_tokens``); default the padded length T.
        tis_weights: optional ``[N, T]`` per-token weights (see :func:`truncated_importance_weights`).
    Returns:
        ``(loss [], metrics)`` with detached 0-d ``clip_fraction``, ``clip_low_fraction``,
        ``clip_high_fraction``, ``ratio_mean``, ``ratio_max`` and ``approx_kl`` (k3 estimate of KL(old || new)).
    """
    valid = mask.bool()  # [N, T]
    adv = advantages.unsqueeze(-1) if advantages.dim() == 1 else advantages  # [N, 1] or [N, T]
    adv = adv.detach()
    # NOTE: the log-ratio is zeroed before exp so garbage at padded positions cannot
    # overflow into inf * 0 = NaN in the backward pass.
    log_ratio = torch.where(valid, logprobs - old_logprobs.detach(), 0.0)  # [N, T]
    ratio = torch.exp(log_ratio)  # [N, T]
    unclipped = ratio * adv  # [N, T]
    clipped = ratio.clamp(1.0 - clip_low, 1.0 + clip_high) * adv  # [N, T]
    per_token = -torch.minimum(unclipped, clipped)  # [N, T]
    if tis_weights is not None:
        per_token = per_token * tis_weights.detach()
    loss = aggregate(per_token, valid, agg, norm_len)

    with torch.no_grad():
        low = (ratio < 1.0 - clip_low) & (adv < 0)  # [N, T]
        high = (ratio > 1.0 + clip_high) & (adv > 0)  # [N, T]
        dtype = ratio.dtype
        metrics: Metrics = {
            "clip_fraction": masked_mean((low | high).to(dtype), valid),
            "clip_low_fraction": masked_mean(low.to(dtype), valid),
            "clip_high_fraction": masked_mean(high.to(dtype), valid),
            "ratio_mean": masked_mean(ratio, valid),
            "ratio_max": torch.where(valid, ratio, 0.0).max() if ratio.numel() else ratio.new_zeros(()),
            "approx_kl": masked_mean(torch.expm1(log_ratio) - log_ratio, valid),
        }
    return loss, metrics


def value_loss(
    values: Tensor,
    old_values: Tensor,
    returns: Tensor,
    mask: Tensor,
    clip: float | None = 0.2,
    agg: str = "token_mean",
) -> tuple[Tensor, Metrics]:
    """Clipped value loss ``0.5 * max((v - R)^2, (clip(v, old - clip, old + clip) - R)^2)``.

    Args:
        values: ``[N, T]`` current value-head outputs (with grad).
        old_values: ``[N, T]`` value-head outputs at rollout time.
        returns: ``[N, T]`` targets, e.g. from :func:`gae`.
        mask: ``[N, T]`` tokens that count.
        clip: half-width of the trust region around ``old_values``; ``None`` disables clipping.
    Returns:
        ``(loss [], metrics)`` with detached 0-d ``value_clip_fraction`` (share of tokens where
        the clipped term is the larger one) and ``value_mean``.
    """
    valid = mask.bool()  # [N, T]
    returns = returns.detach()  # [N, T]
    unclipped = (values - returns).square()  # [N, T]
    if clip is None:
        per_token = 0.5 * unclipped  # [N, T]
        clipped_active = torch.zeros_like(valid)
    else:
        old_values = old_values.detach()
        v_clipped = old_values + (values - old_values).clamp(-clip, clip)  # [N, T]
        clipped = (v_clipped - returns).square()  # [N, T]
        per_token = 0.5 * torch.maximum(unclipped, clipped)  # [N, T]
        clipped_active = clipped > unclipped  # [N, T]
    loss = aggregate(per_token, valid, agg)
    with torch.no_grad():
        metrics: Metrics = {
            "value_clip_fraction": masked_mean(clipped_active.to(values.dtype), valid),
            "value_mean": masked_mean(values.detach(), valid),
        }
    return loss, metrics
