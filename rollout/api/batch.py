"""`RolloutBatch`: loss-ready rollouts, and `pack_batch`, which pads a call's outputs into one."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields

import torch

from rollout.requests import GenerationOutput


@dataclass
class RolloutBatch:
    """Loss-ready rollouts: N = len(prompts) x group_size rows, a group's samples adjacent.

    Tensors live on the model's device. Logprobs are fp32 and 0 where the mask is 0.
    """

    prompt_ids: torch.Tensor  # [N, P] left-padded
    prompt_mask: torch.Tensor  # [N, P] 1 on prompt tokens
    completion_ids: torch.Tensor  # [N, T] right-padded
    completion_mask: torch.Tensor  # [N, T] 1 on generated tokens
    logprobs: torch.Tensor  # [N, T] fp32
    group_ids: torch.Tensor  # [N] index of the prompt each row answers
    temperatures: torch.Tensor  # [N] fp32
    finish_reasons: list[str]  # [N] "stop" | "length" | ...
    policy_version: int
    completions_text: list[str] | None = None  # [N] decoded completions when a tokenizer is known
    # NOTE: multi-turn episodes (rollout.agents): completions hold model and environment tokens
    loss_mask: torch.Tensor | None = None  # [N, T] 1 on model-sampled tokens (None: every completion token)
    rewards: torch.Tensor | None = None  # [N] fp32 the environment's reward of each episode
    num_turns: torch.Tensor | None = None  # [N] model turns of each episode

    @property
    def trained_mask(self) -> torch.Tensor:  # [N, T]
        """The tokens a loss trains on: the sampled ones (`completion_mask`, and `loss_mask` when set)."""
        return self.completion_mask if self.loss_mask is None else self.completion_mask * self.loss_mask
    top_logprobs: torch.Tensor | None = None  # [N, T, k] fp32, best first, when generated with top_logprobs=k
    top_ids: torch.Tensor | None = None  # [N, T, k] int64
    # NOTE: a request that spans an in-flight weight update holds tokens of two (or more) versions
    versions: torch.Tensor | None = None  # [N, T] int64 policy_version that sampled each token, 0 where masked
    # NOTE: with return_routed_experts (an MoE policy): aligned with `input_ids`, the experts each of the L MoE
    # layers chose for the token there; -1 at padding and at the last sampled token (never an input).
    routed_experts: torch.Tensor | None = None  # [N, P + T, L, k] int16
    # NOTE: with SamplingParams(return_sampling_mask=True): per row, per generated token, the ids the sampler could
    # have drawn (`rollout.sampling.sampler.support`), what a trainer scores the old and new policy on
    sampling_masks: list[list[list[int]]] | None = None

    @property
    def input_ids(self) -> torch.Tensor:  # [N, P + T]
        return torch.cat([self.prompt_ids, self.completion_ids], dim=1)

    @property
    def attention_mask(self) -> torch.Tensor:  # [N, P + T]
        return torch.cat([self.prompt_mask, self.completion_mask], dim=1)

    @property
    def completion_lengths(self) -> torch.Tensor:  # [N]
        return self.completion_mask.sum(dim=1)

    def __len__(self) -> int:
        return self.prompt_ids.shape[0]

    def rows(self) -> tuple[list[list[int]], list[list[int]]]:
        """Each row's prompt and completion ids, unpadded (what `score` takes to score this batch)."""
        prompts = [r[m.bool()].tolist() for r, m in zip(self.prompt_ids, self.prompt_mask, strict=True)]
        completions = [r[m.bool()].tolist() for r, m in zip(self.completion_ids, self.completion_mask, strict=True)]
        return prompts, completions

    def to(self, device: torch.device | str) -> RolloutBatch:
        moved = {
            f.name: getattr(self, f.name).to(device) if isinstance(getattr(self, f.name), torch.Tensor)
            else getattr(self, f.name)
            for f in fields(self)
        }
        return RolloutBatch(**moved)


