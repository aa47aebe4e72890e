"""Suffix drafts (`rollout.sampling.drafts`) and the speculator's cost model and calibration
(`rollout.engine.speculation`), without a model: the most frequent continuation wins over the latest one,
counts span the row, its live siblings and the prompt's finished rollouts, a loop continues past the row's end,
estimates fall along a draft and `min_prob` cuts it; the cost model speculates where a step is bound by weight
reads (few rows, a big model or a GPU, likely drafts) and not in a wide batch of unlikely drafts."""

from __future__ import annotations

import itertools
import random
from types import SimpleNamespace

import pytest

from rollout.engine.speculation import Calibration, StepCost, prior
from rollout.kernels import cpu_kernels
from rollout.requests import RequestStatus
from rollout.sampling.drafts import MAX_NGRAM, SMOOTHING, Drafter, NativeIndex, walk


def req(rid: str, prompt: list[int], generated: list[int] = ()):
    return SimpleNamespace(request_id=rid, prompt_ids=list(prompt), token_ids=list(prompt) + list(generated),
                           generated=list(generated), status=RequestStatus.FINISHED)


def test_most_frequent_continuation_not_the_latest():
    # NOTE: (1, 2) was followed by 3 three times, by 4 once -- the latest
    r = req("a", [9], [1, 2, 3, 7, 1, 2, 3, 8, 1, 2, 3, 6, 1, 2, 4, 5, 1, 2])
    toks, probs = Drafter().draft(r, 3, max_n=2)
    assert toks[0] == 3 and probs[0] == pytest.approx(3 / 5)
    assert probs == sorted(probs, reverse=True)  # NOTE: a path's share only falls along the draft
    # NOTE: each continuation seen once: one of the 3 occurrences on the path, smoothed again at this depth
    assert toks[1] in (7, 8, 6) and probs[1] == pytest.approx(3 / 5 * 1 / (3 + SMOOTHING))


def test_the_longest_suffix_decides():
    # NOTE: (5, 1, 2) occurs once, followed by 4; (1, 2) alone mostly by 3
    r = req("a", [9], [1, 2, 3, 1, 2, 3, 5, 1, 2, 4, 0, 5, 1, 2])
    assert Drafter().draft(r, 1, max_n=3)[0] == [4]
    assert Drafter().draft(r, 1, max_n=2)[0] == [3]


def test_a_loop_continues_past_the_rows_end():
    r = req("a", [9], [5, 6, 7, 5, 6, 7, 5, 6])
    toks, probs = Drafter().draft(r, 7, max_n=4)
    assert toks == [7, 5, 6, 7, 5, 6, 7]
    # NOTE: no occurrence leaves a loop's path, but each token is a guess of its own: the estimate falls by the
    # same factor at every depth (the suffix (6, 7, 5, 6) occurred once: 1/2 a token)
    assert probs == pytest.approx([(1 / (1 + SMOOTHING)) ** (d + 1) for d in range(7)])
    toks, probs = Drafter().draft(req("a", [9], [5, 6, 7] * 4 + [5, 6]), 2, max_n=2)
    assert toks == [7, 5] and probs == pytest.approx([4 / 5, (4 / 5) ** 2])  # NOTE: (5, 6) seen 4 times


def test_siblings_and_finished_rollouts_are_counted():
    d = Drafter()
    prompt = [9, 9]
    for i in range(3):  # NOTE: three finished rollouts of the prompt continued (1, 2) with 8
        done = req(f"old{i}", prompt, [1, 2, 8, 0])
        d.track(done)
        d.finish(done, keep=True)
    live = req("live", prompt, [1, 2, 3, 1, 2])  # NOTE: its own text says 3 once
    toks, probs = d.draft(live, 2, max_n=2)
    assert toks == [8, 0] and probs == pytest.approx([3 / 5, 3 / 5 * 3 / (3 + SMOOTHING)])
    sibling = req("sib", prompt, [1, 2, 8, 1, 2, 8, 1, 2])
    d.track(sibling)
    toks, probs = d.draft(live, 1, max_n=2)
    assert toks == [8] and probs[0] == pytest.approx(5 / 7)  # NOTE: 3 history + 2 sibling of 6 occurrences
    other = req("x", [7], [1, 2, 5, 1, 2])  # NOTE: another prompt sees neither
    assert d.draft(other, 1, max_n=2)[0] == [5]


