"""The trainers' reference logprobs through `RolloutEngine.score` (`trainers.reference.EngineReference`)
equal the padded forward's (`trainers.common.reference_logprobs`) on the completion tokens, at each row's
temperature (greedy rows at 1); with top-k / top-p truncation the padded forward is kept."""

from __future__ import annotations

import pytest
import torch
from support.tiny_models import make_model

from rollout import ContinuousBatchingConfig, RolloutEngine
from trainers.common import reference_logprobs
from trainers.reference import EngineReference
from trainers.rollouts import batch_tensors

pytestmark = pytest.mark.timeout(300)
CONFIG = ContinuousBatchingConfig(page_size=16, num_blocks=256, max_batch_tokens=64)


@pytest.fixture(scope="module")
def setup():
    policy, ref = make_model("qwen3", seed=0), make_model("qwen3", seed=1)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(1, 128, (n,), generator=g).tolist() for n in (20, 45, 33)]
    with RolloutEngine(policy, config=CONFIG) as engine:
        batch = engine.generate(prompts, temps=[1.0, 0.0, 0.7], group_size=3, max_new_tokens=12, seed=0)
    return ref, batch_tensors(batch)


def test_engine_reference_equals_the_padded_forward(setup):
    ref, data = setup
    scorer = EngineReference(ref, CONFIG)
    try:
        ours = scorer(data, chunks=2)
        assert scorer.engine is not None and scorer.seconds > 0
    finally:
        scorer.close()
    padded = reference_logprobs(ref, data, 2)
    mask = data["completion_mask"]
    assert ours.shape == padded.shape
    torch.testing.assert_close(ours[mask], padded[mask], atol=2e-5, rtol=2e-6)
    assert ours[~mask].abs().sum() == 0


def test_truncation_keeps_the_padded_forward(setup):
    ref, data = setup
    scorer = EngineReference(ref, CONFIG)
    out = scorer(data, chunks=1, top_k=5)
    assert scorer.engine is None
    torch.testing.assert_close(out, reference_logprobs(ref, data, 1, top_k=5))
