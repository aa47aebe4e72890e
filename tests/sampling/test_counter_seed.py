"""The counter-based generator of seeded rows (`rollout.kernels.philox`, `rollout.sampling.seeding`,
`seed_stream="counter"`).

Philox4x32-10 against Random123's published known-answer vectors; a row's noise a pure function of (seed, position,
token), whatever the rows beside it; the sampler in counter mode still draws exactly from the distribution it
reports (chi-square, as `test_sampling_distribution`) and its seeded rows are batch-independent; in the engine, a
seeded request's k-th token is the race over the model's own logits with the noise at position k (teacher forced,
independently of the engine: a wrong counter offset fails it), the same alone, in a batch of 16, chunked, and
preempted; the speculative joint law holds in counter mode too. The Triton kernel of the same words runs under
`TRITON_INTERPRET=1` (`rollout.kernels.triton_sampling`): bit-exact words, noise within two fp32 ulps (the fp32 `log`s
differ).
"""

from __future__ import annotations

import pytest
import torch
from support.distributions import assert_follows, assert_reported, expected_logprobs
from support.tiny_models import VOCAB, make_model
from transformers import GenerationConfig

from rollout import ContinuousBatchingConfig
from rollout.engine.core import EngineCore
from rollout.kernels.philox import counter_words, exponential_from_words, philox4x32
from rollout.requests import SamplingParams
from rollout.sampling.sampler import Sampler
from rollout.sampling.seeding import counter_exponential

CPU = torch.device("cpu")

# NOTE: Random123's kat_vectors for philox4x32 with 10 rounds: (counter, key) -> output
KAT = [
    ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
     (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)),
]


@pytest.mark.parametrize("counter,key,want", KAT)
def test_philox_known_answers(counter, key, want):
    t = [torch.tensor([v], dtype=torch.int64) for v in (*counter, *key)]
    assert tuple(int(w) for w in philox4x32(*t)) == want


def test_a_row_is_a_function_of_its_seed_and_position_only():
    seeds, positions = [7, 2**62 + 5, 7, 123], [0, 3, 1, 2**33 + 1]
    words = counter_words(seeds, positions, 37, CPU)
    assert words.shape == (4, 37) and 0 <= int(words.min()) and int(words.max()) < 2**32
    for i in range(4):
        alone = counter_words([seeds[i]], [positions[i]], 37, CPU)
        assert torch.equal(alone[0], words[i])
    assert not torch.equal(words[0], words[2]), "another position, another draw"
    # NOTE: token t of a row is word t % 4 of counter block t // 4 (the vocabulary's blocks of 4)
    k0, k1 = seeds[1] & 0xFFFFFFFF, seeds[1] >> 32
    block = philox4x32(*[torch.tensor([v]) for v in (2, positions[1], 0, 0, k0, k1)])
    assert [int(w) for w in block] == words[1, 8:12].tolist()
    last = philox4x32(*[torch.tensor([v]) for v in (9, positions[1], 0, 0, k0, k1)])
    assert int(last[0]) == int(words[1, 36])
    noise = exponential_from_words(words)
    assert noise.dtype is torch.float32 and bool((noise > 0).all()) and bool(torch.isfinite(noise).all())
    assert torch.equal(noise, counter_exponential(seeds, positions, 37, CPU))


def test_the_noise_is_exponential():
    noise = counter_exponential(list(range(200)), [0] * 200, 1000, CPU).double().flatten()  # 200k draws
    assert abs(noise.mean().item() - 1.0) < 0.01 and abs(noise.var().item() - 1.0) < 0.02
    edges = torch.tensor([0.0, 0.1, 0.5, 1.0, 2.0, 4.0, float("inf")], dtype=torch.float64)
    cdf = 1 - torch.exp(-edges)
    want = (cdf[1:] - cdf[:-1]) * noise.numel()
    got = torch.tensor([((noise >= a) & (noise < b)).sum().item() for a, b in zip(edges[:-1], edges[1:], strict=True)],
                       dtype=torch.float64)
    chi2 = (((got - want) ** 2) / want).sum().item()
    assert chi2 < 30, chi2  # NOTE: 5 degrees of freedom: p ~ 1e-5 at 30


CASES = [dict(temperature=0.7), dict(temperature=1.3, top_k=6), dict(temperature=0.9, top_k=20, top_p=0.85)]


@pytest.mark.parametrize("sampling", CASES, ids=["t0.7", "t1.3-topk6", "t0.9-topk20-topp0.85"])
def test_counter_sampler_draws_from_the_distribution_it_reports(sampling):
    rows, vocab = 20_000, 64
    logits = torch.randn(vocab, generator=torch.Generator().manual_seed(0)) * 1.5
    expected = expected_logprobs(logits, **sampling)
    params = [SamplingParams(seed=1000 + i, **sampling) for i in range(rows)]
    out = Sampler(CPU, seed=0, seed_stream="counter")(logits.expand(rows, vocab).contiguous(), params,
                                                       [f"r{i}" for i in range(rows)], "processed")
    assert_follows(out.tokens, expected)
    assert_reported(out.tokens, out.logprobs, expected)


