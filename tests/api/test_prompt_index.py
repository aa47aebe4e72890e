"""`RolloutEngine.generate(..., prompt_index=i)` (issue 47): a shard of a seeded call, seeded as the call's prompts
i, i + 1, ... are, gives the whole call's rows for those prompts bit for bit (batch-invariant), so a fleet can split a
call over engines; a bad `prompt_index` is refused by name."""

from __future__ import annotations

import pytest
import torch
from support.tiny_models import make_model

from rollout import ContinuousBatchingConfig, RolloutEngine
from rollout.sampling.seeding import call_seeds

pytestmark = pytest.mark.timeout(120)

PROMPTS = [[7, 30, 41, 9, 77, 12], [5, 66, 90, 3], [21, 54, 18, 33, 71], [3, 99, 14]]


def test_a_shard_seeded_by_its_prompt_index_equals_the_whole_call():
    assert call_seeds(11, 2, 3, first_group=2) == call_seeds(11, 4, 3)[6:]
    with RolloutEngine(make_model("qwen3", seed=0), config=ContinuousBatchingConfig(
            page_size=16, num_blocks=128, batch_invariant=True)) as engine:
        whole = engine.generate(PROMPTS, temps=1.0, group_size=3, max_new_tokens=10, seed=11)
        shard = engine.generate(PROMPTS[2:], temps=1.0, group_size=3, max_new_tokens=10, seed=11, prompt_index=2)
        unshifted = engine.generate(PROMPTS[2:], temps=1.0, group_size=3, max_new_tokens=10, seed=11)
        with pytest.raises(ValueError, match="prompt_index must be a non-negative int"):
            engine.generate(PROMPTS, seed=11, prompt_index=-1)
    assert torch.equal(shard.completion_ids, whole.completion_ids[6:, : shard.completion_ids.shape[1]])
    assert torch.equal(shard.logprobs, whole.logprobs[6:, : shard.logprobs.shape[1]])
    assert not torch.equal(unshifted.completion_ids, shard.completion_ids)  # the index is what moves the streams