def pack_batch(prompts: Sequence[Sequence[int]], outputs: Sequence[GenerationOutput], temps: Sequence[float],
               group_size: int, pad: int, policy_version: int, device: torch.device, tokenizer=None,
               top_logprobs: int = 0, routed_experts: bool = False) -> RolloutBatch:
    """A `RolloutBatch` of `outputs` (row `i * group_size + j` answers `prompts[i]`): prompts left-padded,
    completions right-padded with `pad`; `policy_version` is the oldest output's (this one when empty);
    completions decoded when a tokenizer is given."""
    n = len(outputs)
    p_len = max((len(p) for p in prompts), default=0)
    t_len = max((len(o.generated_tokens) for o in outputs), default=0)
    prompt_ids = torch.full((n, p_len), pad, dtype=torch.long)
    prompt_mask = torch.zeros((n, p_len), dtype=torch.long)
    completion_ids = torch.full((n, t_len), pad, dtype=torch.long)
    completion_mask = torch.zeros((n, t_len), dtype=torch.long)
    logprobs = torch.zeros((n, t_len), dtype=torch.float32)
    versions = torch.zeros((n, t_len), dtype=torch.long)
    for row, out in enumerate(outputs):
        p = prompts[row // group_size]
        if p:
            prompt_ids[row, p_len - len(p):] = torch.tensor(p)
            prompt_mask[row, p_len - len(p):] = 1
        k = len(out.generated_tokens)
        if k:
            completion_ids[row, :k] = torch.tensor(out.generated_tokens)
            completion_mask[row, :k] = 1
            logprobs[row, :k] = torch.tensor(out.logprobs, dtype=torch.float32)
            versions[row, :k] = torch.tensor(out.versions if out.versions else [out.policy_version] * k)
    top_lp = top_ids = None
    if top_logprobs:  # NOTE: [N, T, k], 0 where masked
        top_lp = torch.zeros((n, t_len, top_logprobs), dtype=torch.float32)
        top_ids = torch.zeros((n, t_len, top_logprobs), dtype=torch.long)
        for row, out in enumerate(outputs):
            if out.generated_tokens:
                top_lp[row, : len(out.generated_tokens)] = torch.tensor(out.top_logprobs, dtype=torch.float32)
                top_ids[row, : len(out.generated_tokens)] = torch.tensor(out.top_ids, dtype=torch.long)
    texts = None
    if tokenizer is not None:
        texts = tokenizer.batch_decode([o.generated_tokens for o in outputs], skip_special_tokens=True)
    batch = RolloutBatch(
        prompt_ids=prompt_ids,
        prompt_mask=prompt_mask,
        completion_ids=completion_ids,
        completion_mask=completion_mask,
        logprobs=logprobs,
        group_ids=torch.arange(len(prompts)).repeat_interleave(group_size),
        temperatures=torch.tensor(temps, dtype=torch.float32).repeat_interleave(group_size),
        finish_reasons=[o.finish_reason for o in outputs],
        policy_version=min((o.policy_version for o in outputs), default=policy_version),
        completions_text=texts,
        top_logprobs=top_lp,
        top_ids=top_ids,
        versions=versions,
        routed_experts=pack_routes([prompts[r // group_size] for r in range(n)], outputs, p_len, t_len)
        if routed_experts else None,
        sampling_masks=[list(o.sampling_masks or []) for o in outputs]
        if any(o.sampling_masks is not None for o in outputs) else None,
    )
    return batch.to(device)


def pack_routes(prompts: Sequence[Sequence[int]], outputs: Sequence[GenerationOutput], p_len: int,
                t_len: int) -> torch.Tensor:
    """`[N, p_len + t_len, L, k]` int16 of the outputs' `routed_experts` (row i's tokens: `prompts[i]`, then the
    rest), laid out as `input_ids`: the prompt left-padded to `p_len`, the rest right-padded; -1 at padding."""
    shape = next((o.routed_experts.shape[1:] for o in outputs if o.routed_experts is not None), (0, 0))
    out = torch.full((len(outputs), p_len + t_len, *shape), -1, dtype=torch.int16)
    for row, (p, o) in enumerate(zip(prompts, outputs, strict=True)):
        routes = o.routed_experts  # [len(p) + rest, L, k]
        out[row, p_len - len(p) : p_len] = routes[: len(p)]
        out[row, p_len : p_len + len(routes) - len(p)] = routes[len(p) :]
    return out
