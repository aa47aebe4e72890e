"""Sampling masks (`return_sampling_mask`): per generated token, the ids the sampler could have drawn, i.e. the support
of the distribution it drew from after top-k, top-p and min-p (vLLM's `sampling_mask`, what a trainer replays to score
the old and new policy on the same support). Checked against the support computed independently
(`support.distributions`), by the draws themselves (every sampled token in its mask, every id of a small mask drawn),
and a deliberate off-by-one in the mask (one id short, or one too many) is caught by the same check."""

from __future__ import annotations

import pytest
import torch
from support.distributions import expected_logprobs

from rollout.requests import Request, SamplingParams
from rollout.sampling import sampler as sampler_module
from rollout.sampling.sampler import Sampler

VOCAB = 64
CASES = [
    pytest.param(dict(temperature=1.0, top_k=5), id="topk5"),
    pytest.param(dict(temperature=0.7, top_p=0.8), id="t0.7-topp0.8"),
    pytest.param(dict(temperature=1.0, min_p=0.1), id="minp0.1"),
    pytest.param(dict(temperature=1.3, top_k=20, top_p=0.8, min_p=0.05), id="topk20-topp0.8-minp0.05"),
    pytest.param(dict(temperature=1.0), id="full"),
    pytest.param(dict(temperature=0.0), id="greedy"),
]


def rows_logits(rows: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, VOCAB, generator=g) * 1.5  # [R, V]


def draw(logits: torch.Tensor, sampling: dict, seed0: int = 0):
    rows = logits.shape[0]
    reqs = [Request(f"r{i}", [1], 1, SamplingParams(seed=seed0 + i, return_sampling_mask=True, **sampling))
            for i in range(rows)]
    out = Sampler(torch.device("cpu"), seed=0)(logits, [r.sampling for r in reqs], [r.request_id for r in reqs],
                                                None, requests=reqs)
    return out


def assert_masks_are_support(logits: torch.Tensor, sampling: dict, out) -> None:
    for i, (row, token, mask) in enumerate(zip(logits, out.tokens, out.masks, strict=True)):
        if sampling.get("temperature") == 0.0:
            want = [int(row.argmax())]
        else:
            want = torch.isfinite(expected_logprobs(row, **sampling)).nonzero()[:, 0].tolist()
        assert mask == want, f"row {i}: mask {mask} != support {want}"
        assert token in mask


@pytest.mark.parametrize("sampling", CASES)
def test_mask_is_the_support_the_sampler_drew_from(sampling):
    logits = rows_logits(32)
    assert_masks_are_support(logits, sampling, draw(logits, sampling))


def test_every_id_of_a_small_mask_is_drawn():
    """Not a superset: 3000 seeded draws from one row at top-k 3 hit exactly the mask's 3 ids."""
    logits = rows_logits(1).expand(3000, VOCAB).contiguous()
    out = draw(logits, dict(temperature=1.5, top_k=3))
    assert all(m == out.masks[0] for m in out.masks) and len(out.masks[0]) == 3
    assert sorted(set(out.tokens)) == out.masks[0]


@pytest.mark.parametrize("shift", ["one short", "one too many"])
def test_an_off_by_one_mask_fails_the_check(monkeypatch, shift):
    """The check above catches a mask that is off by one id (the bug a wrong boundary in top-k / top-p makes)."""
    real = sampler_module.support

    def off_by_one(tokens, warped, s_rows, rows, num_rows):
        masks = real(tokens, warped, s_rows, rows, num_rows)
        out = []
        for m in masks:
            if shift == "one short":
                out.append(m[:-1] if len(m) > 1 else m)
            else:
                out.append(sorted({*m, next(t for t in range(VOCAB) if t not in m)}))
        return out

    monkeypatch.setattr(sampler_module, "support", off_by_one)
    sampling = dict(temperature=1.0, top_k=5)
    logits = rows_logits(8)
    with pytest.raises(AssertionError, match="!= support"):
        assert_masks_are_support(logits, sampling, draw(logits, sampling))


def test_no_mask_unless_asked():
    reqs = [Request("a", [1], 1, SamplingParams(seed=1, top_k=5))]
    out = Sampler(torch.device("cpu"), seed=0)(rows_logits(1), [reqs[0].sampling], ["a"], None, requests=reqs)
    assert out.masks is None


def test_engine_batches_carry_the_masks():
    """`RolloutEngine.generate(sampling=SamplingParams(return_sampling_mask=True))`: `batch.sampling_masks` holds one
    mask per generated token, each holding its token, top-k wide."""
    from support.tiny_models import make_model

    from rollout import ContinuousBatchingConfig, RolloutEngine
    from rollout import SamplingParams as PublicSamplingParams

    engine = RolloutEngine(make_model("qwen3"), config=ContinuousBatchingConfig(page_size=16, num_blocks=64))
    try:
        sp = PublicSamplingParams(temperature=1.0, top_k=4, seed=3, max_tokens=6, ignore_eos=True,
                                  return_sampling_mask=True)
        batch = engine.generate([[5, 6, 7], [8, 9]], sampling=sp, group_size=2)
        plain = engine.generate([[5, 6, 7]], sampling=sp.with_fields(return_sampling_mask=False))
    finally:
        engine.close()
    assert len(batch.sampling_masks) == 4
    for row, tokens in zip(batch.sampling_masks, batch.completion_ids.tolist(), strict=True):
        assert len(row) == 6 and all(len(m) == 4 and t in m for t, m in zip(tokens, row, strict=True))
    assert plain.sampling_masks is None
