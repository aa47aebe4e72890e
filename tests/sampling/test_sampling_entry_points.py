"""Sampling controls at every entry point (issue 32): refusals by name through the seed API, `RolloutEngine`,
the server (400 naming the field) and the TRL integration; `RolloutEngine.generate`'s processor keywords;
the server's vLLM fields against transformers (`repetition_penalty`, `min_tokens`) and `logit_bias`
forcing a token."""

from __future__ import annotations

import pytest
import torch
from support.sampling import hf_generate, repeating_prompt
from support.tiny_models import make_model
from transformers import GenerationConfig

from rollout import ContinuousBatchingConfig, RolloutEngine, SamplingParams, generate_batch
from rollout.sampling.sampling_fields import GENERATION_FIELDS, NEUTRAL, REFUSED

pytestmark = pytest.mark.timeout(600)
CBC = ContinuousBatchingConfig(page_size=16, num_blocks=64)
REFUSED_SETTINGS = [
    dict(num_beams=2),
    dict(penalty_alpha=0.6, top_k=4),
    dict(num_return_sequences=2, do_sample=True),
    dict(force_words_ids=[[5]]),
    dict(watermarking_config={"greenlist_ratio": 0.25}),
    dict(use_mtp=True),
    dict(typical_p=0.5),
    dict(guidance_scale=2.0),
    dict(exponential_decay_length_penalty=(2, 1.5)),
    dict(dola_layers="low"),
    dict(epsilon_cutoff=0.01),
    dict(diversity_penalty=0.5, num_beam_groups=2, num_beams=2),
]


def test_every_generation_config_field_is_classified():
    """The table covers every field of the installed GenerationConfig; refused fields have neutral values."""
    fields = {k for k in GenerationConfig().to_dict() if not k.startswith("_")}
    assert fields <= set(GENERATION_FIELDS), sorted(fields - set(GENERATION_FIELDS))
    assert {k for k, (c, _) in GENERATION_FIELDS.items() if c == REFUSED} >= set(NEUTRAL)


def test_an_unknown_generation_config_field_is_refused_not_ignored():
    """A field the table does not know (a newer transformers') is refused by name."""
    gc = GenerationConfig(do_sample=False, max_new_tokens=4, eos_token_id=None)
    gc.brand_new_decoding = 3
    with pytest.raises(ValueError, match="brand_new_decoding"):
        generate_batch(make_model("qwen3"), [[1, 2, 3]], generation_config=gc, continuous_batching_config=CBC)


@pytest.mark.parametrize("setting", REFUSED_SETTINGS, ids=lambda s: next(iter(s)))
def test_refused_through_seed_api_and_engine(setting):
    model = make_model("qwen3")
    gc = GenerationConfig(**{"do_sample": False, "max_new_tokens": 4, "eos_token_id": None, **setting})
    name = next(iter(setting))
    with pytest.raises(ValueError, match=name):
        generate_batch(model, [[1, 2, 3]], generation_config=gc, continuous_batching_config=CBC)
    with RolloutEngine(model, config=CBC, generation_config=gc) as engine, pytest.raises(ValueError, match=name):
        engine.generate([[1, 2, 3]], temps=0.0)


