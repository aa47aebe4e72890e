"""N-gram drafts for speculative decoding: where a row's context last continued its current suffix.

Three sources, tried per n-gram size from the longest down (a long match anywhere beats a short one nearby):
the row's own tokens (prompt + generated: transformers' prompt lookup), then its live group siblings' (the
requests sampling the same prompt now), then a bounded history of the same prompt's earlier rollouts, kept
across calls (RL samples a prompt again every epoch). Drafts only choose which tokens the verifying forward
tries; they never change what is sampled (`rollout.sampling.speculative`). Pure Python: no torch.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict

DEFAULT_NGRAM = 3  # NOTE: transformers' prompt lookup matches up to 2 tokens; 3 picks better drafts in loops
# NOTE: a single repeated token predicts the next one ~1-3% of the time on the benchmarks' random models (a
# loop, a sibling's or an earlier rollout's text matches 2+ tokens): drafts start at 2 unless a request asks for 1
MIN_NGRAM = 2
MAX_NGRAM = 8  # the longest n-gram indexed (`max_matching_ngram_size` is capped at it)
MAX_SIBLINGS = 16  # NOTE: live requests of the same prompt looked in per draft (a GRPO group's size)
HISTORY_PER_PROMPT = 16  # finished rollouts kept per prompt
HISTORY_TOKENS = 1 << 17  # NOTE: tokens of finished rollouts kept across calls (their indexes: ~3 entries a token)


class NgramIndex:
    """The latest position following every n-gram (n = 1 .. `max_n`) of a growing token list.

    Args:
        tokens: the list indexed (read, never copied: it may grow between calls to `update`).
        max_n: the longest n-gram indexed.
    """

    def __init__(self, tokens: list[int], max_n: int) -> None:
        self.tokens = tokens
        self.max_n = max_n
        self.maps: list[dict[tuple[int, ...], int]] = [{} for _ in range(max_n)]  # n-1 -> n-gram -> next position
        self.upto = 1  # NOTE: next position p whose preceding n-grams are not indexed yet

    def update(self) -> None:
        """Index the n-grams that gained a following token since the last call."""
        toks, maps = self.tokens, self.maps
        for p in range(self.upto, len(toks)):
            for n in range(1, min(self.max_n, p) + 1):
                maps[n - 1][tuple(toks[p - n : p])] = p
        self.upto = max(self.upto, len(toks))

    def follow(self, gram: tuple[int, ...], k: int, periodic: bool = False) -> list[int]:
        """Up to `k` tokens that followed `gram` the last time; `periodic`: `gram` ends this index's own list,
        so a match running into the end continues with the draft itself (a loop repeats)."""
        pos = self.maps[len(gram) - 1].get(gram)
        if pos is None:
            return []
        toks = self.tokens
        if not periodic:
            return toks[pos : pos + k]
        out: list[int] = []
        period = len(toks) - pos
        for i in range(k):
            out.append(toks[pos + i] if pos + i < len(toks) else out[i - period])
        return out


class Drafter:
    """Per-request n-gram indexes, the live requests grouped by prompt, and the prompts' finished rollouts.

    Indexes are built lazily (a request's own at its first draft, a sibling's or a finished rollout's at the first
    lookup in it), so requests that never speculate cost a list copy at most.

    Args:
        history_tokens: most tokens of finished rollouts kept (least recently sampled prompts dropped first).
        max_n: the longest n-gram any index holds.
    """

    def __init__(self, history_tokens: int = HISTORY_TOKENS, max_n: int = DEFAULT_NGRAM) -> None:
        self.max_n = max_n  # NOTE: of the indexes of siblings tracked before drafting and of finished rollouts
        self.own: dict[str, NgramIndex] = {}  # request id -> index of its tokens
        self.groups: dict[tuple[int, ...], dict[str, NgramIndex]] = {}  # prompt -> live requests' indexes
        self.history: OrderedDict[tuple[int, ...], list[NgramIndex]] = OrderedDict()  # prompt -> finished ones
        self.history_tokens, self.kept_tokens = history_tokens, 0

    def track(self, request, max_n: int | None = None) -> NgramIndex:
        """The live index of `request` (created, unfilled, on first sight; n-grams up to `max_n`)."""
        index = self.own.get(request.request_id)
        if index is None:
            index = self.own[request.request_id] = NgramIndex(request.token_ids, min(max_n or self.max_n, MAX_NGRAM))
            self.groups.setdefault(tuple(request.prompt_ids), {})[request.request_id] = index
        return index

    def draft(self, request, k: int, max_n: int) -> list[int]:
        """Up to `k` tokens likely to follow `request.token_ids` (empty when no n-gram matches)."""
        index = self.track(request, max_n)
        index.update()
        toks = request.token_ids
        prompt = tuple(request.prompt_ids)
        siblings = list(itertools.islice((i for rid, i in self.groups.get(prompt, {}).items()
                                          if rid != request.request_id), MAX_SIBLINGS))
        for n in range(min(max_n, index.max_n, len(toks)), min(MIN_NGRAM, max_n) - 1, -1):
            gram = tuple(toks[-n:])
            best = index.follow(gram, k, periodic=True)
            for other in (*siblings, *self.history.get(prompt, ())):
                if len(best) >= k:
                    break
                if n > other.max_n:
                    continue
                other.update()
                found = other.follow(gram, k)
                best = found if len(found) > len(best) else best
            if best:
                return best
        return []

    def finish(self, request, keep: bool) -> None:
        """`request` is final: forget its live index; `keep` (it finished normally) files its tokens under its prompt."""
        self.own.pop(request.request_id, None)
        prompt = tuple(request.prompt_ids)
        group = self.groups.get(prompt)
        if group is not None:
            group.pop(request.request_id, None)
            if not group:
                del self.groups[prompt]
        if not keep or self.history_tokens <= 0 or not request.generated:
            return
        done = self.history.setdefault(prompt, [])
        done.append(NgramIndex(list(request.token_ids), self.max_n))  # NOTE: indexed at its first lookup
        self.kept_tokens += len(request.token_ids)
        if len(done) > HISTORY_PER_PROMPT:
            self.kept_tokens -= len(done.pop(0).tokens)
        self.history.move_to_end(prompt)
        while self.kept_tokens > self.history_tokens and self.history:
            _, dropped = self.history.popitem(last=False)
            self.kept_tokens -= sum(len(i.tokens) for i in dropped)
