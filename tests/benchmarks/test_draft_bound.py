"""`benchmarks/draft_bound.py`'s replay (issue 60): free verification of a row's own text with the speculator's
drafter, and the longest-match hit rate, on texts whose answers are known."""

from __future__ import annotations

import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from draft_bound import free_verify, next_hit  # noqa: E402


def test_a_loop_is_drafted_and_new_text_is_not():
    prompt = [7, 8, 9]
    loop = [1, 2, 3, 4] * 25
    steps, drafted, kept = free_verify(prompt, loop, k=8)
    assert steps < 30 and kept == len(loop) - steps  # NOTE: every token either drafted and kept or a step's own
    assert next_hit(prompt, loop) > 0.9
    rng = random.Random(0)
    fresh = rng.sample(range(10, 100_000), 100)  # NOTE: no id twice: nothing ever matches
    assert free_verify(prompt, fresh, k=8) == (100, 0, 0)
    assert next_hit(prompt, fresh) == 0.0


def test_the_bound_counts_a_break_in_the_loop():
    prompt = [7, 8, 9]
    text = [1, 2, 3, 4] * 5 + [5] + [1, 2, 3, 4] * 5  # NOTE: the 5 is a break no drafter sees coming
    steps, drafted, kept = free_verify(prompt, text, k=4)
    assert kept == len(text) - steps and drafted >= kept
    assert steps > free_verify(prompt, [1, 2, 3, 4] * 10 + [1], k=4)[0]  # NOTE: the break costs steps
    # NOTE: the 5 and the tokens just after it are not foreseen (30 of 41; counting every match as a hit: 37)
    assert 0.65 < next_hit(prompt, text) < 0.8
    one = [1, 2, 3, 4] * 5 + [1, 2, 5, 6, 7, 8]  # NOTE: a token a step: after (1, 2) the draft says 3, the text 5
    steps, drafted, kept = free_verify(prompt, one, k=1)
    assert drafted == kept + 1 and kept == len(one) - steps


def test_the_price_of_drafted_tokens():
    from draft_bound import priced, replay

    prompt, loop = [7, 8, 9], [1, 2, 3, 4] * 25
    rows = [replay(prompt, loop, 8)]
    assert priced(rows, len(loop), 0.0) == len(loop) / len(rows[0])  # NOTE: free: tokens / steps
    assert priced(rows, len(loop), 0.03) < priced(rows, len(loop), 0.0)
    steps = len(rows[0])
    drafted = sum(d for d, _ in rows[0])
    assert priced(rows, len(loop), 0.03) == len(loop) / (steps + 0.03 * drafted)  # NOTE: one row: its own steps
    assert replay(prompt, loop, 8, min_prob=0.99) == [(0, 0)] * len(loop)  # NOTE: no estimate reaches 0.99 early


def test_the_speculators_own_planning_replayed():
    from draft_bound import planned

    prompt, loop = [7, 8, 9], [1, 2, 3, 4] * 25
    x, drafted, kept = planned([(prompt, loop), (prompt, loop)], 0.01, 0.05, 8)
    assert x > 1.5 and 0 < kept <= drafted  # NOTE: a loop is drafted, verified and kept
    assert planned([(prompt, loop)], 0.01, 0.5, 8)[0] < planned([(prompt, loop)], 0.01, 0.0, 8)[0]  # NOTE: its cost
    rng = random.Random(1)
    fresh = rng.sample(range(10, 100_000), 120)
    assert planned([(prompt, fresh), (prompt, fresh[::-1])], 0.01, 0.05, 8) == (1.0, 0, 0)  # NOTE: nothing repeats
    # NOTE: the 5 is a break, inside a cycle: a draft across it fails (at a cycle's end, a row looked up every step
    # drafts up to it and emits the 5 as the token after its draft)
    text = [1, 2, 3, 4] * 5 + [1, 2, 5] + [1, 2, 3, 4] * 5
    x, drafted, kept = planned([(prompt, text)], 0.0, 0.0, 4)
    assert 0 < kept < drafted and x == len(text) / (len(text) - kept)  # NOTE: free: one row's tokens / its steps
    # NOTE: dearer drafted tokens: the cost model verifies fewer of them
    assert planned([(prompt, loop)], 0.2, 0.05, 8)[1] < planned([(prompt, loop)], 0.01, 0.05, 8)[1]
