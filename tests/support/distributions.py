"""Helpers of the sampling-distribution tests: the processed distribution a request's sampling kwargs
describe (an implementation independent of `rollout.sampling.sampler`), and the checks that sampled tokens follow
it (exact support, chi-square) and that the reported logprobs are its numbers.

A new logits processor (min-p, penalties, ...) is one more entry in `PROCESSORS`: a function
`(logits [V] fp32, value, context) -> logits [V]` applied in the engine's order, with -inf for dropped
tokens; every distribution test then takes the new kwarg as one more parameter.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch

Processor = Callable[[torch.Tensor, object, Mapping], torch.Tensor]


def _temperature(logits: torch.Tensor, t: float, context: Mapping) -> torch.Tensor:
    return logits / float(t)


def _top_k(logits: torch.Tensor, k: int, context: Mapping) -> torch.Tensor:
    if not k or k <= 0 or k >= logits.numel():
        return logits
    kth = torch.sort(logits, descending=True).values[k - 1]
    return torch.where(logits >= kth, logits, torch.tensor(float("-inf")))


def _top_p(logits: torch.Tensor, p: float, context: Mapping) -> torch.Tensor:
    """Keep the smallest most-likely-first prefix whose mass reaches p (the first token always)."""
    if p is None or p >= 1.0:
        return logits
    probs = torch.softmax(logits.double(), -1)
    order = torch.argsort(probs, descending=True).tolist()
    keep, mass = [], 0.0
    for i in order:
        if keep and mass >= p:
            break
        keep.append(i)
        mass += float(probs[i])
    out = torch.full_like(logits, float("-inf"))
    out[keep] = logits[keep]
    return out


# NOTE: the order the engine applies them in (DESIGN.md: temperature, then top-k, then top-p).
def _min_p(logits: torch.Tensor, m: float, context: Mapping) -> torch.Tensor:
    """Drop tokens whose probability (after the warpers before it) is below m x the most likely one's."""
    if not m:
        return logits
    probs = torch.softmax(logits.double(), -1)
    return torch.where(probs >= m * probs.max(), logits, torch.tensor(float("-inf"), dtype=logits.dtype))


PROCESSORS: dict[str, Processor] = {"temperature": _temperature, "top_k": _top_k, "top_p": _top_p, "min_p": _min_p}


def expected_logprobs(logits: torch.Tensor, context: Mapping | None = None, **sampling) -> torch.Tensor:
    """log p [V] fp32 of the distribution a request with `sampling` kwargs (the engine's names:
    temperature, top_k, top_p, ...) samples from, given the raw next-token `logits [V]`;
    -inf outside the kept set. `context` carries what a processor needs beyond the logits
    (e.g. the prompt and generated ids for penalties)."""
    unknown = set(sampling) - set(PROCESSORS)
    if unknown:
        raise ValueError(f"no reference processor for {sorted(unknown)}: add it to PROCESSORS")
    out = logits.detach().double().flatten()
    for name, fn in PROCESSORS.items():
        if name in sampling and sampling[name] is not None:
            out = fn(out, sampling[name], context or {})
    return torch.log_softmax(out, -1).float()


def chi_square_pvalue(counts: torch.Tensor, probs: torch.Tensor, min_expected: float = 5.0) -> tuple[float, float]:
    """(statistic, p-value) of Pearson's chi-square of `counts [V]` against `probs [V]` (zeros excluded);
    cells expected fewer than `min_expected` times are pooled into one cell."""
    n = float(counts.sum())
    keep = probs > 0
    counts, expected = counts[keep].double(), probs[keep].double() * n
    small = expected < min_expected
    if small.any():
        counts = torch.cat([counts[~small], counts[small].sum()[None]])
        expected = torch.cat([expected[~small], expected[small].sum()[None]])
    stat = float(((counts - expected) ** 2 / expected).sum())
    df = counts.numel() - 1
    p = float(
        torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), torch.tensor(stat / 2, dtype=torch.float64))
    )
    return stat, p


def assert_follows(tokens, expected: torch.Tensor, alpha: float = 1e-6) -> None:
    """Sampled `tokens` (ints) are draws from `exp(expected)`: none outside the support, and the
    chi-square test does not reject at level `alpha` (a correct sampler fails it once in 1/alpha
    seeds; the bugs these tests target give p-values below 1e-30)."""
    tokens = torch.as_tensor(list(tokens), dtype=torch.long)
    probs = expected.double().exp()
    counts = torch.bincount(tokens, minlength=probs.numel()).double()
    outside = ((probs == 0) & (counts > 0)).nonzero().flatten().tolist()
    assert not outside, f"sampled tokens {outside} have probability 0 under the processed distribution"
    if int((probs > 0).sum()) == 1:
        return  # NOTE: one token left (top-k 1, a small top-p): the support check is the whole test
    stat, p = chi_square_pvalue(counts, probs)
    assert p > alpha, f"samples do not follow the processed distribution: chi2 = {stat:.1f}, p = {p:.3g}"


def assert_reported(tokens, logprobs, expected: torch.Tensor, atol: float = 1e-4) -> None:
    """Each reported logprob is `expected[token]` (the processed or the raw distribution)."""
    tokens = torch.as_tensor(list(tokens), dtype=torch.long)
    reported = torch.as_tensor(list(logprobs), dtype=torch.float32)
    want = expected[tokens]
    assert torch.isfinite(reported).all(), "a reported logprob is not finite"
    err = (reported - want).abs().max().item()
    assert err < atol, f"reported logprobs differ from the expected ones by up to {err:.3g}"
