import itertools
from math import comb

import numpy as np
import pytest

from trainers.passk import mean_pass_at_k, pass_at_k, pass_at_k_array


def brute_force(n: int, c: int, k: int) -> float:
    """Share of all k-subsets of n samples (the first c correct) holding a correct sample."""
    subsets = list(itertools.combinations(range(n), k))
    return sum(any(i < c for i in s) for s in subsets) / len(subsets)


@pytest.mark.parametrize(
    ("n", "c", "k", "expected"),
    [
        (5, 2, 1, 0.4),
        (5, 2, 2, 1 - comb(3, 2) / comb(5, 2)),  # 0.7
        (5, 0, 3, 0.0),
        (5, 5, 1, 1.0),
        (5, 3, 3, 1.0),  # n - c = 2 < k: every 3-subset holds a correct one
        (10, 1, 10, 1.0),
        (10, 1, 1, 0.1),
        (100, 7, 10, 1 - comb(93, 10) / comb(100, 10)),
    ],
)
def test_closed_form(n, c, k, expected):
    assert pass_at_k(n, c, k) == pytest.approx(expected, abs=1e-12)


SMALL_CASES = sorted({(n, c, k) for n in range(1, 8) for c in range(n + 1) for k in (1, 2, 3, n) if k <= n})


@pytest.mark.parametrize(("n", "c", "k"), SMALL_CASES)
def test_matches_brute_force(n, c, k):
    assert pass_at_k(n, c, k) == pytest.approx(brute_force(n, c, k), abs=1e-12)


def test_pass_at_1_is_fraction_correct():
    for n in (1, 4, 16):
        for c in range(n + 1):
            assert pass_at_k(n, c, 1) == pytest.approx(c / n, abs=1e-12)


def test_large_n_is_stable():
    # C(2000, 1000) overflows a float; the product form does not.
    value = pass_at_k(2000, 3, 1000)
    assert value == pytest.approx(1 - comb(1997, 1000) / comb(2000, 1000), rel=1e-9)
    assert 0.0 < value < 1.0


@pytest.mark.parametrize(
    ("n", "c", "k"), [(5, 2, 6), (5, 2, 0), (5, 6, 1), (5, -1, 1), (0, 0, 1), (5, 2.0, 1), (5, True, 1)]
)
def test_bad_input_raises(n, c, k):
    with pytest.raises(ValueError):
        pass_at_k(n, c, k)


def test_array_matches_scalar():
    n = np.array([5, 5, 5, 5, 10, 100, 3])
    c = np.array([2, 2, 0, 4, 1, 7, 3])
    for k in (1, 2, 3):
        got = pass_at_k_array(n, c, k)
        assert got.shape == (7,)
        assert got.dtype == np.float64
        np.testing.assert_allclose(
            got, [pass_at_k(int(a), int(b), k) for a, b in zip(n, c, strict=True)], atol=1e-12
        )


def test_array_broadcasts_scalar_n_and_per_problem_k():
    got = pass_at_k_array(5, [0, 1, 2], [1, 2, 2])
    np.testing.assert_allclose(got, [0.0, pass_at_k(5, 1, 2), 0.7], atol=1e-12)


@pytest.mark.parametrize(
    ("n", "c", "k"),
    [
        ([5, 5], [2, 6], 1),
        ([5, 5], [2, 1], 6),
        ([5, 5], [2, 1], 0),
        ([5, 5], [1.5, 1], 1),
        ([5, 5, 5], [1, 1], 1),
    ],
)
def test_array_bad_input_raises(n, c, k):
    with pytest.raises(ValueError):
        pass_at_k_array(n, c, k)


def test_mean_pass_at_k_over_groups():
    groups = [[True, False, False, False, True], [False] * 5, [True] * 3]
    expected = (0.7 + 0.0 + 1.0) / 3
    assert mean_pass_at_k(groups, 2) == pytest.approx(expected, abs=1e-12)
    with pytest.raises(ValueError):
        mean_pass_at_k([], 1)
    with pytest.raises(ValueError):
        mean_pass_at_k([[True]], 2)  # fewer samples than k
