"""Logprobs in vLLM's response shapes: the completions route's legacy object (echoed prompt positions
included), vLLM's per-choice `prompt_logprobs`, and the chat route's `content` list with `top_logprobs`.

Values come from the engine (`GenerationOutput.scores` for prompt positions, `.logprobs` / `.top_logprobs` for
generated ones). As in vLLM, -inf (a token outside a processed top-k / top-p set) is reported as -9999.0, so the
body stays valid JSON, and each top dict of the legacy object holds the chosen token besides the top N.
"""

from __future__ import annotations

from rollout.serve.text import SampleText

FLOOR = -9999.0


def _clamp(lp: float) -> float:
    return max(lp, FLOOR)


def completion_logprobs(req, sample: SampleText, tokens: list[int], lps: list[float] | None, start: int = 0,
                        echo: bool = False) -> dict | None:
    """The legacy `logprobs` object of a completion choice: `tokens`, `token_logprobs`, `top_logprobs` (one
    {token: logprob} per position, None on the first prompt token), `text_offset`; generated tokens
    `tokens` start at index `start` of the sample's; with `echo` the prompt's positions come first."""
    if req.logprobs is None or lps is None:
        return None
    k = req.logprobs
    ids: list[int] = []
    values: list[float | None] = []
    tops: list[dict | None] = []
    if echo and sample.final is not None and sample.final.scores is not None:
        out = sample.final
        ids += sample.prompt_ids
        values += [None] + [_clamp(x) for x in out.scores[: len(sample.prompt_ids) - 1]]
        tops.append(None)
        for j, tok in enumerate(sample.prompt_ids[1:]):
            vals, tids = (out.score_top_logprobs[j][:k], out.score_top_ids[j][:k]) if k else ([], [])
            tops.append(_top_dict(sample, vals, tids, tok, out.scores[j]))  # NOTE: k=0: the token itself only
    ids += tokens
    values += [_clamp(x) for x in lps]
    top = sample.top
    for j, (tok, lp) in enumerate(zip(tokens, lps, strict=True)):
        vals, tids = (top[0][start + j][:k], top[1][start + j][:k]) if top is not None and k else ([], [])
        tops.append(_top_dict(sample, vals, tids, tok, lp))
    strings = sample.token_strings(ids)
    offsets, pos = [], 0
    for t in strings:
        offsets.append(pos)
        pos += len(t)
    return {"tokens": strings, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}


def _top_dict(sample: SampleText, vals: list[float], ids: list[int], chosen: int, chosen_lp: float) -> dict:
    strings = sample.token_strings([*ids, chosen])
    top = {s: _clamp(v) for s, v in zip(strings, vals, strict=False)}
    top.setdefault(strings[-1], _clamp(chosen_lp))
    return top


def prompt_logprobs(req, sample: SampleText) -> list | None:
    """vLLM's `prompt_logprobs` of a choice: None for the first token, then per prompt token a dict
    {token id as str: {"logprob", "rank", "decoded_token"}} of the token itself and the top N."""
    out = sample.final
    if getattr(req, "prompt_logprobs", None) is None or out is None or out.scores is None:
        return None
    k = req.prompt_logprobs
    result: list = [None]
    for j, tok in enumerate(sample.prompt_ids[1:]):
        ids, vals = out.score_top_ids[j][:k], out.score_top_logprobs[j][:k]
        strings = sample.token_strings([*ids, tok])
        entry = {str(i): {"logprob": _clamp(v), "rank": r + 1, "decoded_token": s}
                 for r, (i, v, s) in enumerate(zip(ids, vals, strings, strict=False))}
        entry.setdefault(str(tok), {"logprob": _clamp(out.scores[j]), "rank": out.score_ranks[j],
                                    "decoded_token": strings[-1]})
        result.append(entry)
    return result


def chat_logprobs(req, sample: SampleText, tokens: list[int], lps: list[float] | None, start: int = 0) -> dict | None:
    """The chat choice's `logprobs`: {"content": [{token, logprob, bytes, top_logprobs: [...]}]}."""
    if not req.logprobs or lps is None:
        return None
    k = req.num_top_logprobs
    top = sample.top
    content = []
    for j, (tok, lp) in enumerate(zip(tokens, lps, strict=True)):
        vals, ids = (top[0][start + j][:k], top[1][start + j][:k]) if top is not None and k else ([], [])
        strings = sample.token_strings([tok, *ids])
        content.append({"token": strings[0], "logprob": _clamp(lp), "bytes": list(strings[0].encode()),
                        "top_logprobs": [{"token": s, "logprob": _clamp(v), "bytes": list(s.encode())}
                                         for s, v in zip(strings[1:], vals, strict=True)]})
    return {"content": content}