def test_min_prob_and_no_match():
    r = req("a", [9], [1, 2, 3, 7, 1, 2, 4, 7, 1, 2])
    d = Drafter()
    assert d.draft(r, 3, max_n=2, min_prob=0.5) == ([], [])  # NOTE: 3 and 4 each 1/3
    # NOTE: a tie goes to the latest occurrence; its one path is a guess at each token (1/3, then 1/2 of that)
    assert d.draft(r, 3, max_n=2, min_prob=0.1) == ([4, 7], [1 / 3, 1 / 6])
    assert d.draft(r, 3, max_n=2, min_prob=0.0) == ([4, 7, 1], [1 / 3, 1 / 6, 1 / 12])
    assert Drafter().draft(req("b", [9], [1, 2, 3, 4]), 3, max_n=4) == ([], [])


def test_calibration_shortens_a_failing_rows_drafts():
    c = Calibration()
    assert c.scale("r") == 1.0
    for _ in range(5):
        c.record("r", 2.0, 0)  # NOTE: two tokens' worth expected, none kept
    assert c.scale("r") < 0.3
    for _ in range(10):
        c.record("r", 1.0, 2)
    assert c.scale("r") > 1.5


def test_cost_model_weight_bound_vs_compute_bound():
    cpu_100m = StepCost(*prior(100_000_000, 4, "cpu", 2))
    likely = [0.45, 0.4, 0.35, 0.3]
    # NOTE: the tail: 4 rows, drafts kept less than half the time -- verify them
    assert cpu_100m.plan([likely] * 4) == [4, 4, 4, 4]
    # NOTE: 32 rows of text that rarely repeats: a few coin-flip drafts do not pay
    assert cpu_100m.plan([[0.6]] * 16 + [[]] * 16) is None
    # NOTE: 32 rows that loop: they do
    assert cpu_100m.plan([[0.9] * 4] * 32) == [4] * 32
    # NOTE: a GPU step is weight-bound at 32 rows: the same drafts pay there
    gpu = StepCost(*prior(100_000_000, 2, "cuda"))
    assert gpu.plan([[0.6]] * 16 + [[]] * 16) == [1] * 16 + [0] * 16
    # NOTE: per row, the likelier tokens are kept first; the cut falls inside the drafts
    lens = cpu_100m.plan([[0.9, 0.2, 0.05, 0.01]] * 8)
    assert lens is not None and all(0 < n < 4 for n in lens)


def test_the_cost_model_keeps_at_most_room_drafted_tokens_the_likeliest():
    """`room`: the drafted tokens a step may run (a CPU step's small-M kernel rows, less its rows) -- the likeliest
    of them, each row's a prefix of its draft; without it every token that pays."""
    cost = StepCost(0.02, 0.0001)  # NOTE: cheap drafted tokens: every one of these pays
    probs = [[0.9, 0.8, 0.3], [0.95, 0.5], [0.85, 0.7, 0.6, 0.4]]
    assert cost.plan(probs) == [3, 2, 4]
    assert cost.plan(probs, 4) == [2, 1, 1]
    assert cost.plan(probs, 6) == [2, 1, 3]
    assert cost.plan(probs, 0) is None


def test_cost_fit_follows_measured_steps():
    cost = StepCost(0.02, 0.001)
    cost.observe_plain(4, 0.024)
    assert cost.plain_time(4) == pytest.approx(0.024) and cost.plain_time(5) > 0.024
    for extra in (4, 8, 12, 16) * 10:  # NOTE: verifying steps costing 1.5 + 2 x the prior's share
        cost.observe_spec(4, extra, 0.024 * (1.5 + 2 * extra * cost.share(4)))
    assert cost.c0 == pytest.approx(1.5, abs=0.05) and cost.c1 == pytest.approx(2.0, abs=0.2)
    assert cost.min_prob(4) == pytest.approx(cost.c1 * cost.share(4) * 4)