def test_counter_sampler_rows_are_batch_independent_and_streams_continue():
    rows, vocab = 64, 64
    logits = (torch.randn(vocab, generator=torch.Generator().manual_seed(0)) * 1.5).expand(rows, vocab).contiguous()
    ids = [f"r{i}" for i in range(rows)]
    mixed = [SamplingParams(seed=100 + i, temperature=1.0) if i % 2 else SamplingParams(temperature=1.0)
             for i in range(rows)]

    def draw(sampler, order):
        out = sampler(logits[order], [mixed[i] for i in order], [ids[i] for i in order], "processed")
        return {i: t for i, t in zip(order, out.tokens, strict=True) if i % 2}

    first = draw(Sampler(CPU, seed=0, seed_stream="counter"), list(range(rows)))
    other = Sampler(CPU, seed=1, seed_stream="counter")
    assert draw(other, list(reversed(range(rows)))) == first
    assert draw(other, list(range(rows))) != first, "the stream goes on to the next position"
    for i in ids:
        other.forget(i)
    assert draw(other, list(range(rows))) == first
    generator = draw(Sampler(CPU, seed=0, seed_stream="generator"), list(range(rows)))
    assert generator != first, "the two streams are different generators"
    with pytest.raises(ValueError, match="seed_stream"):
        Sampler(CPU, seed_stream="philox")


# ------------------------------------------------------------------------------------------- the engine
GC = GenerationConfig(do_sample=True, eos_token_id=None, max_new_tokens=10)
TEMP = 1.3


def run(model, specs, **config):
    cfg = ContinuousBatchingConfig(**{"page_size": 16, "num_blocks": 128, "max_batch_tokens": 64,
                                      "seed_stream": "counter", **config})
    core = EngineCore(model, GC, cfg)
    reqs = [core.make_request(p, request_id=f"r{i}", **kw) for i, (p, kw) in enumerate(specs)]
    for r in reqs:
        core.add(r)
    while core.has_work():
        core.step()
    return [r.generated for r in reqs], core


@torch.no_grad()
def reference(model, prompt: list[int], seed: int, new: int) -> list[int]:
    """The tokens a counter-seeded request must sample, by teacher forcing: token k is the exponential race over
    log_softmax(logits / T) with the noise of (seed, position k)."""
    out: list[int] = []
    for k in range(new):
        logits = model(torch.tensor([prompt + out])).logits[0, -1].float()
        logp = torch.log_softmax(logits / TEMP, -1)
        noise = counter_exponential([seed], [k], logp.numel(), CPU)[0]
        out.append(int((logp - noise.log()).argmax()))
    return out


def test_a_seeded_request_samples_the_counter_streams_race_at_each_position():
    """Position k of the stream is the k-th generated token, whatever the batch, chunking or preemption."""
    model = make_model("qwen3", seed=5)
    g = torch.Generator().manual_seed(21)
    prompts = [torch.randint(1, VOCAB, (n,), generator=g).tolist() for n in (20, 7, 33, 12, 50, 3, 26, 41)]
    target = dict(temperature=TEMP, seed=4321)
    want = reference(model, prompts[0], 4321, 10)
    (alone,), core = run(model, [(prompts[0], target)])
    assert core.sampler.seed_stream == "counter"
    assert alone == want, "the k-th token must use the noise at position k"
    others = [(prompts[1 + i % 7], dict(temperature=1.0 + 0.1 * (i % 3), seed=None if i % 2 else i))
              for i in range(15)]
    batch, _ = run(model, [*others[:7], (prompts[0], target), *others[7:]])
    assert batch[7] == want
    # NOTE: 5 pages of 16 for 16 requests of up to 60 tokens: requests are preempted and recompute
    squeezed, core = run(model, [*others[:7], (prompts[0], target), *others[7:]], num_blocks=12)
    assert core.cache_stats()["preemptions"] > 0
    assert squeezed[7] == want
    assert [s for i, s in enumerate(squeezed) if i != 7 and (i if i < 7 else i - 1) % 2 == 0] == \
        [s for i, s in enumerate(batch) if i != 7 and (i if i < 7 else i - 1) % 2 == 0], "every seeded row alike"


def test_auto_is_counter_on_cuda_only():
    from rollout.sampling.sampler import resolve_seed_stream

    auto = ContinuousBatchingConfig()
    assert auto.seed_stream == "auto"
    assert resolve_seed_stream(auto.seed_stream, torch.device("cpu")) == "generator"
    assert resolve_seed_stream(auto.seed_stream, torch.device("cuda")) == "counter"
    assert resolve_seed_stream("counter", torch.device("cpu")) == "counter"
    with pytest.raises(ValueError, match="seed_stream"):
        ContinuousBatchingConfig(seed_stream="philox")


# ------------------------------------------------------------------------------------ the Triton kernel
@pytest.mark.triton
def test_triton_kernel_gives_the_same_words_and_noise():
    from support.triton_interpreter import device, load

    ts = load("rollout.kernels.triton_sampling")
    seeds, positions = [0, 1, 2**63 - 1, 123456789123, (1 << 64) - 1], [0, 5, 2**32 + 3, 77, 1]
    dev = device()
    for vocab in (1, 5, 1003):
        words = ts.counter_words(seeds, positions, vocab, dev).cpu()
        assert torch.equal(words, counter_words(seeds, positions, vocab, CPU)), vocab
        noise = ts.counter_exponential(seeds, positions, vocab, dev).cpu()
        ref = exponential_from_words(words)
        ulps = (noise.view(torch.int32).long() - ref.view(torch.int32).long()).abs()  # NOTE: both positive floats
        assert int(ulps.max()) <= 2, ulps.max()  # NOTE: numpy's (or CUDA's) fp32 log against torch's
