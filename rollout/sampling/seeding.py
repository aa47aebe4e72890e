"""Seeds of the sample streams: one independent stream per (call seed, row), reproducible.

`row_seed(seed, row)` is the seed of sample `row` of a call seeded with `seed` (`RolloutEngine.generate`
rows, the server's `n` samples): splitmix64 over both, so two seeds share no stream.
"""

from __future__ import annotations

_MASK64 = (1 << 64) - 1


def _mix64(x: int) -> int:
    """splitmix64's finaliser: a bijection of 64-bit ints that scatters nearby inputs."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def row_seed(seed: int, row: int) -> int:
    """The seed of one sample's stream. NOTE: not `seed + row`, which makes seed s+1 replay the
    streams of seed s shifted by one row (same prompt -> the same samples again)."""
    return _mix64((_mix64(seed & _MASK64) + row) & _MASK64) >> 1  # >> 1: fits a signed int64
