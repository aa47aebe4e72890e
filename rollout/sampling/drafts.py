"""Suffix drafts for speculative decoding: the continuation that most often followed a row's current suffix.

Three sources: the row's own tokens (prompt + generated: transformers' prompt lookup), its live group siblings'
(the requests sampling the same prompt now), and a bounded history of the same prompt's finished rollouts, kept
across calls (RL samples a prompt again every epoch). Each source's `SuffixIndex` holds, for every n-gram of its
tokens (n = 1 .. its depth), the positions that followed it: a suffix trie of bounded depth over the source, whose
nodes are the n-grams and whose subtrees are read off the tokens after those positions.

A draft (`Drafter.draft`) finds the longest suffix of the row's context (at most `max_n` tokens, at least
`MIN_NGRAM`) that occurs in any source, then walks the continuations of all its occurrences together, as
SuffixDecoding walks a suffix tree's subtree: at each depth the token that followed most often, counted over
every source (frequency, not the first or latest match), and its share of the occurrences still on the path.
Each drafted token carries a probability estimate, the share of the suffix's occurrences whose continuation
follows the draft that far, smoothed (`SMOOTHING`: one occurrence says 1/2, four that agree 4/5); the walk stops at `k`
tokens or where the estimate falls below the caller's `min_prob` (the speculator's cost model: a token worth verifying).
The row's own match running into its end continues with the draft itself (a loop repeats).

Drafts only choose which tokens the verifying forward tries; they never change what is sampled
(`rollout.sampling.speculative`). No torch. Where rollout's C++ CPU kernels are loaded (an engine on a CPU), the
indexes and the lookup run in C++ (`rollout/kernels/csrc/suffix_drafts.cpp`: `NativeIndex`), the same drafts and
estimates bit for bit (tests/sampling/test_drafts.py); this module is their reference and the fallback.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Callable

DEFAULT_NGRAM = 4  # NOTE: the longest suffix matched unless a request asks (`max_matching_ngram_size`)
# NOTE: a single repeated token predicts the next one ~1-3% of the time on the benchmarks' random models (a
# loop, a sibling's or an earlier rollout's text matches 2+ tokens): drafts start at 2 unless a request asks for 1
MIN_NGRAM = 2
MAX_NGRAM = 8  # the deepest index (`max_matching_ngram_size` is capped at it)
MAX_SIBLINGS = 16  # NOTE: live requests of the same prompt looked in per draft (a GRPO group's size)
HISTORY_PER_PROMPT = 16  # finished rollouts kept per prompt
HISTORY_TOKENS = 1 << 17  # NOTE: tokens of finished rollouts kept across calls (their indexes: ~4 entries a token)
POSITIONS = 32  # NOTE: the most recent occurrences an n-gram keeps (older ones are counted no more)
SMOOTHING = 1.0  # NOTE: a path that c of the suffix's m occurrences continue has probability c / (m + SMOOTHING)


class SuffixIndex:
    """The positions following every n-gram (n = 1 .. `max_n`) of a growing token list (the latest `POSITIONS`).

    Args:
        tokens: the list indexed (read, never copied: it may grow between calls to `update`).
        max_n: the longest n-gram indexed.
    """

    def __init__(self, tokens: list[int], max_n: int) -> None:
        self.tokens = tokens
        self.max_n = max_n
        # NOTE: n-1 -> n-gram -> positions p (ascending) with tokens[p - n : p] == n-gram
        self.maps: list[dict[tuple[int, ...], list[int]]] = [{} for _ in range(max_n)]
        self.upto = 1  # NOTE: next position p whose preceding n-grams are not indexed yet
        self.pairs: set[tuple[int, int]] = set()  # NOTE: the 2-grams followed by a token (`has_pair`)
        self.pairs_upto = 2
        self.prompt: tuple[int, ...] = ()  # NOTE: a live request's prompt (`Drafter.track`): its group's key

    def update(self) -> None:
        """Index the n-grams that gained a following token since the last call."""
        toks, maps = self.tokens, self.maps
        for p in range(self.upto, len(toks)):
            for n in range(1, min(self.max_n, p) + 1):
                at = maps[n - 1].get(gram := tuple(toks[p - n : p]))
                if at is None:
                    maps[n - 1][gram] = [p]
                else:
                    at.append(p)
                    if len(at) > 2 * POSITIONS:
                        del at[:-POSITIONS]
        self.upto = max(self.upto, len(toks))

    def has_pair(self, pair: tuple[int, int]) -> bool:
        """Whether `pair` was followed by a token: the check before a lookup, ~20x cheaper a token to keep than
        the n-gram maps, so a row whose text does not repeat never builds them."""
        toks, pairs = self.tokens, self.pairs
        for p in range(self.pairs_upto, len(toks)):
            pairs.add((toks[p - 2], toks[p - 1]))
        self.pairs_upto = max(self.pairs_upto, len(toks))
        return pair in pairs

    def positions(self, gram: tuple[int, ...]) -> list[int]:
        """Where `gram` was followed by a token (ascending; the latest `POSITIONS` or a few more)."""
        return self.maps[len(gram) - 1].get(gram, ())


class NativeIndex:
    """A `SuffixIndex` kept in C++ (`cpu_kernels.suffix_drafts()`): the same n-grams, positions and pairs over a
    copy of `tokens` (a list the C++ index reads itself: `pull`, the last token copied and the new ones, at each
    lookup). `sources` are the other indexes its row's lookups read (`Drafter.draft_many`), held here so that the
    C++ copy's pointers to them stay valid; `seen` is the drafter's `version` they were chosen at, `stamp` its prompt's
    cell of `Drafter.changed` (the version its group or history last changed at)."""

    __slots__ = ("max_n", "native", "prompt", "seen", "short", "sources", "stamp", "tokens")

    def __init__(self, tokens: list[int], max_n: int, module) -> None:
        self.tokens = tokens
        self.max_n = max_n
        if not isinstance(tokens, list):  # NOTE: the C++ side reads this very list as it grows (`pull`)
            raise TypeError(f"NativeIndex follows a list of token ids, not {type(tokens).__name__}")
        self.native = module.SuffixIndexNative(max_n)
        self.native.bind(tokens)
        self.prompt: tuple[int, ...] = ()
        self.sources: list = []
        self.seen = -1
        self.stamp = [0]
        self.short = False

    def freeze(self) -> None:
        """Its tokens are final (a finished rollout): copied once, the list let go (never pulled again)."""
        self.native.freeze()


def walk(sources: list[tuple[list[int], list[int]]], periodic: list[int] | None, k: int,
         min_prob: float) -> tuple[list[int], list[float]]:
    """The most frequent continuation of the occurrences `sources` ((tokens, positions following the suffix) per
    source) and each token's probability estimate; `periodic` (positions in the row's own tokens, the first
    source) continue past its end with the draft itself. Stops at `k` tokens or below `min_prob`."""
    # NOTE: occurrences with the same next k tokens walk alike: each distinct continuation once, with its count,
    # in the order first seen (ties go to the token seen first: the row's own latest). A continuation cut short by
    # its source's end stops there, unless it is the row's own (periodic): it then goes on with the draft.
    paths: dict[tuple[tuple[int, ...], bool], int] = {}
    total = 0
    for i, (toks, ps) in enumerate(sources):
        own, end = periodic is not None and i == 0, len(toks)
        for p in reversed(ps):
            key = (tuple(toks[p : p + k]), own and p + k > end)
            paths[key] = paths.get(key, 0) + 1
        total += len(ps)
    live = [(cont, loops, n) for (cont, loops), n in paths.items()]
    draft: list[int] = []
    probs: list[float] = []
    on, prob = total, 1.0  # NOTE: occurrences on the path drafted so far, its estimate
    for d in range(k):
        counts: dict[int, int] = {}
        step = []  # NOTE: (path, the token it has at depth d) where it has one
        for path in live:
            cont = path[0]
            if d < len(cont):
                t = cont[d]
            elif path[1]:
                t = draft[d - len(cont)]
            else:
                continue
            counts[t] = counts.get(t, 0) + path[2]
            step.append((path, t))
        if not counts:
            break
        best = max(counts, key=counts.__getitem__)  # NOTE: ties: the token seen first (the row's own latest)
        # NOTE: smoothed at every depth, not only the first: a path that one occurrence alone continues is a
        # guess at each token (kept ~60% of the time on the 5M tail's text at any depth, where an estimate
        # smoothed once said ~100% after the first token and the drafts ran long)
        prob *= counts[best] / (on + SMOOTHING)
        on = counts[best]
        if prob < min_prob:
            break
        draft.append(best)
        probs.append(prob)
        live = [path for path, t in step if t == best]
    return draft, probs


class Drafter:
    """Per-request suffix indexes, the live requests grouped by prompt, and the prompts' finished rollouts.

    Indexes are built lazily (a request's own at its first draft, a sibling's or a finished rollout's at the first
    lookup in it), so requests that never speculate cost a list copy at most.

    Args:
        history_tokens: most tokens of finished rollouts kept (least recently sampled prompts dropped first).
        max_n: the deepest index of siblings tracked before drafting and of finished rollouts.
    """

    def __init__(self, history_tokens: int = HISTORY_TOKENS, max_n: int = DEFAULT_NGRAM,
                 native: bool | None = None) -> None:
        self.max_n = max_n
        self.own: dict[str, SuffixIndex] = {}  # request id -> index of its tokens
        self.groups: dict[tuple[int, ...], dict[str, SuffixIndex]] = {}  # prompt -> live requests' indexes
        self.history: OrderedDict[tuple[int, ...], list[SuffixIndex]] = OrderedDict()  # prompt -> finished ones
        self.history_tokens, self.kept_tokens = history_tokens, 0
        # NOTE: the C++ indexes (`NativeIndex`), chosen at the first index made and kept: None decides then (the
        # kernels loaded or not), True / False ask (True without the kernels: Python, as None)
        self.native: object | None = None
        self._native_wanted = native
        self._decided = False
        self.version = 0  # NOTE: bumped whenever a group or a history changes
        # NOTE: prompt -> [the version its group or history last changed at]: a row's sources are chosen again when
        # its own prompt's changed since (a row finishing elsewhere leaves them be: in a draining 32-row batch every
        # row's sources were chosen again at each of its 32 finishes). A one-item list that the prompt's live indexes
        # hold (`stamp`), so that a step reads it without hashing the prompt (a tuple of hundreds of ids hashed per
        # row: ~1/4 of a 32-row step's planning on the log-normal batch, 5803)
        self.changed: dict[tuple[int, ...], list[int]] = {}
        # NOTE: the last `draft_many` call's rows, their native indexes and the version their sources were chosen at,
        # when every row matched suffixes of 2+ tokens (`nothing_to_draft`), else None
        self.last: tuple[list, list, int] | None = None
        # NOTE: called with (request, its `SuffixIndexNative`) when a live row's native index is made: the speculator
        # keeps its row's planning state there (`Speculator._setup`, `natives`)
        self.setup: Callable | None = None
        self.short = 0  # NOTE: live native indexes of rows matching suffixes shorter than MIN_NGRAM (`natives`)

    def _decide(self) -> None:
        self._decided = True
        if self._native_wanted is not False:
            from rollout.kernels import cpu_kernels  # noqa: PLC0415 - only where a drafter drafts

            self.native = cpu_kernels.suffix_drafts() if self._native_wanted is None else cpu_kernels.load()

    def ready(self):
        """The C++ module the indexes are kept in (decided at the first call), or None (Python indexes)."""
        if not self._decided:
            self._decide()
        return self.native

    def _index(self, tokens: list[int], max_n: int):
        if not self._decided:
            self._decide()
        return SuffixIndex(tokens, max_n) if self.native is None else NativeIndex(tokens, max_n, self.native)

    def track(self, request, max_n: int | None = None) -> SuffixIndex:
        """The live index of `request` (created, unfilled, on first sight; n-grams up to `max_n`)."""
        index = self.own.get(request.request_id)
        if index is None:
            depth = min(max(max_n or self.max_n, self.max_n), MAX_NGRAM)
            index = self.own[request.request_id] = self._index(request.token_ids, depth)
            index.prompt = tuple(request.prompt_ids)
            if isinstance(index, NativeIndex):
                index.short = (max_n or self.max_n) < MIN_NGRAM
                self.short += index.short
                if self.setup is not None:
                    self.setup(request, index.native)
            self.groups.setdefault(index.prompt, {})[request.request_id] = index
            self.version += 1
            index.stamp = self._stamp(index.prompt)
        return index

    def _stamp(self, prompt: tuple[int, ...]) -> list[int]:
        """`prompt`'s cell of `changed`, set to the current version."""
        cell = self.changed.get(prompt)
        if cell is None:
            cell = self.changed[prompt] = [self.version]
        else:
            cell[0] = self.version
        return cell

    def _others(self, index) -> tuple[list, tuple]:
        """The indexes `index`'s row reads besides its own: its live siblings (at most `MAX_SIBLINGS`, the group's
        order), then its prompt's finished rollouts."""
        group = self.groups[index.prompt]
        others = list(itertools.islice((i for i in group.values() if i is not index), MAX_SIBLINGS)) \
            if len(group) > 1 else []
        return others, self.history.get(index.prompt, ())

    def draft(self, request, k: int, max_n: int, min_prob: float = 0.0) -> tuple[list[int], list[float]]:
        """Up to `k` tokens likely to follow `request.token_ids` and each one's probability estimate (empty when
        no suffix of 2+ tokens -- `max_n` 1: 1 -- occurs in a source, or the first token's estimate is below
        `min_prob`)."""
        index = self.track(request, max_n)
        if self.native is not None:
            return self.draft_many([request], [k], [max_n], [min_prob])[0]
        toks = request.token_ids
        others, done = self._others(index)
        shortest = min(MIN_NGRAM, max_n)
        others += done
        if shortest >= 2 and len(toks) >= 2:  # NOTE: every suffix tried ends with the last 2 tokens: none, no draft
            pair = (toks[-2], toks[-1])
            if not index.has_pair(pair) and not any(other.has_pair(pair) for other in others):
                return [], []
        index.update()
        for other in others:
            other.update()
        for n in range(min(max_n, index.max_n, len(toks)), shortest - 1, -1):
            gram = tuple(toks[-n:])
            own = index.positions(gram)
            sources = [(toks, own)]
            sources += [(o.tokens, ps) for o in others if n <= o.max_n and (ps := o.positions(gram))]
            if own or len(sources) > 1:
                return walk(sources, own, k, min_prob)
        return [], []

    def draft_many(self, requests: list, ks: list[int], max_ns: list[int],
                   min_probs: list[float]) -> list[tuple[list[int], list[float]]]:
        """`draft` of each of `requests` (the same drafts and estimates). With the C++ indexes, one call for all of
        them: each row's sources are kept on its index (chosen again only when a group or a history changed:
        `version`), and the C++ side reads the rows' token lists itself. Every row is tracked before any is looked
        up, so the rows of one step read each other as siblings whatever their order."""
        if not self._decided:
            self._decide()
        if self.native is None:
            for r, n in zip(requests, max_ns, strict=True):
                self.track(r, n)
            return [self.draft(*a) for a in zip(requests, ks, max_ns, min_probs, strict=True)]
        owns = self.natives(requests, max_ns)
        return self.native.suffix_drafts(owns, ks, max_ns, min_probs)  # NOTE: shortest min(MIN_NGRAM, max_n) there

    def _choose(self, index: NativeIndex) -> None:
        """`index`'s sources chosen again (its prompt's group or history changed since they were)."""
        others, done = self._others(index)
        index.sources = [o.native for o in others] + [o.native for o in done]
        index.native.set_sources(index.sources)
        index.seen = self.version

    def natives(self, requests: list, max_ns: list[int] | None = None) -> list:
        """The C++ indexes of `requests` (each tracked on first sight, n-grams up to `max_ns`' or else its request's
        `max_matching_ngram_size`), each with its sources chosen again where its prompt's group or history changed
        since: the rows of one C++ call (`draft_many`; `Speculator`'s `plan_drafts`). Only with the C++ indexes
        (`ready`). The last call's list when the rows are the same objects and nothing was tracked or finished since
        (most steps of a batch). They become `last` unless a row may match a suffix shorter than MIN_NGRAM (one of
        `max_ns`, or without them a live row's)."""
        last = self.last
        if last is not None and last[2] == self.version and last[0] == requests:
            owns = last[1]
        else:
            own, track = self.own, self.track
            # NOTE: every row tracked before any chooses its sources: the rows of one step are each other's siblings
            indexes = [own.get(r.request_id) or track(r, max_ns[i] if max_ns is not None
                                                      else r.sampling.max_matching_ngram_size or DEFAULT_NGRAM)
                       for i, r in enumerate(requests)]
            owns = []
            for index in indexes:
                if index.seen < index.stamp[0]:
                    self._choose(index)
                owns.append(index.native)
        short = min(max_ns) < MIN_NGRAM if max_ns is not None else self.short
        self.last = None if short else (requests, owns, self.version)
        return owns

    def nothing_to_draft(self, requests: list) -> bool:
        """True when `draft_many` of `requests` would draft nothing for sure: they are the last call's rows (the same
        objects, sources unchanged since) and no row's last 2 tokens occur in its sources (one C++ call). False
        when unknown: a draft is then looked up as usual. A tail of rows whose text never repeats skips the Python
        of its lookups this way (4 such 5M rows, timed in the engine: the step's planning ~49 -> ~17 us of a ~2 ms
        step, this call ~12 us of it; in a loop it takes ~1 us)."""
        last = self.last
        if last is None or last[2] != self.version or last[0] != requests:
            return False
        return not self.native.any_pairs(last[1])

    def finish(self, request, keep: bool) -> None:
        """`request` is final: forget its live index; `keep` (it finished normally) files its tokens under its
        prompt."""
        index = self.own.pop(request.request_id, None)
        if isinstance(index, NativeIndex):
            self.short -= index.short
        self.version += 1
        self.last = None
        prompt = tuple(request.prompt_ids)
        self._stamp(prompt)
        group = self.groups.get(prompt)
        if group is not None:
            group.pop(request.request_id, None)
            if not group:
                del self.groups[prompt]
                if prompt not in self.history:
                    del self.changed[prompt]
        if not keep or self.history_tokens <= 0 or not request.generated:
            return
        done = self.history.setdefault(prompt, [])
        done.append(index := self._index(list(request.token_ids), self.max_n))  # NOTE: indexed at its first lookup
        if isinstance(index, NativeIndex):
            index.freeze()
        self.kept_tokens += len(request.token_ids)
        if len(done) > HISTORY_PER_PROMPT:
            self.kept_tokens -= len(done.pop(0).tokens)
        self.history.move_to_end(prompt)
        while self.kept_tokens > self.history_tokens and self.history:
            gone, dropped = self.history.popitem(last=False)
            if gone in self.groups:
                self._stamp(gone)
            else:
                self.changed.pop(gone, None)
            self.kept_tokens -= sum(len(i.tokens) for i in dropped)
