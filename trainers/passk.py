"""Unbiased pass@k (Chen et al. 2021, "Evaluating Large Language Models Trained on Code").

With ``n`` samples of which ``c`` are correct, the chance that at least one of ``k`` samples drawn
without replacement is correct is ``1 - C(n - c, k) / C(n, k)``. Computed as the stable product
``1 - prod_{i = n - c + 1}^{n} (1 - k / i)``, which never forms a large binomial.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def _check(n: int, c: int, k: int) -> None:
    for name, value in (("n", n), ("c", c), ("k", k)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
            raise ValueError(f"{name} must be an integer, got {value!r}")
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    if not 0 <= c <= n:
        raise ValueError(f"c must be in [0, n={n}], got {c}")
    if not 1 <= k <= n:
        raise ValueError(f"k must be in [1, n={n}], got {k}")


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k for one problem: ``n`` samples, ``c`` correct, budget ``k``.

    Raises ValueError unless ``n >= 1``, ``0 <= c <= n`` and ``1 <= k <= n``.
    """
    _check(n, c, k)
    if n - c < k:  # every k-subset holds a correct sample
        return 1.0
    return float(1.0 - np.prod(1.0 - k / np.arange(n - c + 1, n + 1, dtype=np.float64)))


def pass_at_k_array(
    n: Sequence[int] | np.ndarray | int,
    c: Sequence[int] | np.ndarray | int,
    k: Sequence[int] | np.ndarray | int,
) -> np.ndarray:
    """pass@k per problem, vectorised (same product form as ``pass_at_k``).

    Args:
        n: samples per problem, ``[P]`` (or a scalar, broadcast).
        c: correct samples per problem, ``[P]`` (or a scalar, broadcast).
        k: budget per problem, ``[P]`` (or a scalar, broadcast).
    Returns:
        ``[P]`` float64 array (0-d inputs give ``[1]``). Raises ValueError on any bad entry.
    """
    arrays = [np.atleast_1d(np.asarray(x)) for x in (n, c, k)]
    for name, arr in zip("nck", arrays, strict=True):
        if arr.ndim != 1 or arr.dtype == bool or not np.issubdtype(arr.dtype, np.integer):
            raise ValueError(f"{name} must be a scalar or 1-d array of integers, got {arr.dtype} {arr.shape}")
    try:
        n_arr, c_arr, k_arr = (a.astype(np.int64) for a in np.broadcast_arrays(*arrays))
    except ValueError as err:
        raise ValueError(f"n, c and k do not broadcast: {err}") from None
    if (n_arr < 1).any():
        raise ValueError("n must be >= 1 everywhere")
    if ((c_arr < 0) | (c_arr > n_arr)).any():
        raise ValueError("c must be in [0, n] everywhere")
    if ((k_arr < 1) | (k_arr > n_arr)).any():
        raise ValueError("k must be in [1, n] everywhere")
    # Term j of problem p is 1 - k / (n - c + 1 + j) for j < c, and 1 (a no-op) beyond.
    width = max(int(c_arr.max(initial=0)), 1)
    j = np.arange(width)[None, :]  # [1, W]
    denom = (n_arr - c_arr + 1)[:, None] + j  # [P, W], >= 1
    terms = np.where(j < c_arr[:, None], 1.0 - k_arr[:, None] / denom, 1.0)  # [P, W]
    out = 1.0 - np.prod(terms, axis=1)  # [P]
    return np.where(n_arr - c_arr < k_arr, 1.0, out)


def mean_pass_at_k(correct: Sequence[Sequence[bool]], k: int) -> float:
    """Mean pass@k over problems, each given as its list of per-sample correctness flags.

    Problems may have different sample counts; each must have at least ``k``.
    """
    if len(correct) == 0:
        raise ValueError("correct must hold at least one problem")
    n = [len(row) for row in correct]
    c = [sum(bool(x) for x in row) for row in correct]
    return float(pass_at_k_array(n, c, k).mean())
