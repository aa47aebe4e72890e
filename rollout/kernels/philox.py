"""Philox4x32-10 in torch ops: the counter-based generator of seeded rows (`rollout.sampling.seeding`).

Salmon et al. 2011 (Random123; the generator of cuRAND and of Triton's `tl.philox`): a bijection of a 128-bit
counter under a 64-bit key, so the noise of any (seed, position, token) is computed directly, in one vectorised
draw for every row of a step, with no state to carry (a CUDA graph can hold it). Row i is keyed by `seeds[i]`;
its counter is (token block j, `positions[i]`, purpose, 0), block j covering tokens 4j .. 4j + 3. The uint32
words live in int64 tensors and every product is built from 16-bit halves, so nothing overflows on any device:
the words are the same bits on CPU and CUDA (`rollout.kernels.triton_sampling` computes them fused on a GPU).
"""

from __future__ import annotations

import torch

PHILOX_M = (0xD2511F53, 0xCD9E8D57)
PHILOX_W = (0x9E3779B9, 0xBB67AE85)
PHILOX_ROUNDS = 10
_MASK32 = 0xFFFFFFFF
TOKEN_STREAM = 0  # NOTE: the purpose word of a token draw (other purposes would take other values)


def _mulhilo(a, m: int):
    """(high, low) 32-bit halves of `a * m` for int64 tensors `a` holding uint32 values: the product is built
    from 16-bit halves of `m`, so no intermediate passes 2**49 (no signed overflow on any device)."""
    t = a * (m & 0xFFFF)  # < 2**48
    u = a * (m >> 16)  # < 2**48
    return (u + (t >> 16)) >> 16, (((u & 0xFFFF) << 16) + t) & _MASK32


def philox4x32(c0, c1, c2, c3, k0, k1, rounds: int = PHILOX_ROUNDS):
    """Philox4x32-`rounds` of the counter (c0, c1, c2, c3) under the key (k0, k1): int64 tensors (or ints) holding
    uint32 values, broadcast together; returns the four output words likewise."""
    for r in range(rounds):
        hi0, lo0 = _mulhilo(c0, PHILOX_M[0])
        hi1, lo1 = _mulhilo(c2, PHILOX_M[1])
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
        if r + 1 < rounds:
            k0, k1 = (k0 + PHILOX_W[0]) & _MASK32, (k1 + PHILOX_W[1]) & _MASK32
    return c0, c1, c2, c3


def counter_words(seeds: list[int], positions: list[int], vocab: int, device, stream: int = TOKEN_STREAM):
    """uint32 words [S, vocab] (int64) of the counter-based generator: row i keyed by `seeds[i]` at `positions[i]`."""
    keys = [s & ((1 << 64) - 1) for s in seeds]
    k0 = torch.tensor([k & _MASK32 for k in keys], dtype=torch.int64, device=device)[:, None]  # [S, 1]
    k1 = torch.tensor([k >> 32 for k in keys], dtype=torch.int64, device=device)[:, None]
    c1 = torch.tensor([p & _MASK32 for p in positions], dtype=torch.int64, device=device)[:, None]
    blocks = -(-vocab // 4)
    c0 = torch.arange(blocks, dtype=torch.int64, device=device)[None, :]  # [1, B]
    c2 = torch.full_like(c1, stream & _MASK32)
    words = philox4x32(c0, c1, c2, torch.zeros_like(c1), k0, k1)  # 4 x [S, B]
    return torch.stack(words, -1).view(len(seeds), 4 * blocks)[:, :vocab]  # [S, V]


def exponential_from_words(words):
    """Exp(1) noise (fp32) from uint32 words: u = (2 (w >> 9) + 1) / 2**24, exact in fp32 and strictly inside
    (0, 1), then -log(u) (so never 0 and never inf)."""
    u = ((words >> 9) * 2 + 1).to(torch.float32) * (2.0**-24)
    return -torch.log(u)