def test_a_spoilt_fit_relaxes_toward_the_prior():
    """Slow verifying steps (a loaded box) stop speculation; plain steps bring the fit back to where it is tried."""
    cost = StepCost(*prior(100_000_000, 4, "cpu", 2))
    cost.observe_plain(4, 0.02)
    likely = [[0.45, 0.4, 0.35, 0.3]] * 4
    for extra in (8, 16) * 10:
        cost.observe_spec(4, extra, 0.1)  # NOTE: 5x a plain step
    assert cost.plan(likely) is None
    for _ in range(200):
        cost.observe_plain(4, 0.02)
    assert cost.plan(likely) == [4, 4, 4, 4]


def test_a_descheduled_step_moves_the_estimates_by_a_bounded_step():
    """Noise on a shared box only adds time: a 50x slower plain step moves the plain estimate by at most 10%, a
    faster one halves the gap; a 50x slower verifying step moves the fit little."""
    cost = StepCost(*prior(100_000_000, 4, "cpu", 2))
    cost.observe_plain(4, 0.02)
    cost.observe_plain(4, 1.0)
    assert cost.plain_time(4) == pytest.approx(0.022)
    cost.observe_plain(4, 0.01)
    assert cost.plain_time(4) == pytest.approx(0.016)
    c0, c1 = cost.c0, cost.c1
    cost.observe_spec(4, 16, 0.8)
    assert cost.c0 + cost.c1 * 16 * cost.share(4) < 1.3 * (c0 + c1 * 16 * cost.share(4))


def test_text_that_does_not_repeat_builds_no_ngram_maps_and_drafts_as_before():
    """The 2-gram check before a lookup (`SuffixIndex.has_pair`): a row whose last two tokens occur in no source
    costs a set, not the n-gram maps; a row whose text repeats drafts exactly what the maps give."""
    import random

    rng = random.Random(0)
    d = Drafter(native=False)  # NOTE: the Python indexes' own state is read
    fresh = req("a", [9], [rng.randrange(10, 10_000) for _ in range(200)])  # NOTE: no 2-gram twice (almost surely)
    assert d.draft(fresh, 4, max_n=4) == ([], [])
    assert all(not m for m in d.track(fresh).maps)  # NOTE: nothing indexed
    d.track(fresh).update()  # NOTE: the maps say the same: no 2-gram of the row is followed twice
    assert d.draft(fresh, 4, max_n=4) == ([], [])
    text = [rng.choice([1, 2, 3, 4]) for _ in range(60)]
    for n in (2, 3, 4):
        a, b = Drafter(native=False), Drafter(native=False)
        r = req("b", [9], text)
        b.track(r, n).update()  # NOTE: maps built first: the lookup path without the check's early return
        assert a.draft(r, 6, max_n=n) == b.draft(req("b", [9], text), 6, max_n=n)
        assert a.draft(r, 6, max_n=n)[0]  # NOTE: it does draft


def test_a_pair_seen_only_in_a_sibling_or_a_finished_rollout_still_drafts():
    d = Drafter()
    done = req("old", [9, 9], [1, 2, 8, 0])
    d.track(done)
    d.finish(done, keep=True)
    assert d.draft(req("live", [9, 9], [5, 1, 2]), 2, max_n=2)[0] == [8, 0]  # NOTE: (1, 2) is new to the row
    d.track(req("sib", [7], [3, 4, 6]))
    assert d.draft(req("b", [7], [3, 4]), 1, max_n=2)[0] == [6]


