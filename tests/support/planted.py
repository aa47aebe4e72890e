"""Planted drafts for speculative-step tests: each row verified against its true continuation (a plain run's tokens)
with a wrong token at a position that cycles through `wrongs`, so every kind of verifying step happens -- rejected at
once, kept in part, kept whole."""

from __future__ import annotations


def plant_drafts(core, truth: list[list[int]], k: int, max_new: int, vocab: int,
                 wrongs: tuple = (0, 2, None, 1)) -> None:
    """Make `core`'s speculator draft, for request "r<i>", the next `k` tokens of `truth[i]` (at most up to
    `max_new - 1`), one of them wrong by `wrongs`' cycle, and verify every drafted row whatever the timing says."""
    core.speculator.max_rows = 64
    calls = iter(range(10**6))

    def planted(req, min_prob):
        i, n = int(req.request_id[1:]), len(req.generated)
        draft = list(truth[i][n : n + min(k, max_new - n - 1)])
        wrong = wrongs[(i + next(calls)) % len(wrongs)]
        if wrong is not None and wrong < len(draft):
            draft[wrong] = (draft[wrong] + 1) % vocab
        return draft, [1.0] * len(draft)

    core.speculator.native_plan = False  # NOTE: planned in Python, through `_drafts`
    core.speculator._drafts = lambda reqs, min_prob, spells=True: [planted(r, min_prob) for r in reqs]
