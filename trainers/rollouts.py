"""Rollout plumbing of the trainers: prompts to token ids (chat templates included), and merging
or selecting rows of `RolloutBatch`es (DAPO's dynamic sampling refills a batch from several rounds).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from rollout import RolloutBatch
from rollout.api.chat import chat_template_ids as chat_ids  # NOTE: module-level name: tests patch it
from rollout.api.chat import is_conversational


def encode_prompt(tokenizer, prompt: Any, chat_template: bool = False) -> Any:
    """What the rollout gets for one dataset prompt: token ids. Chat rows (a list of messages) and, with
    `chat_template`, plain strings (as one user message) become template ids; other strings are encoded as the
    engine would (`add_special_tokens=True`), so a rollout built without a tokenizer works under a trainer that has
    one; token-id lists pass through (strings too when the trainer has no tokenizer)."""
    if is_conversational(prompt):
        return chat_ids(tokenizer, list(prompt))
    if chat_template and isinstance(prompt, str):
        return chat_ids(tokenizer, [{"role": "user", "content": prompt}])
    if isinstance(prompt, str) and tokenizer is not None:
        return list(tokenizer(prompt, add_special_tokens=True)["input_ids"])
    return prompt


def merge_batches(batches: Sequence[RolloutBatch], pad_id: int) -> RolloutBatch:
    """Rows of several batches in order, re-padded (prompts left, completions right) to the widest."""
    if len(batches) == 1:
        return batches[0]
    p = max(b.prompt_ids.shape[1] for b in batches)
    t = max(b.completion_ids.shape[1] for b in batches)

    def left(x: Tensor, width: int, value: float) -> Tensor:  # [n, w] -> [n, width]
        return torch.nn.functional.pad(x, (width - x.shape[1], 0), value=value)

    def right(x: Tensor, width: int, value: float) -> Tensor:  # [n, w] -> [n, width]
        return torch.nn.functional.pad(x, (0, width - x.shape[1]), value=value)

    offsets = torch.tensor([0] + [int(b.group_ids.max()) + 1 if len(b) else 0 for b in batches[:-1]])
    offsets = offsets.cumsum(0)
    texts = [b.completions_text for b in batches]
    return RolloutBatch(
        prompt_ids=torch.cat([left(b.prompt_ids, p, pad_id) for b in batches]),
        prompt_mask=torch.cat([left(b.prompt_mask, p, 0) for b in batches]),
        completion_ids=torch.cat([right(b.completion_ids, t, pad_id) for b in batches]),
        completion_mask=torch.cat([right(b.completion_mask, t, 0) for b in batches]),
        logprobs=torch.cat([right(b.logprobs, t, 0.0) for b in batches]),
        group_ids=torch.cat([b.group_ids + int(o) for b, o in zip(batches, offsets, strict=True)]),
        temperatures=torch.cat([b.temperatures for b in batches]),
        finish_reasons=[r for b in batches for r in b.finish_reasons],
        policy_version=min(b.policy_version for b in batches),
        completions_text=None if any(x is None for x in texts) else [s for x in texts for s in x],
        **{name: _cat_optional([getattr(b, name) for b in batches], width) for name, width in
           (("loss_mask", t), ("rewards", None), ("num_turns", None), ("versions", t))},
        sampling_masks=None if any(b.sampling_masks is None for b in batches)
        else [m for b in batches for m in b.sampling_masks],
        routed_experts=None if any(b.routed_experts is None for b in batches) else torch.cat([
            torch.nn.functional.pad(b.routed_experts, (0, 0, 0, 0, p - b.prompt_ids.shape[1],
                                                       t - b.completion_ids.shape[1]), value=-1) for b in batches]),
    )


def _cat_optional(parts: list[Tensor | None], width: int | None) -> Tensor | None:
    """The batches' optional field joined (right-padded with 0 to `width` when 2-D); None unless all have it."""
    if any(x is None for x in parts):
        return None
    if width is not None:
        parts = [torch.nn.functional.pad(x, (0, width - x.shape[1])) for x in parts]
    return torch.cat(parts)


