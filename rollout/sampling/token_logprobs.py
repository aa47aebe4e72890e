"""Teacher-forced and top-k logprobs: which packed rows a step scores, and their logprobs into the requests.

A request with `score_from` set (`rollout.requests.Request`) wants the logprob of each given token (prompt,
then forced) from that index on: the logits at positions `score_from - 1 .. num_given_tokens - 2`. The runner
keeps those rows beside the sampled ones (`rollout.model.runner.score_rows`), and `record_scores` turns them into
logprobs, stored by position on the request (a recomputation after a preemption overwrites them), plus the top k of
every scored position when the request asks (`top_logprobs`; a sampled position's top k comes from the sampler).
Kept apart from `rollout.sampling.sampler`: the default path (no scoring) never comes here.

Semantics follow `logprobs_mode`, through the sampler's own definition (`rollout.sampling.log_distribution`):
"raw" is `log_softmax(logits)`; "processed" the distribution the request would sample that token from, its
logits processors applied with the tokens before the position (`LogitsProcessors.apply_at`; a completion's
tokens count as generated), then the warpers; greedy rows are raw in both.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from rollout.prompts import check_token_ids
from rollout.requests import Request
from rollout.sampling.log_distribution import log_distribution, needs_processors, top_k
from rollout.sampling.processors import LogitsProcessors, RowHistory

MAX_TOP_LOGPROBS = 20


class ScoredRows(NamedTuple):
    request: Request  # a scoring request of the step
    first: int  # position of the first scored logit row (it predicts token `first + 1`)
    count: int  # consecutive positions scored this step


@dataclass(slots=True)
class Scores:
    logits: torch.Tensor  # [S, V] fp32, the scored rows in the order of `rows`
    rows: list[ScoredRows]


def record_scores(scores: Scores | None, processors: LogitsProcessors, mode: str) -> None:
    """Store the step's scored logprobs on their requests (and their top k when asked), each position under
    the distribution the sampler would draw its token from (`processors`: the sampler's, for the n-gram index)."""
    if scores is None:
        return
    reqs = [r.request for r in scores.rows]
    hists = [RowHistory.at(req, p) for req, r in zip(reqs, scores.rows, strict=True)
             for p in range(r.first, r.first + r.count)]
    params = [h.request.sampling for h in hists]
    raw = scores.logits.float()  # [S, V]
    processed = processors.apply_at(raw, hists) if needs_processors(params, mode) else raw
    dist = log_distribution(raw, processed, params, mode)  # [S, V]
    targets = [h.request.token_ids[h.length] for h in hists]
    lp = dist.gather(1, torch.tensor(targets, device=dist.device)[:, None])  # [S, 1]
    k = max(req.top_logprobs for req in reqs)
    top_vals, top_ids = top_k(dist, k) if k else ([], [])
    ranks = ((dist > lp).sum(dim=-1) + 1).tolist() if k else []  # NOTE: vLLM's prompt_logprobs report it
    lp = lp[:, 0].tolist()
    for row, h in enumerate(hists):
        kk = h.request.top_logprobs
        top = (top_vals[row][:kk], top_ids[row][:kk], ranks[row]) if kk else ([], [], None)
        h.request.scores[h.length - 1] = (lp[row], *top)


def check_scoring(forced_ids, score_from: int | None, top_logprobs: int, num_prompt: int, vocab_size: int,
                  max_new_tokens) -> list[int]:
    """The forced ids as a list after checking the scoring fields of a submission (ValueError naming the field)."""
    forced = [] if forced_ids is None or len(forced_ids) == 0 else check_token_ids(forced_ids, vocab_size, "forced_ids")
    if isinstance(top_logprobs, bool) or not isinstance(top_logprobs, int) or not 0 <= top_logprobs <= MAX_TOP_LOGPROBS:
        raise ValueError(f"top_logprobs must be an int in [0, {MAX_TOP_LOGPROBS}], got {top_logprobs!r}")
    given = num_prompt + len(forced)
    if score_from is not None and (isinstance(score_from, bool) or not isinstance(score_from, int)
                                   or not 1 <= score_from <= given):
        raise ValueError(f"score_from must be an int in [1, {given}] (prompt plus forced tokens), got {score_from!r}")
    if score_from is None and forced:
        raise ValueError("forced_ids need score_from (the first given token whose logprob is recorded)")
    if max_new_tokens == 0 and score_from is None:
        raise ValueError("max_new_tokens=0 is only allowed when scoring (score_from set)")
    return forced