def _walk_each_occurrence(sources, periodic, k, min_prob):
    """The walk one occurrence at a time (the definition `walk` groups by continuation)."""
    occ = [(toks, p, periodic is not None and i == 0) for i, (toks, ps) in enumerate(sources) for p in reversed(ps)]
    draft, probs, prob = [], [], 1.0
    for d in range(k):
        counts, step = {}, []
        for o in occ:
            q = o[1] + d
            if q < len(o[0]):
                t = o[0][q]
            elif o[2]:
                t = draft[q - len(o[0])]
            else:
                continue
            counts[t] = counts.get(t, 0) + 1
            step.append((o, t))
        if not counts:
            break
        best = max(counts, key=counts.__getitem__)
        prob *= counts[best] / (len(occ) + SMOOTHING)  # NOTE: the share of the occurrences still on the path
        if prob < min_prob:
            break
        draft.append(best)
        probs.append(prob)
        occ = [o for o, t in step if t == best]
    return draft, probs


def test_walk_equals_the_walk_over_each_occurrence():
    rng = random.Random(7)
    for trial in range(400):
        alphabet = rng.randint(2, 6)
        sources = []
        for _ in range(rng.randint(1, 4)):
            toks = [rng.randrange(alphabet) for _ in range(rng.randint(3, 60))]
            ps = sorted(rng.sample(range(1, len(toks)), rng.randint(1, min(len(toks) - 1, 20))))
            sources.append((toks, ps))
        periodic = sources[0][1] if trial % 2 else None
        k, min_prob = rng.randint(1, 10), rng.choice((0.0, 0.1, 0.3))
        assert walk(sources, periodic, k, min_prob) == _walk_each_occurrence(sources, periodic, k, min_prob), trial


def _trial(rng: random.Random, native: bool, alphabet: int, prompt_len: int, prompts: int) -> tuple:
    """A trial's (Python drafter, drafter under test), alphabet size (2 .. `alphabet`) and random prompts."""
    size = rng.randint(2, alphabet)
    texts = [[rng.randrange(size) for _ in range(rng.randint(2, prompt_len))] for _ in range(prompts)]
    return (Drafter(history_tokens=600, native=False), Drafter(history_tokens=600, native=native)), size, texts


def _advance(rng: random.Random, rows: dict, rid: str, drafters: tuple, alphabet: int, finish: float,
             repeat: float) -> bool:
    """One random step of row `rid` (a pair of equal requests, one per drafter): finished with probability `finish`
    (filed under its prompt, or dropped: False), else its last token written over at times (a draft may have read
    it) and 0-3 tokens appended, each a repeat of one of its last 6 with probability `repeat`."""
    a, b = rows[rid]
    if rng.random() < finish and a.generated:
        keep = rng.random() < 0.8
        for d, r in zip(drafters, (a, b), strict=True):
            d.finish(r, keep)
        del rows[rid]
        return False
    if rng.random() < 0.1 and a.generated:
        t = rng.randrange(alphabet)
        a.token_ids[-1] = b.token_ids[-1] = a.generated[-1] = b.generated[-1] = t
    for _ in range(rng.randint(0 if a.generated else 1, 3)):
        t = rng.randrange(alphabet) if rng.random() < 1 - repeat else (a.token_ids[-rng.randint(1, 6)]
                                                                       if len(a.token_ids) > 6 else 0)
        for r in (a, b):
            r.token_ids.append(t)
            r.generated.append(t)
    return True


