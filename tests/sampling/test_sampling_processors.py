"""The logits processors (issue 32) against transformers: greedy tokens equal to `model.generate` with the
same `GenerationConfig` on three architectures, seeded sampling under exactly the processed distribution,
a chi-square of first tokens, and a batch mixing processors equal to its rows run apart."""

from __future__ import annotations

import math

import pytest
import torch
from support.sampling import hf_generate, repeating_prompt
from support.tiny_models import make_model, teacher_forced_logits
from transformers import GenerationConfig
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    SequenceBiasLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
)

from rollout import ContinuousBatchingConfig, generate_batch, init_continuous_batching

pytestmark = pytest.mark.timeout(600)
ARCHS = ["llama", "qwen3", "gpt2"]
CBC = ContinuousBatchingConfig(page_size=16, num_blocks=64)
MAX_NEW = 10


def _cases(prompt: list[int], base: list[int]) -> list[dict]:
    """GenerationConfig extras; each changes this prompt's greedy output (`base`)."""
    g0, g1 = base[0], base[1]
    return [
        dict(repetition_penalty=1.5),
        dict(repetition_penalty=0.5),
        dict(no_repeat_ngram_size=1),
        dict(no_repeat_ngram_size=2),
        dict(suppress_tokens=[g0, g1]),
        dict(begin_suppress_tokens=[g0]),
        dict(forced_eos_token_id=3),
        dict(bad_words_ids=[[prompt[-1], g0]]),
        dict(sequence_bias=[[[g0, g1], -20.0], [[7], 3.0]]),
        dict(min_new_tokens=6, eos_token_id=g1),
        dict(min_length=len(prompt) + 6, eos_token_id=g1),
    ]


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_equals_hf_generate_per_processor(arch):
    """Every processor changes the greedy output of a prompt that repeats tokens, and the engine's tokens
    equal transformers' `generate` with the same GenerationConfig."""
    model = make_model(arch)
    prompt = repeating_prompt(model, seed=1)  # NOTE: seed 1: a bigram ban bites on all three models
    # NOTE: an explicit EOS: with None, transformers falls back to the model config's (Llama: 2)
    plain = dict(do_sample=False, max_new_tokens=MAX_NEW, eos_token_id=0, pad_token_id=0)
    base = hf_generate(model, prompt, GenerationConfig(**plain))
    for extra in _cases(prompt, base):
        gc = GenerationConfig(**{**plain, **extra})
        ours = next(iter(generate_batch(model, [prompt], generation_config=gc, continuous_batching_config=CBC)
                         .values())).generated_tokens
        assert ours == hf_generate(model, prompt, gc), extra
        assert ours != base, f"{extra} does not change the output: the case proves nothing"


def _expected_logprobs(model, prompt, completion, temperature, penalty, bias, top_k, min_p) -> torch.Tensor:
    """transformers' own processors and warpers, teacher-forced: log p of each completion token [T]."""
    logits = teacher_forced_logits(model, prompt, completion)  # [T, V]
    steps = [SequenceBiasLogitsProcessor([[[t], b] for t, b in bias.items()]),
             RepetitionPenaltyLogitsProcessor(penalty), TemperatureLogitsWarper(temperature),
             TopKLogitsWarper(top_k), MinPLogitsWarper(min_p)]
    out = []
    for i, token in enumerate(completion):
        ids = torch.tensor([prompt + completion[:i]])
        scores = logits[i : i + 1].clone()
        for step in steps:
            scores = step(ids, scores)
        out.append(scores.log_softmax(-1)[0, token])
    return torch.stack(out)


@pytest.mark.parametrize("arch", ARCHS)
def test_seeded_sampling_logprobs_are_the_processed_distribution(arch):
    """Sampled with logit bias, repetition penalty, temperature, top-k and min-p: each processed logprob
    equals transformers' processors applied to the teacher-forced logits; raw mode gives log_softmax."""
    model = make_model(arch)
    prompt = repeating_prompt(model, seed=1)
    bias = {prompt[0]: 2.0, prompt[3]: -1.5}
    kw = dict(temperature=1.3, top_k=40, min_p=0.02, repetition_penalty=1.3, logit_bias=bias, seed=7)
    for mode in ("processed", "raw"):
        cfg = CBC.replace(return_logprobs=True, logprobs_mode=mode)
        gc = GenerationConfig(do_sample=True, max_new_tokens=12, eos_token_id=None)
        out = next(iter(generate_batch(model, [prompt], gc, cfg, **kw).values()))
        got = torch.tensor(out.logprobs)
        if mode == "processed":
            want = _expected_logprobs(model, prompt, out.generated_tokens, 1.3, 1.3, bias, 40, 0.02)
        else:
            logits = teacher_forced_logits(model, prompt, out.generated_tokens).log_softmax(-1)
            want = logits[torch.arange(len(out.generated_tokens)), torch.tensor(out.generated_tokens)]
        torch.testing.assert_close(got, want, atol=2e-4, rtol=0)


