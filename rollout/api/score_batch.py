"""`ScoreBatch`: teacher-forced logprobs of given completions, and `pack_scores`, which pads a call's outputs.

`RolloutEngine.score` submits one scoring request per row (its prompt, its completion teacher-forced) and
packs their `GenerationOutput.scores` here. Prompt logprobs are computed once per distinct prompt (by the
first row that has it) and shared with the rows that repeat it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields

import torch

from rollout.api.batch import RolloutBatch, pack_routes
from rollout.requests import GenerationOutput
from rollout.sampling_params import per_prompt, sets_temperature


@dataclass
class ScoreBatch:
    """Per-token logprobs of N completions after their prompts (fp32, 0 where masked).

    Completions are right-padded as in `RolloutBatch.completion_ids`; prompts left-padded as in
    `RolloutBatch.prompt_ids`, so `prompt_logprobs[i, j]` is the logprob of `prompt_ids[i, j]` (0 on the
    first prompt token, which has no context, and on padding).
    """

    logprobs: torch.Tensor  # [N, T] fp32
    mask: torch.Tensor  # [N, T] 1 on completion tokens
    top_logprobs: torch.Tensor | None = None  # [N, T, k] fp32, best first (when top_logprobs=k > 0)
    top_ids: torch.Tensor | None = None  # [N, T, k] int64
    prompt_logprobs: torch.Tensor | None = None  # [N, P] fp32 (when prompt_logprobs=True)
    prompt_mask: torch.Tensor | None = None  # [N, P] 1 on prompt tokens that have a logprob
    # NOTE: return_routed_experts: the experts of each prompt and completion token, laid out as `RolloutBatch.input_ids`
    # (prompts left-padded to P, completions right-padded to T), -1 at padding.
    routed_experts: torch.Tensor | None = None  # [N, P + T, L, k] int16

    def __len__(self) -> int:
        return self.logprobs.shape[0]

    def to(self, device: torch.device | str) -> ScoreBatch:
        return ScoreBatch(**{f.name: None if getattr(self, f.name) is None else getattr(self, f.name).to(device)
                             for f in fields(self)})


def pack_scores(prompts: Sequence[Sequence[int]], completions: Sequence[Sequence[int]],
                outputs: Sequence[GenerationOutput], top_logprobs: int, first_of: Sequence[int] | None,
                width: int | None, device: torch.device, routed_experts: bool = False) -> ScoreBatch:
    """Pad the outputs of one scoring call. Row i scored `completions[i]` after `prompts[i]`; with prompt
    logprobs, `first_of[i]` is the row whose output holds them (it scored from token 1). `width` is the
    completion width T (default the longest completion)."""
    n = len(outputs)
    t_len = max((len(c) for c in completions), default=0) if width is None else width
    k = top_logprobs
    logprobs = torch.zeros((n, t_len), dtype=torch.float32)
    mask = torch.zeros((n, t_len), dtype=torch.long)
    top_lp = torch.zeros((n, t_len, k), dtype=torch.float32) if k else None
    top_ids = torch.zeros((n, t_len, k), dtype=torch.long) if k else None
    p_len = max((len(p) for p in prompts), default=0)
    prompt_lp = torch.zeros((n, p_len), dtype=torch.float32) if first_of is not None else None
    prompt_mask = torch.zeros((n, p_len), dtype=torch.long) if first_of is not None else None
    for row, (p, c, out) in enumerate(zip(prompts, completions, outputs, strict=True)):
        skip = len(out.scores) - len(c)  # NOTE: prompt positions scored before the completion's
        if c:
            logprobs[row, : len(c)] = torch.tensor(out.scores[skip:], dtype=torch.float32)
            mask[row, : len(c)] = 1
            if k:
                top_lp[row, : len(c)] = torch.tensor(out.score_top_logprobs[skip:], dtype=torch.float32)
                top_ids[row, : len(c)] = torch.tensor(out.score_top_ids[skip:], dtype=torch.long)
        if first_of is not None and len(p) > 1:
            src = outputs[first_of[row]]
            prompt_lp[row, p_len - len(p) + 1 :] = torch.tensor(src.scores[: len(p) - 1], dtype=torch.float32)
            prompt_mask[row, p_len - len(p) + 1 :] = 1
    batch = ScoreBatch(logprobs=logprobs, mask=mask, top_logprobs=top_lp, top_ids=top_ids,
                       prompt_logprobs=prompt_lp, prompt_mask=prompt_mask,
                       routed_experts=pack_routes(prompts, outputs, p_len, t_len) if routed_experts else None)
    return batch.to(device)


def score_inputs(prompt_ids, completion_ids, temps, encode_prompt, encode_completion, sampling=None):
    """`score`'s rows: `(prompts, completions, rows, width)`, from a `RolloutBatch` (its rows, its temperatures
    unless `temps` is given, `width` its completion width) or from lists of prompts and completions (encoded by
    `encode_prompt` / `encode_completion`, `width` None). `rows`: each row's `SamplingParams`, `sampling` (one, or
    one per row) at `temps` (one, or one per row; default 1.0 unless `sampling` sets the temperature); setting the
    temperature both ways is a ValueError. ValueError when the completions are missing or their count is not the
    prompts'."""
    width = None
    if isinstance(prompt_ids, RolloutBatch):
        prompts, completion_ids = prompt_ids.rows()
        temps = prompt_ids.temperatures.tolist() if temps is None else temps
        width = prompt_ids.completion_ids.shape[1]
    else:
        if isinstance(prompt_ids, str) or completion_ids is None:
            raise ValueError("score needs a list of prompts and a list of completions (or a RolloutBatch)")
        prompts = [encode_prompt(p) for p in prompt_ids]
    completions = [encode_completion(c) for c in completion_ids]
    if len(completions) != len(prompts):
        raise ValueError(f"completion_ids has {len(completions)} rows for {len(prompts)} prompts")
    if temps is None and not sets_temperature(sampling):
        temps = 1.0
    return prompts, completions, per_prompt(sampling, len(prompts), temps=temps), width