@pytest.mark.skipif(cpu_kernels.load() is None, reason="rollout's CPU kernels unavailable here (no compiler)")
def test_the_native_drafter_drafts_what_the_python_one_does():
    """The C++ indexes and lookup (`NativeIndex`, rollout/kernels/csrc/suffix_drafts.cpp) against this module's Python
    ones on random growing rows of small alphabets (text that repeats): live siblings, finished rollouts filed and
    dropped (a small history), every suffix length 1-8, k 1-12, a `min_prob` cut, a last token written over: the
    same drafts and the same estimates, float for float, at every step."""
    rng, live = random.Random(11), 0
    for trial in range(40):
        (py, cc), alphabet, prompts = _trial(rng, True, 9, 30, 3)
        rows: dict[str, tuple] = {}
        drafted = 0
        for step in range(150):
            if len(rows) < 5 and rng.random() < 0.2:  # NOTE: a new row; its prompt maybe a sibling's
                prompt = rng.choice(prompts)
                rid = f"t{trial}r{step}"
                rows[rid] = (req(rid, prompt), req(rid, prompt))
            if not rows:
                continue
            rid = rng.choice(sorted(rows))
            a, b = rows[rid]
            if not _advance(rng, rows, rid, (py, cc), alphabet, finish=0.1, repeat=0.3):
                continue
            k, max_n = rng.randint(1, 12), rng.randint(1, MAX_NGRAM)
            min_prob = rng.choice((0.0, 0.0, 0.05, 0.2))
            want = py.draft(a, k, max_n, min_prob)
            got = cc.draft(b, k, max_n, min_prob)
            assert got == want, (trial, step, k, max_n, min_prob)
            drafted += bool(want[0])
        assert drafted > 10, trial  # NOTE: the rows did repeat: drafts were compared, not only empty ones
        assert all(isinstance(cc.track(b), NativeIndex) and not isinstance(py.track(a), NativeIndex)
                   for a, b in rows.values())  # NOTE: the two drafters did differ
        live += len(rows)
    assert live > 0


def test_the_native_drafter_reads_an_ngrams_occurrences_as_the_python_list_holds_them():
    """An n-gram seen hundreds of times (rows of 2-3 token kinds, 1,200 tokens, a sibling and a finished rollout): the
    C++ hash chains give the positions Python's list holds -- it grows to 2 x POSITIONS, then keeps the latest
    POSITIONS -- at every length, so the same drafts and estimates, float for float."""
    if cpu_kernels.load() is None:
        pytest.skip("rollout's C++ CPU kernels are unavailable here")
    rng = random.Random(5)
    for size in (2, 3):
        py, cc = Drafter(native=False), Drafter(native=True)
        prompt = [rng.randrange(size) for _ in range(8)]
        done = [rng.randrange(size) for _ in range(700)]
        for d in (py, cc):
            d.finish(req("done", prompt, done), keep=True)
        pairs = [(req(rid, prompt), req(rid, prompt)) for rid in ("a", "b")]
        compared = 0
        for step in range(1200):
            t = rng.randrange(size)
            a, b = pairs[step % 2]
            for r in (a, b):
                r.token_ids.append(t)
                r.generated.append(t)
            if step % 7:
                continue
            for max_n in (1, 2, 4, MAX_NGRAM):
                want = py.draft(a, 6, max_n)
                assert cc.draft(b, 6, max_n) == want, (size, step, max_n)
                compared += bool(want[0])
        assert compared > 300, compared
        assert isinstance(cc.track(pairs[0][1]), NativeIndex)


@pytest.mark.parametrize("native", [False, True])
def test_drafting_a_steps_rows_in_one_call_drafts_what_each_row_alone_does(native):
    """`Drafter.draft_many` (one C++ call a step: each row's sources kept on its index and chosen again only when a
    group or a history changed, the token lists read by the C++ side) against `draft` row by row on a Python drafter
    of its own: random growing rows of small alphabets, several rows of one prompt (siblings) joining and finishing,
    finished rollouts filed and dropped, a last token written over, every row of the step at once with its own k,
    suffix length and `min_prob`: the same drafts and the same estimates, float for float."""
    if native and cpu_kernels.load() is None:
        pytest.skip("rollout's CPU kernels unavailable here (no compiler)")
    rng, drafted = random.Random(23), 0
    for trial in range(30):
        (one, many), alphabet, prompts = _trial(rng, native, 8, 20, 2)
        rows: dict[str, tuple] = {}
        for step in range(120):
            while len(rows) < 6 and rng.random() < 0.3:  # NOTE: new rows, siblings of each other half the time
                prompt, rid = rng.choice(prompts), f"t{trial}r{step}_{len(rows)}"
                rows[rid] = (req(rid, prompt), req(rid, prompt))
            for rid in sorted(rows):
                _advance(rng, rows, rid, (one, many), alphabet, finish=0.05, repeat=0.4)
            if not rows:
                continue
            order = sorted(rows)
            rng.shuffle(order)
            looked = order[: rng.randint(1, len(order))]  # NOTE: some rows skip a step (idle spells): sources go stale
            ks = [rng.randint(1, 12) for _ in looked]
            ns = [rng.randint(1, MAX_NGRAM) for _ in looked]
            mins = [rng.choice((0.0, 0.0, 0.05, 0.2)) for _ in looked]
            for rid, n in zip(looked, ns, strict=True):  # NOTE: every row of the step seen first, as `draft_many` does
                one.track(rows[rid][0], n)
            want = [one.draft(rows[rid][0], k, n, p) for rid, k, n, p in zip(looked, ks, ns, mins, strict=True)]
            got = many.draft_many([rows[rid][1] for rid in looked], ks, ns, mins)
            assert [tuple(g) for g in got] == want, (trial, step)
            drafted += sum(bool(w[0]) for w in want)
    assert drafted > 300  # NOTE: the rows did repeat: drafts were compared, not only empty ones


