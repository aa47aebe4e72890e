"""Seeds of the sample streams: the one rule every layer follows, so one seed gives the same samples in
process (`RolloutEngine.generate`), from one server (`/v1/completions`) and through a pool of servers.

A call seeded `s` (`generate(prompts, group_size=n, seed=s)`, a `/v1/completions` request with `seed=s`,
`n=n` and a list of prompts) seeds its group i (prompt i's n samples) with `group_seed(s, i)`, and sample j
of a group seeded g draws from the stream `sample_seed(g, j)`. Group 0 of a call is seeded by the call's own
seed (`group_seed(s, 0) == s`), so a call of one prompt seeded g IS the group seeded g: a caller that splits
a call into one request per group (`RolloutPool`, a fleet) sends group i as a one-prompt request seeded
`group_seed(s, i)` and gets exactly the in-process samples, whichever server runs it.

Both are splitmix64 mixes, never `seed + index`: that makes seed s+1 replay the streams of seed s shifted by
one index (the same prompt -> the same samples again); groups and samples mix with different salts.
"""

from __future__ import annotations

_MASK64 = (1 << 64) - 1
_GROUP_SALT = 0x5EED_6A0B_0000_0001  # NOTE: a group's seed is never one of its samples' stream seeds


def _mix64(x: int) -> int:
    """splitmix64's finaliser: a bijection of 64-bit ints that scatters nearby inputs."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def derive_seed(seed: int, index: int) -> int:
    """The seed of the `index`-th of a series seeded from `seed` (a multi-turn run's turns use it)."""
    return _mix64((_mix64(seed & _MASK64) + index) & _MASK64) >> 1  # >> 1: fits a signed int64


def group_seed(seed: int, group: int) -> int:
    """The seed of group `group` (one prompt's samples) of a call seeded `seed`; `seed` itself for group 0."""
    return seed if group == 0 else derive_seed(seed ^ _GROUP_SALT, group)


def sample_seed(group: int, sample: int) -> int:
    """The stream seed of sample `sample` of a group seeded `group`."""
    return derive_seed(group, sample)


def call_seeds(seed: int | None, num_groups: int, group_size: int, first_group: int = 0) -> list[int | None]:
    """The stream seed of every sample of a call, group-major (row i * group_size + j is sample j of
    group i); all None for an unseeded call. `first_group`: these groups are the call's groups
    `first_group, first_group + 1, ...` (one shard of a call split over several engines)."""
    if seed is None:
        return [None] * (num_groups * group_size)
    return [sample_seed(group_seed(seed, first_group + i), j) for i in range(num_groups) for j in range(group_size)]


# ------------------------------------------------------------------------- the counter-based generator
# Philox4x32-10 (`rollout.kernels.philox`): a seeded row's key is its stream seed (`sample_seed`: the row stream);
# its counter is (token block, position, purpose, 0), position = tokens the request generated before this draw.
def counter_exponential(seeds: list[int], positions: list[int], vocab: int, device,
                        stream: int = 0):
    """Exp(1) noise [S, vocab] (fp32) of seeded rows, a pure function of (seed, position, token): the same bits
    on every device and in every batch. On CUDA through the Triton kernel when triton is installed
    (`rollout.kernels.triton_sampling`, the same words), else its torch ops. `stream`: the purpose word (0: the
    token draw). Imported lazily: this module stays free of torch for the clients that only derive seeds."""
    import torch

    from rollout.kernels import philox

    device = torch.device(device)
    if device.type == "cuda":
        from rollout.kernels import triton_sampling

        if triton_sampling.available(device):
            return triton_sampling.counter_exponential(seeds, positions, vocab, device, stream)
    return philox.exponential_from_words(philox.counter_words(seeds, positions, vocab, device, stream))
