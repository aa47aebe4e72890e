"""Teacher-forced and top-k logprobs: which packed rows a step scores, and their logprobs into the requests.

A request with `score_from` set (`rollout.requests.Request`) wants the logprob of each given token (prompt,
then forced) from that index on: the logits at positions `score_from - 1 .. num_given_tokens - 2`. The runner
keeps those rows beside the sampled ones (`score_rows`), and `record_logprobs` turns them into logprobs, stored
by position on the request (a recomputation after a preemption overwrites them), plus the top k of every
scored and every sampled position when the request asks (`top_logprobs`). Kept apart from `rollout.sampling.sampler`:
the default path (no scoring, k = 0) never comes here.

Semantics follow `logprobs_mode`: "raw" is `log_softmax(logits)`; "processed" the distribution the request
samples from (temperature, top-k, top-p: `rollout.sampling.sampler.processed_logprobs`); greedy rows are raw in both.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from rollout.prompts import check_token_ids
from rollout.requests import Request, SamplingParams
from rollout.sampling.sampler import processed_logprobs
from rollout.scheduling.stages import SchedulerOutput

MAX_TOP_LOGPROBS = 20


class ScoredRows(NamedTuple):
    index: int  # into `SchedulerOutput.scheduled`
    first: int  # position of the first scored logit row (it predicts token `first + 1`)
    count: int  # consecutive positions scored this step


@dataclass(slots=True)
class Scores:
    logits: torch.Tensor  # [S, V] fp32, the scored rows in the order of `rows`
    rows: list[ScoredRows]


def score_rows(out: SchedulerOutput) -> tuple[list[int], list[ScoredRows]]:
    """(packed row indices of this step's scored positions, where they belong); none in a decode-only step."""
    keep: list[int] = []
    scored: list[ScoredRows] = []
    if out.decode_only:
        return keep, scored
    offset = 0
    for i, s in enumerate(out.scheduled):
        req, start, n = s.request, s.request.num_computed_tokens, s.num_new_tokens
        if req.score_from is not None:
            lo = max(start, req.score_from - 1)
            hi = min(start + n, req.num_given_tokens - 1)
            if hi > lo:
                scored.append(ScoredRows(i, lo, hi - lo))
                keep.extend(range(offset + lo - start, offset + hi - start))
        offset += n
    return keep, scored


def log_distribution(logits: torch.Tensor, params: list[SamplingParams], mode: str) -> torch.Tensor:
    """[R, V] fp32 logprobs of each row under `mode` ("raw", or "processed" at its sampling params)."""
    logits = logits.float()
    if mode == "raw" or all(p.greedy for p in params):
        return logits.log_softmax(dim=-1)
    if not any(p.greedy for p in params):
        return processed_logprobs(logits, params)
    out = logits.log_softmax(dim=-1)
    rows = [i for i, p in enumerate(params) if not p.greedy]
    idx = torch.tensor(rows, device=logits.device)
    out[idx] = processed_logprobs(logits.index_select(0, idx), [params[i] for i in rows])
    return out


def _top(dist: torch.Tensor, k: int) -> tuple[list[list[float]], list[list[int]]]:
    vals, ids = dist.topk(k, dim=-1)  # [R, k]
    return vals.tolist(), ids.tolist()


def record_logprobs(scores: Scores | None, out: SchedulerOutput, logits: torch.Tensor, sampled: list[Request],
                    mode: str) -> None:
    """Store the step's scored logprobs on their requests, and the top k of each sampled row that asks
    (`logits` [R, V], one row per request of `sampled`), before its token is appended."""
    if scores is not None:
        reqs = [out.scheduled[r.index].request for r in scores.rows]
        params = [req.sampling for req, r in zip(reqs, scores.rows, strict=True) for _ in range(r.count)]
        dist = log_distribution(scores.logits, params, mode)  # [S, V]
        targets = [t for req, r in zip(reqs, scores.rows, strict=True)
                   for t in req.token_ids[r.first + 1 : r.first + 1 + r.count]]
        lp = dist.gather(1, torch.tensor(targets, device=dist.device)[:, None])  # [S, 1]
        k = max(req.top_logprobs for req in reqs)
        top_vals, top_ids = _top(dist, k) if k else ([], [])
        ranks = ((dist > lp).sum(dim=-1) + 1).tolist() if k else []  # NOTE: vLLM's prompt_logprobs report it
        lp = lp[:, 0].tolist()
        row = 0
        for req, r in zip(reqs, scores.rows, strict=True):
            kk = req.top_logprobs
            for p in range(r.first, r.first + r.count):
                top = (top_vals[row][:kk], top_ids[row][:kk], ranks[row]) if kk else ([], [], None)
                req.scores[p] = (lp[row], *top)
                row += 1
    wants = [i for i, req in enumerate(sampled) if req.top_logprobs]
    if wants:
        idx = torch.tensor(wants, device=logits.device)
        dist = log_distribution(logits.index_select(0, idx), [sampled[i].sampling for i in wants], mode)
        vals, ids = _top(dist, max(sampled[i].top_logprobs for i in wants))
        for j, i in enumerate(wants):
            kk = sampled[i].top_logprobs
            sampled[i].top.append((vals[j][:kk], ids[j][:kk]))


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
