"""Verifying drafts: whether the target model keeps a row's draft token at one position, and the token it emits.

An n-gram draft is deterministic, so its proposal distribution q is a point mass on the draft token x, and the
speculative-sampling rule (Leviathan et al. 2023, Chen et al. 2023: accept with probability min(1, p(x) / q(x)),
on a rejection draw from the residual max(0, p - q) renormalised) becomes: accept x with probability p(x), where p
is the target's processed distribution at that position (every logits processor, then the warpers, exactly as the
sampler draws a plain step); on a rejection draw from p with x removed and renormalised. Drawing y ~ p with the
row's own sampler and keeping x iff y == x is that rule exactly (P(y = x) = p(x), and given y != x, y follows p
restricted to the other tokens), and it spends one draw of the row's stream per emitted token, as plain decoding
does: a seeded row samples the same tokens with speculation as without. Greedy rows keep x iff it is the argmax.

`ACCEPTANCE` holds the rule by name; "resample_target" is a deliberately wrong rule (on a rejection it draws
again from the whole of p, so x is over-sampled), kept for the test that shows the distribution check fails it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from rollout.sampling.sampler import SamplerOutput

Sample = Callable[[list[int]], SamplerOutput]  # rows (indices into this position's rows) -> one draw each
Rule = Callable[[Sample, Sequence[int | None], Sequence[bool]], tuple[SamplerOutput, list[bool]]]


def exact(sample: Sample, drafts: Sequence[int | None], greedy: Sequence[bool]) -> tuple[SamplerOutput, list[bool]]:
    """One draw per row from the target; a row's draft token (None: none at this position) is kept iff drawn."""
    out = sample(list(range(len(drafts))))
    return out, [d is not None and t == d for t, d in zip(out.tokens, drafts, strict=True)]


def resample_target(sample: Sample, drafts: Sequence[int | None],
                    greedy: Sequence[bool]) -> tuple[SamplerOutput, list[bool]]:
    """WRONG on purpose (tests only): a rejected sampled row draws its token again from all of p, the draft
    token included, so P(x) becomes p(x) (2 - p(x)). It also records the rejected draw in the processors' state."""
    out = sample(list(range(len(drafts))))
    accepted = [d is not None and t == d for t, d in zip(out.tokens, drafts, strict=True)]
    again = [
        i for i, (a, d, g) in enumerate(zip(accepted, drafts, greedy, strict=True)) if d is not None and not a and not g
    ]
    if again:
        redo = sample(again)
        for j, i in enumerate(again):
            out.tokens[i] = redo.tokens[j]
            if out.logprobs is not None:
                out.logprobs[i] = redo.logprobs[j]
            if out.top is not None:
                out.top[i] = redo.top[j]
    return out, accepted


ACCEPTANCE: dict[str, Rule] = {"exact": exact, "resample_target": resample_target}
