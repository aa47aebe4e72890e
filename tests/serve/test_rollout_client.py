"""`RolloutClient` is a `rollout.Rollout` over one `rollout serve`: its `generate` and `score` (through a one-server
`RolloutPool`: `/v1/completions` groups, echo scoring) give what the served engine gives in process."""

from __future__ import annotations

import pytest

for _mod in ("fastapi", "uvicorn", "httpx"):
    pytest.importorskip(_mod, reason=f"rollout serve tests need {_mod} (pip install -e '.[serve,dev]')")

import torch  # noqa: E402
from support.serving import save_tiny, serving  # noqa: E402

from rollout import Rollout, SamplingParams  # noqa: E402
from rollout.client import RolloutClient  # noqa: E402

pytestmark = pytest.mark.timeout(300)
PROMPTS = [[5, 6, 7, 8], [9, 10, 11]]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with serving(save_tiny(tmp_path_factory.mktemp("tiny") / "model")) as s:
        yield s


def test_client_generate_and_score_equal_the_served_engine(server):
    with RolloutClient(server.url, server.key) as client:
        assert isinstance(client, Rollout) and client.policy_version == server.engine.policy_version
        greedy = client.generate(PROMPTS, temps=0.0, max_new_tokens=6)
        want = server.engine.generate(PROMPTS, temps=0.0, max_new_tokens=6)
        assert torch.equal(greedy.completion_ids, want.completion_ids.cpu())
        seeded = client.generate(PROMPTS, group_size=2, sampling=SamplingParams(temperature=0.8, seed=3, max_tokens=6))
        again = server.engine.generate(PROMPTS, group_size=2, sampling=SamplingParams(temperature=0.8, seed=3,
                                                                                      max_tokens=6))
        assert torch.equal(seeded.completion_ids, again.completion_ids.cpu())
        scored = client.score(seeded)  # NOTE: at the batch's temperatures, as the engine scores it
        local = server.engine.score(seeded)
        mask = seeded.completion_mask.bool()
        torch.testing.assert_close(scored.logprobs[mask], local.logprobs.cpu()[mask], atol=1e-4, rtol=0)
        torch.testing.assert_close(scored.logprobs[mask], seeded.logprobs[mask], atol=1e-4, rtol=0)
        with pytest.raises(ValueError, match="prompt_logprobs"):
            client.score(seeded, prompt_logprobs=True)
        with pytest.raises(ValueError, match="recompute_kv"):
            client.update_weights(server.model_dir, recompute_kv=True)
