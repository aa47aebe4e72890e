"""The counter-based generator of seeded rows in Triton: one launch draws the Exp(1) noise of every seeded row.

The same Philox4x32-10 words as `rollout.kernels.philox.counter_words` (row i keyed by its stream seed, counter
(token block, position, purpose, 0)), turned into noise by the same rule (`exponential_from_words`), fused: no
[S, V] int64 intermediates (the torch ops write ~40 of them). Inputs are device tensors and sizes launch
constants, so a CUDA graph can hold a launch. Tested against the torch ops under `TRITON_INTERPRET=1` (words
bit-exact, noise to the last ulp of fp32 `log`).

Optional: needs `triton` (`pip install rollout[triton]`); import after setting `TRITON_INTERPRET=1` on a CPU.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError as e:  # pragma: no cover - exercised where triton is not installed
    raise ImportError("rollout's Triton kernels need the `triton` package: pip install 'rollout[triton]'") from e

from rollout.kernels.philox import PHILOX_M, PHILOX_ROUNDS, PHILOX_W, TOKEN_STREAM
from rollout.kernels.triton_decode import built_for_interpreter, runs_on

__all__ = ["BLOCK", "counter_exponential", "counter_words", "available"]

BLOCK = 256  # NOTE: Philox counters (4 tokens each) per program


@triton.jit
def _counter_kernel(K0, K1, Pos, Out, vocab, stride_o, stream,
                    BLOCK: tl.constexpr, WORDS: tl.constexpr, ROUNDS: tl.constexpr,
                    M0: tl.constexpr, M1: tl.constexpr, W0: tl.constexpr, W1: tl.constexpr):
    r = tl.program_id(0)  # NOTE: the seeded row
    j = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)  # [BLOCK] token blocks of 4
    k0 = tl.load(K0 + r).to(tl.uint32)
    k1 = tl.load(K1 + r).to(tl.uint32)
    c0 = j.to(tl.uint32)
    c1 = tl.zeros([BLOCK], tl.uint32) + tl.load(Pos + r).to(tl.uint32)
    c2 = tl.zeros([BLOCK], tl.uint32) + stream.to(tl.uint32)
    c3 = tl.zeros([BLOCK], tl.uint32)
    for _i in tl.static_range(ROUNDS):
        _c0, _c2 = c0, c2
        c0 = tl.umulhi(_c2, M1) ^ c1 ^ k0
        c2 = tl.umulhi(_c0, M0) ^ c3 ^ k1
        c1 = _c2 * M1
        c3 = _c0 * M0
        k0 = k0 + W0
        k1 = k1 + W1
    base = Out + r.to(tl.int64) * stride_o + 4 * j
    _store(base, 4 * j + 0, c0, vocab, WORDS)
    _store(base + 1, 4 * j + 1, c1, vocab, WORDS)
    _store(base + 2, 4 * j + 2, c2, vocab, WORDS)
    _store(base + 3, 4 * j + 3, c3, vocab, WORDS)


@triton.jit
def _store(ptr, token, word, vocab, WORDS: tl.constexpr):
    mask = token < vocab
    if WORDS:  # NOTE: the raw words (int64), for the exactness test
        tl.store(ptr, word.to(tl.int64), mask=mask)
    else:  # NOTE: u = (2 (w >> 9) + 1) / 2**24 exactly, then Exp(1) = -log(u)
        u = ((word >> 9) * 2 + 1).to(tl.float32) * (1.0 / 16777216.0)
        tl.store(ptr, -tl.log(u), mask=mask)


def interpreted() -> bool:
    return built_for_interpreter(_counter_kernel)


def available(device: torch.device) -> bool:
    """The kernel runs on `device`: CUDA, or a CPU under the interpreter."""
    return runs_on(device, _counter_kernel)


def _launch(seeds: list[int], positions: list[int], vocab: int, device, stream: int, words: bool) -> torch.Tensor:
    device = torch.device(device)
    keys = [s & ((1 << 64) - 1) for s in seeds]
    packed = torch.tensor([[k & 0xFFFFFFFF for k in keys], [k >> 32 for k in keys],
                           [p & 0xFFFFFFFF for p in positions]], dtype=torch.int64)  # [3, S]
    packed = packed.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else packed.to(device)
    out = torch.empty(len(seeds), vocab, dtype=torch.int64 if words else torch.float32, device=device)
    if not seeds or vocab == 0:
        return out
    grid = (len(seeds), triton.cdiv(triton.cdiv(vocab, 4), BLOCK))
    _counter_kernel[grid](packed[0], packed[1], packed[2], out, vocab, out.stride(0), stream & 0xFFFFFFFF,
                          BLOCK=BLOCK, WORDS=words, ROUNDS=PHILOX_ROUNDS, M0=PHILOX_M[0], M1=PHILOX_M[1],
                          W0=PHILOX_W[0], W1=PHILOX_W[1])
    return out


def counter_words(seeds: list[int], positions: list[int], vocab: int, device,
                  stream: int = TOKEN_STREAM) -> torch.Tensor:
    """The generator's uint32 words [S, vocab] (int64), as `rollout.kernels.philox.counter_words`."""
    return _launch(seeds, positions, vocab, device, stream, words=True)


def counter_exponential(seeds: list[int], positions: list[int], vocab: int, device,
                        stream: int = TOKEN_STREAM) -> torch.Tensor:
    """Exp(1) noise [S, vocab] fp32, as `rollout.sampling.seeding.counter_exponential`."""
    return _launch(seeds, positions, vocab, device, stream, words=False)