def take_rows(batch: RolloutBatch, index: Tensor) -> RolloutBatch:
    """The rows `index [n]` of a batch (group ids renumbered 0..)."""
    rows = index.tolist()
    _, group_ids = torch.unique_consecutive(batch.group_ids[index], return_inverse=True)
    return RolloutBatch(
        prompt_ids=batch.prompt_ids[index],
        prompt_mask=batch.prompt_mask[index],
        completion_ids=batch.completion_ids[index],
        completion_mask=batch.completion_mask[index],
        logprobs=batch.logprobs[index],
        group_ids=group_ids,
        temperatures=batch.temperatures[index],
        finish_reasons=[batch.finish_reasons[i] for i in rows],
        policy_version=batch.policy_version,
        completions_text=None if batch.completions_text is None else [batch.completions_text[i] for i in rows],
        sampling_masks=None if batch.sampling_masks is None else [batch.sampling_masks[i] for i in rows],
        **{name: None if getattr(batch, name) is None else getattr(batch, name)[index]
           for name in ("loss_mask", "rewards", "num_turns", "versions", "routed_experts")},
    )


def batch_tensors(batch: RolloutBatch) -> dict[str, Tensor]:
    """The loss-side view of a `RolloutBatch`: every tensor has the row dimension N first."""
    return {
        "input_ids": batch.input_ids,  # [N, P+T]
        "attention_mask": batch.attention_mask,  # [N, P+T]
        "completion_ids": batch.completion_ids,  # [N, T]
        "completion_mask": batch.trained_mask.bool(),  # [N, T] sampled tokens (not an environment's)
        "rollout_logprobs": batch.logprobs,  # [N, T]
        "temperatures": batch.temperatures,  # [N]
        **({} if batch.versions is None else {"versions": batch.versions}),  # [N, T] policy version per token
        **({} if batch.routed_experts is None else {"routed_experts": batch.routed_experts}),  # [N, P+T, L, k]
        **({} if batch.sampling_masks is None else {"sampling_support": rollout_support_ids(batch)}),  # [N, T, K]
    }


def rollout_support_ids(batch: RolloutBatch) -> Tensor:
    """`batch.sampling_masks` as one `[N, T, K]` int64 tensor (K the widest mask), -1 where no id."""
    masks = batch.sampling_masks
    n, t = batch.completion_ids.shape
    k = max((len(m) for row in masks for m in row), default=1)
    out = torch.full((n, t, k), -1, dtype=torch.long)
    for i, row in enumerate(masks):
        for j, ids in enumerate(row):
            out[i, j, : len(ids)] = torch.tensor(ids, dtype=torch.long)
    return out.to(batch.completion_ids.device)


def completion_id_lists(batch: RolloutBatch) -> list[list[int]]:
    """The generated ids of each row, unpadded (what reward functions get as `completion_ids`)."""
    return [ids[mask.bool()].tolist() for ids, mask in zip(batch.completion_ids, batch.completion_mask, strict=True)]


def speculation_counts(engine) -> tuple[int, int] | None:
    """(drafted, accepted) tokens so far of an in-process engine built to speculate (`speculative_method`), else
    None (pools, fleets and plain engines log no speculation metrics)."""
    core = getattr(getattr(engine, "manager", None), "core", None)
    if core is None or not core.config.speculative_method:
        return None
    stats = engine.cache_stats()
    return stats["spec_draft_tokens"], stats["spec_accepted_tokens"]


def speculation_metrics(before: tuple[int, int] | None, after: tuple[int, int] | None) -> dict[str, float]:
    """`spec_draft_tokens`, `spec_accepted_tokens` and `spec_acceptance_rate` (accepted / drafted; 0.0 when
    nothing was drafted) of the rollouts between two `speculation_counts`."""
    if before is None or after is None:
        return {}
    drafted, accepted = after[0] - before[0], after[1] - before[1]
    return {"spec_draft_tokens": float(drafted), "spec_accepted_tokens": float(accepted),
            "spec_acceptance_rate": accepted / drafted if drafted else 0.0}