@pytest.mark.skipif(cpu_kernels.load() is None, reason="rollout's CPU kernels unavailable here (no compiler)")
def test_a_tail_whose_text_does_not_repeat_is_told_so_in_one_call():
    """`Drafter.nothing_to_draft`: True only for the last `draft_many` call's rows, unchanged since, none of whose
    last 2 tokens occurs in its own text, a sibling's or a finished rollout's -- and then `draft_many` indeed drafts
    nothing; a repeat in any source, another set of rows, a finished row or a 1-token suffix make it say False."""
    d = Drafter(native=True)
    fresh = itertools.count(1000)
    rows = [req(f"r{i}", [next(fresh) for _ in range(5)]) for i in range(3)]
    rows.append(req("r3", rows[0].prompt_ids))  # NOTE: a sibling of r0

    def grow(r, t):
        r.token_ids.append(t)
        r.generated.append(t)

    def lookup():
        return d.draft_many(list(rows), [4] * 4, [4] * 4, [0.0] * 4)

    assert not d.nothing_to_draft(rows)  # NOTE: nothing looked up yet
    assert lookup() == [([], [])] * 4
    for _ in range(5):
        for r in rows:
            grow(r, next(fresh))
        assert d.nothing_to_draft(list(rows)) and lookup() == [([], [])] * 4
    assert not d.nothing_to_draft(rows[:3])  # NOTE: not the rows looked up last
    grow(rows[1], rows[1].token_ids[-3])
    grow(rows[1], rows[1].token_ids[-3])  # NOTE: r1 ends with a 2-gram it holds earlier
    assert not d.nothing_to_draft(rows) and lookup()[1][0]
    grow(rows[1], next(fresh))
    assert lookup() == [([], [])] * 4 and d.nothing_to_draft(rows)
    for t in rows[0].token_ids[-2:]:  # NOTE: r3 ends with its sibling r0's last 2 tokens
        grow(rows[3], t)
    grow(rows[0], next(fresh))
    assert not d.nothing_to_draft(rows) and lookup()[3][0]
    grow(rows[3], next(fresh))
    assert lookup() == [([], [])] * 4 and d.nothing_to_draft(rows)
    d.finish(rows.pop(0), keep=True)  # NOTE: r0 finished: filed as r3's prompt's history
    assert not d.nothing_to_draft(rows)
    assert d.draft_many(list(rows), [4] * 3, [4] * 3, [0.0] * 3) == [([], [])] * 3 and d.nothing_to_draft(rows)
    for t in d.history[tuple(rows[2].prompt_ids)][0].tokens[-4:-2]:  # NOTE: r3 now repeats r0's finished text
        grow(rows[2], t)
    assert not d.nothing_to_draft(rows) and d.draft_many(list(rows), [4] * 3, [4] * 3, [0.0] * 3)[2][0]
    grow(rows[2], next(fresh))
    d.draft_many(list(rows), [4] * 3, [1, 4, 4], [0.0] * 3)
    assert not d.nothing_to_draft(rows)  # NOTE: a 1-token suffix asked for: no pair check decides