def test_first_tokens_follow_the_processed_distribution_chi_square():
    """400 seeded one-token samples with repetition + presence penalties and a logit bias: a chi-square
    test of their counts against the processed distribution (p > 1e-3), and far from the unprocessed one."""
    model = make_model("qwen3")
    prompt = repeating_prompt(model, seed=2)
    logits = teacher_forced_logits(model, prompt, [0])[0] / 2.0  # [V], temperature 2
    manager = init_continuous_batching(model, GenerationConfig(do_sample=True, max_new_tokens=1, eos_token_id=None),
                                       CBC.replace(num_blocks=256))
    manager.start()
    try:
        kw = dict(temperature=2.0, repetition_penalty=2.0, presence_penalty=1.0, logit_bias={prompt[2]: 3.0})
        rids = [manager.add_request(prompt, seed=s, **kw) for s in range(400)]
        tokens = [manager.get_result(r, timeout=300).generated_tokens[0] for r in rids]
    finally:
        manager.destroy()
    seen = torch.zeros_like(logits, dtype=torch.bool)
    seen[torch.tensor(prompt)] = True
    x = logits * 2.0
    x[prompt[2]] += 3.0
    x = torch.where(seen, torch.where(x < 0, x * 2.0, x / 2.0), x) / 2.0
    counts = torch.bincount(torch.tensor(tokens), minlength=logits.numel()).double()
    for probs, should_fit in ((x.softmax(-1).double(), True), (logits.softmax(-1).double(), False)):
        p_value = _chi_square_p(counts, probs * len(tokens))
        assert (p_value > 1e-3) == should_fit, (should_fit, p_value)


def _chi_square_p(counts: torch.Tensor, expected: torch.Tensor) -> float:
    """p-value of Pearson's chi-square, bins with expected < 5 pooled into one."""
    big = expected >= 5
    obs = torch.cat([counts[big], counts[~big].sum()[None]])
    exp = torch.cat([expected[big], expected[~big].sum()[None]])
    keep = exp > 0
    stat = float(((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum())
    dof = int(keep.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2.0, dtype=torch.float64),
                                         torch.tensor(stat / 2.0, dtype=torch.float64)))


@pytest.mark.parametrize("arch", ARCHS)
def test_mixed_batch_equals_rows_apart(arch):
    """One batch mixing rows with and without each processor (greedy and seeded sampling) gives every row
    the tokens and logprobs it gets alone."""
    model = make_model(arch)
    prompts = [repeating_prompt(model, seed=s) for s in range(3)]
    rows = [
        dict(),
        dict(repetition_penalty=1.4),
        dict(presence_penalty=1.5, frequency_penalty=0.5, temperature=1.0, seed=3),
        dict(min_p=0.1, temperature=1.0, seed=4),
        dict(logit_bias={5: 4.0}, temperature=0.0),
        dict(bad_words_ids=[[prompts[1][-1], 9]], no_repeat_ngram_size=2),
        dict(min_tokens=4, eos_token_ids=[prompts[0][0]], temperature=0.7, seed=5),
        dict(temperature=1.0, seed=6),
    ]
    gc = GenerationConfig(do_sample=False, max_new_tokens=MAX_NEW, eos_token_id=None)
    cfg = CBC.replace(return_logprobs=True, num_blocks=128)

    def run(pairs):
        manager = init_continuous_batching(model, gc, cfg)
        manager.start()
        try:
            rids = [manager.add_request(prompts[i % 3], **kw) for i, kw in pairs]
            return [manager.get_result(r, timeout=300) for r in rids]
        finally:
            manager.destroy()

    together = run(list(enumerate(rows)))
    for i, kw in enumerate(rows):
        alone = run([(i, kw)])[0]
        assert together[i].generated_tokens == alone.generated_tokens, kw
        assert together[i].logprobs == pytest.approx(alone.logprobs, abs=1e-4), kw
    assert math.isfinite(sum(sum(o.logprobs) for o in together))


def test_presence_and_frequency_penalties_follow_vllm():
    """vLLM's semantics: logits - frequency x count - presence x (count > 0), counts over generated tokens
    only (the prompt's do not count); checked through the processed logprobs of a seeded sample."""
    model = make_model("qwen3")
    prompt = repeating_prompt(model, seed=4)
    cfg = CBC.replace(return_logprobs=True)
    gc = GenerationConfig(do_sample=True, max_new_tokens=16, eos_token_id=None)
    out = next(iter(generate_batch(model, [prompt], gc, cfg, temperature=0.8, presence_penalty=1.5,
                                   frequency_penalty=0.7, seed=11).values()))
    tokens = out.generated_tokens
    logits = teacher_forced_logits(model, prompt, tokens)  # [T, V]
    counts = torch.zeros(logits.shape[-1])
    want = []
    for i, token in enumerate(tokens):
        x = logits[i] - 0.7 * counts - 1.5 * (counts > 0).float()
        want.append((x / 0.8).log_softmax(-1)[token])
        counts[token] += 1
    assert len(set(tokens)) < len(tokens), "no token repeats: the penalties were never exercised"
    torch.testing.assert_close(torch.tensor(out.logprobs), torch.stack(want), atol=2e-4, rtol=0)
