"""Verification against planted drafts (issue 60): each row's true continuation (from a plain run) with a wrong token
at a position that cycles 0, 2, none, 1, so every kind of verifying step happens -- rejected at once, kept in part,
kept whole -- on the greedy path (one sampler call over the emitted positions) and on the path in order (a row with a
logits processor); tokens, logprobs and top-k logprobs are the plain engine's."""

from __future__ import annotations

import pytest
import torch
from support.planted import plant_drafts
from support.tiny_models import make_model, random_prompts
from transformers import GenerationConfig

from rollout.config import ContinuousBatchingConfig
from rollout.engine.core import EngineCore

MAX_NEW = 40
K = 5
GREEDY = GenerationConfig(do_sample=False, eos_token_id=None, max_new_tokens=MAX_NEW)


def run(model, prompts, truth=None, gc=GREEDY, **request):
    extra = dict(speculative_method="ngram", num_speculative_tokens=K) if truth else {}
    core = EngineCore(model, gc, ContinuousBatchingConfig(page_size=16, num_blocks=96, return_logprobs=True,
                                                              **extra))
    if truth:
        plant_drafts(core, truth, K, MAX_NEW, model.config.vocab_size)
    reqs = [core.make_request(p, request_id=f"r{i}", **request) for i, p in enumerate(prompts)]
    for r in reqs:
        core.add(r)
    while core.has_work():
        core.step()
    return reqs, core


@pytest.mark.parametrize("request_kw", [{}, {"top_logprobs": 3}, {"repetition_penalty": 1.3}],
                         ids=["greedy", "greedy_top3", "processor_in_order"])
def test_planted_drafts_give_the_plain_engines_tokens_and_logprobs(request_kw):
    model = make_model("qwen3")
    prompts = random_prompts(4, 5, 40, seed=3)
    base, _ = run(model, prompts, **request_kw)
    spec, core = run(model, prompts, truth=[r.generated for r in base], **request_kw)
    st = core.cache_stats()
    assert st["spec_draft_tokens"] > st["spec_accepted_tokens"] > 0
    assert st["spec_accepted_tokens"] > st["generated_tokens"] // 3  # NOTE: the true continuations are kept
    for a, b in zip(base, spec, strict=True):
        assert b.generated == a.generated and len(b.generated) == MAX_NEW
        torch.testing.assert_close(torch.tensor(b.logprobs), torch.tensor(a.logprobs), atol=1e-5, rtol=0)
        assert len(b.top) == len(a.top) == (MAX_NEW if request_kw.get("top_logprobs") else 0)
        for (a_lp, a_ids, a_rank), (b_lp, b_ids, b_rank) in zip(a.top, b.top, strict=True):  # NOTE: (lps, ids, rank)
            assert b_ids == a_ids and b_rank == a_rank
            torch.testing.assert_close(torch.tensor(b_lp), torch.tensor(a_lp), atol=1e-5, rtol=0)
    assert st["free_blocks"] == st["num_blocks"]


def test_a_stop_inside_a_kept_draft_ends_the_row_there():
    """Drafts planted from a run without EOS run past the EOS token: the row must end at it, as the plain engine's."""
    model = make_model("qwen3")
    prompts = random_prompts(4, 5, 40, seed=3)
    free, _ = run(model, prompts)
    eos = free[0].generated[12]
    gc = GenerationConfig(do_sample=False, eos_token_id=eos, max_new_tokens=MAX_NEW)
    base, _ = run(model, prompts, gc=gc)
    spec, core = run(model, prompts, truth=[r.generated for r in free], gc=gc)
    assert base[0].finish_reason == "stop" and len(base[0].generated) <= 13
    for a, b in zip(base, spec, strict=True):
        assert b.generated == a.generated and b.finish_reason == a.finish_reason
        torch.testing.assert_close(torch.tensor(b.logprobs), torch.tensor(a.logprobs), atol=1e-5, rtol=0)
    assert core.cache_stats()["free_blocks"] == core.cache_stats()["num_blocks"]