def test_engine_generate_processor_keywords():
    """`RolloutEngine.generate`'s keywords per prompt equal transformers' generate; bad values name the field."""
    model = make_model("llama")
    prompts = [repeating_prompt(model, seed=s) for s in range(2)]
    gc = GenerationConfig(do_sample=False, max_new_tokens=8, eos_token_id=0, pad_token_id=0)
    with RolloutEngine(model, config=CBC, generation_config=gc) as engine:
        bad = [[prompts[0][-1], 9]]
        batch = engine.generate(prompts, temps=0.0, max_new_tokens=8,
                                sampling=[SamplingParams(repetition_penalty=1.5, bad_words_ids=bad),
                                          SamplingParams(bad_words_ids=bad, logit_bias={7: 1.0})])
        got = [row[m.bool()].tolist() for row, m in zip(batch.completion_ids, batch.completion_mask, strict=True)]
        want0 = hf_generate(model, prompts[0], GenerationConfig(**{**gc.to_dict(), "repetition_penalty": 1.5,
                                                                    "bad_words_ids": [[prompts[0][-1], 9]]}))
        want1 = hf_generate(model, prompts[1], GenerationConfig(**{**gc.to_dict(), "sequence_bias": [[[7], 1.0]],
                                                                    "bad_words_ids": [[prompts[0][-1], 9]]}))
        assert got == [want0, want1]
        stop = got[0][1]
        early = engine.generate(prompts[:1], temps=0.0, max_new_tokens=8, sampling=SamplingParams(
            repetition_penalty=1.5, stop_token_ids=[stop], bad_words_ids=bad))
        assert early.completion_mask.sum() == 2 and early.finish_reasons == ["stop"]
        late = engine.generate(prompts[:1], temps=0.0, max_new_tokens=8, sampling=SamplingParams(
            repetition_penalty=1.5, stop_token_ids=[stop], bad_words_ids=bad, min_tokens=5))
        assert late.completion_mask.sum() >= 5
        for kw, name in ((dict(repetition_penalty=0.0), "repetition_penalty"), (dict(min_p=1.5), "min_p"),
                         (dict(min_tokens=-1), "min_tokens"), (dict(presence_penalty=[0.1]), "presence_penalty")):
            with pytest.raises(ValueError, match=name):
                engine.generate(prompts, temps=0.0, sampling=SamplingParams(**kw))
        with pytest.raises(ValueError, match="logit_bias"):
            engine.generate(prompts, temps=0.0, sampling=SamplingParams(logit_bias={1000: 1.0}))


class _Tokens:
    """A processing class that encodes every text as `prompt` (and decodes to nothing)."""

    pad_token_id, eos_token_id = 0, None

    def __init__(self, prompt: list[int]) -> None:
        self.prompt = prompt

    def __call__(self, text):
        return {"input_ids": [list(self.prompt) for _ in text]}

    def batch_decode(self, ids, skip_special_tokens=True):
        return ["" for _ in ids]


def test_trl_honours_min_p_and_repetition_penalty():
    """TRL's `repetition_penalty` / `min_p` and `generation_kwargs` reach the engine (greedy: equal to
    transformers' generate); an unimplemented generation kwarg is refused by name."""
    from types import SimpleNamespace

    from rollout.integrations.trl import make_rollout_func

    model = make_model("qwen3")
    prompt = repeating_prompt(model, seed=3)
    trainer = SimpleNamespace(
        model=model, processing_class=_Tokens(prompt),
        accelerator=SimpleNamespace(unwrap_model=lambda m: m, process_index=0, device=torch.device("cpu")),
        state=SimpleNamespace(global_step=0), args=SimpleNamespace(seed=0, generation_kwargs={"presence_penalty": 0.5}),
        num_generations=2, num_generations_eval=2, temperature=0.0, top_p=1.0, top_k=0, min_p=0.05,
        repetition_penalty=1.5, max_completion_length=8, eos_token_ids=[], _metrics={},
    )
    rollout = make_rollout_func(CBC)
    try:
        out = rollout(["p", "p"], trainer)
        want = hf_generate(model, prompt, GenerationConfig(do_sample=False, max_new_tokens=8, eos_token_id=None,
                                                           pad_token_id=0, repetition_penalty=1.5))
        plain = hf_generate(model, prompt, GenerationConfig(do_sample=False, max_new_tokens=8, eos_token_id=None,
                                                            pad_token_id=0))
        # NOTE: presence_penalty 0.5 on top; greedy ignores min_p
        assert out["completion_ids"][0] == out["completion_ids"][1] != plain
        assert out["completion_ids"][0][0] == want[0]
        trainer.args.generation_kwargs = {"num_beams": 2}
        with pytest.raises(ValueError, match="num_beams"):
            rollout(["p", "p"], trainer)
    finally:
        rollout.close()
