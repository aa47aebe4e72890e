"""Issue 39: "processed" logprobs are one thing everywhere. Under every logits processor (each alone and all
together), for greedy (temperature 0), near-greedy (0.4) and sampled (1.0) rows: a sampled token's logprob
equals its own `top_logprobs` entry (when in the top k), and `RolloutEngine.score` with the same sampling
arguments gives the same logprobs and top k for the same tokens. "raw" stays the model's `log_softmax`.
The combination is also checked against transformers' own processors applied teacher-forced."""

from __future__ import annotations

import functools

import pytest
import torch
from support.sampling import repeating_prompt, sampling_of
from support.tiny_models import hf_greedy, make_model, teacher_forced_logits
from transformers import GenerationConfig
from transformers.generation.logits_process import (
    MinNewTokensLengthLogitsProcessor,
    MinPLogitsWarper,
    NoBadWordsLogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
    SequenceBiasLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from rollout import ContinuousBatchingConfig, RolloutEngine

pytestmark = pytest.mark.timeout(600)
TEMPS = (0.0, 0.4, 1.0, 1.0)  # greedy, near-greedy, two sampled rows (seeded apart)
K = 5
MAX_NEW = 12
ATOL = 1e-4  # NOTE: decode vs prefill forwards of the same tokens differ by summation order only


@functools.cache
def model_and_prompt():
    model = make_model("qwen3", seed=0)
    prompt = repeating_prompt(model, seed=1)
    return model, prompt, hf_greedy(model, prompt, 2)


def cases() -> dict[str, dict]:
    _, prompt, base = model_and_prompt()
    every = dict(repetition_penalty=1.5, presence_penalty=1.0, frequency_penalty=0.5,
                 logit_bias={prompt[0]: 3.0, prompt[1]: -2.0, base[0]: 1.5}, min_p=0.05, min_tokens=6,
                 stop_token_ids=[base[1]], bad_words_ids=[[base[0]], [prompt[-1], base[1]]], top_k=40, top_p=0.95)
    return {
        "repetition_penalty": dict(repetition_penalty=1.5),
        "presence_penalty": dict(presence_penalty=1.5),
        "frequency_penalty": dict(frequency_penalty=0.8),
        "logit_bias": dict(logit_bias={prompt[0]: 3.0, prompt[1]: -2.0, base[0]: 2.0}),
        "min_p": dict(min_p=0.05),
        # NOTE: the stop token is the greedy next token, so the ban moves mass at every step
        "min_tokens": dict(min_tokens=MAX_NEW, stop_token_ids=[base[0]]),
        "bad_words_ids": dict(bad_words_ids=[[base[0]], [prompt[-1], base[1]]]),
        "top_k_top_p": dict(top_k=8, top_p=0.9),
        "every": every,
        # one value per row: rows of one batch with different processors
        "per_row": dict(repetition_penalty=[1.0, 1.5, 2.0, 1.3], logit_bias=[{}, {base[0]: 2.0}, {}, {prompt[2]: -3.0}],
                        presence_penalty=[0.5, 0.0, 1.0, 0.0]),
    }


_ENGINES: dict[str, RolloutEngine] = {}


def engine(mode: str) -> RolloutEngine:
    if mode not in _ENGINES:
        model, _, _ = model_and_prompt()
        cfg = ContinuousBatchingConfig(page_size=16, num_blocks=128, logprobs_mode=mode)
        gc = GenerationConfig(do_sample=True, eos_token_id=None, max_new_tokens=MAX_NEW)
        _ENGINES[mode] = RolloutEngine(model, config=cfg, generation_config=gc)
    return _ENGINES[mode]


@pytest.fixture(scope="module", autouse=True)
def _close_engines():
    yield
    while _ENGINES:
        _ENGINES.popitem()[1].close()


def rollout(mode: str, kw: dict):
    _, prompt, _ = model_and_prompt()
    eng = engine(mode)
    batch = eng.generate([prompt] * len(TEMPS), temps=list(TEMPS), seed=3,
                         sampling=sampling_of({**kw, "logprobs": K}, len(TEMPS)))
    return eng, batch


def own_top_gap(batch) -> tuple[float, int]:
    """(largest |logprob - its top_logprobs entry| over tokens in their own top k, how many such tokens)."""
    gap, hits = 0.0, 0
    for r in range(batch.completion_ids.shape[0]):
        for t in range(int(batch.completion_mask[r].sum())):
            ids = batch.top_ids[r, t].tolist()
            tok = int(batch.completion_ids[r, t])
            if tok in ids:
                hits += 1
                gap = max(gap, abs(float(batch.top_logprobs[r, t, ids.index(tok)]) - float(batch.logprobs[r, t])))
    return gap, hits


def assert_top_close(a_vals, a_ids, b_vals, b_ids, mask):
    """Top k values within ATOL; ids equal where the value is finite and not tied within ATOL to a neighbour."""
    torch.testing.assert_close(a_vals[mask], b_vals[mask], atol=ATOL, rtol=0)
    v = a_vals[mask]  # [M, k]
    gaps = torch.cat([v[:, :1] - v[:, 1:2], v[:, :-1] - v[:, 1:]], dim=1).abs().nan_to_num(0.0)  # [M, k]
    after = torch.cat([(v[:, :-1] - v[:, 1:]).abs().nan_to_num(0.0), torch.full_like(v[:, :1], 1.0)], dim=1)
    clear = v.isfinite() & (gaps > ATOL) & (after > ATOL)
    assert torch.equal(a_ids[mask][clear], b_ids[mask][clear])


@pytest.mark.parametrize("case", list(cases()))
def test_processed_logprob_equals_its_top_entry_and_score(case):
    kw = cases()[case]
    eng, batch = rollout("processed", kw)
    mask = batch.completion_mask.bool()  # [N, T]
    gap, hits = own_top_gap(batch)
    assert hits >= 10, f"{case}: only {hits} sampled tokens in their own top {K}: the check proves little"
    assert gap <= 1e-6, f"{case}: a sampled token's logprob and its top_logprobs entry differ by {gap}"

    scored = eng.score(batch, top_logprobs=K, sampling=sampling_of(kw, len(TEMPS)))
    torch.testing.assert_close(scored.logprobs[mask], batch.logprobs[mask], atol=ATOL, rtol=0)
    assert_top_close(scored.top_logprobs, scored.top_ids, batch.top_logprobs, batch.top_ids, mask)

    # the case exercises its processor: without it, score gives other logprobs for the sampled rows
    warpers = {k: v for k, v in kw.items() if k in ("top_k", "top_p")}
    plain = eng.score(batch, sampling=sampling_of(warpers)) if case != "top_k_top_p" else eng.score(batch)
    sampled = mask & (batch.temperatures > 0)[:, None]
    assert (plain.logprobs - batch.logprobs)[sampled].abs().max() > 1e-2, f"{case} changes no logprob"

    # greedy rows report the raw logprob, under any processor
    model, prompt, _ = model_and_prompt()
    for r in (i for i, t in enumerate(TEMPS) if t == 0.0):
        tokens = batch.completion_ids[r][mask[r]].tolist()
        raw = teacher_forced_logits(model, prompt, tokens).log_softmax(-1)  # [T, V]
        want = raw.gather(1, torch.tensor(tokens)[:, None])[:, 0]
        torch.testing.assert_close(batch.logprobs[r][mask[r]], want, atol=ATOL, rtol=0)


@pytest.mark.parametrize("case", ["repetition_penalty", "logit_bias", "min_tokens", "every"])
def test_raw_mode_stays_log_softmax(case):
    """raw: every logprob, top k and score is the unmodified model's `log_softmax`, whatever the processors."""
    kw = cases()[case]
    eng, batch = rollout("raw", kw)
    model, prompt, _ = model_and_prompt()
    scored = eng.score(batch, top_logprobs=K, sampling=sampling_of(kw, len(TEMPS)))
    mask = batch.completion_mask.bool()
    for r in range(len(TEMPS)):
        tokens = batch.completion_ids[r][mask[r]].tolist()
        raw = teacher_forced_logits(model, prompt, tokens).log_softmax(-1)  # [T, V]
        want = raw.gather(1, torch.tensor(tokens)[:, None])[:, 0]
        for got in (batch.logprobs[r][mask[r]], scored.logprobs[r][mask[r]]):
            torch.testing.assert_close(got, want, atol=ATOL, rtol=0)
        best = raw.topk(K, dim=-1).values  # [T, K]
        for got in (batch.top_logprobs[r][mask[r]], scored.top_logprobs[r][mask[r]]):
            torch.testing.assert_close(got, best, atol=ATOL, rtol=0)


def test_score_under_every_processor_equals_transformers():
    """score's processed logprobs of a sampled row against transformers' processors and warpers applied to a
    teacher-forced forward (presence / frequency, vLLM's, by hand), prompt positions included."""
    kw = cases()["every"]
    model, prompt, base = model_and_prompt()
    eng, batch = rollout("processed", kw)
    r = len(TEMPS) - 1
    mask = batch.completion_mask[r].bool()
    completion = batch.completion_ids[r][mask].tolist()
    scored = eng.score([prompt], [completion], temps=TEMPS[r], prompt_logprobs=True, sampling=sampling_of(kw))
    eos = kw["stop_token_ids"]
    bias = SequenceBiasLogitsProcessor([[[t], b] for t, b in kw["logit_bias"].items()])
    logits = teacher_forced_logits(model, prompt, completion)  # [T, V]: position P - 1 + t
    with torch.no_grad():
        full = model(torch.tensor([prompt + completion])).logits[0].float()  # [P + T, V]

    def expected(pos: int, num_prompt: int) -> float:
        ids = torch.tensor([(prompt + completion)[: pos + 1]])
        x = full[pos : pos + 1].clone()
        for step in (bias, NoBadWordsLogitsProcessor(kw["bad_words_ids"], eos_token_id=None),
                     RepetitionPenaltyLogitsProcessor(kw["repetition_penalty"])):
            x = step(ids, x)
        counts = torch.bincount(ids[0, num_prompt:], minlength=x.shape[-1]).float()
        x = x - kw["frequency_penalty"] * counts - kw["presence_penalty"] * (counts > 0).float()
        x = MinNewTokensLengthLogitsProcessor(num_prompt, kw["min_tokens"], eos)(ids, x)
        for step in (TemperatureLogitsWarper(TEMPS[r]), TopKLogitsWarper(kw["top_k"]),
                     TopPLogitsWarper(kw["top_p"]), MinPLogitsWarper(kw["min_p"])):
            x = step(ids, x)
        return float(x.log_softmax(-1)[0, (prompt + completion)[pos + 1]])

    assert torch.allclose(full[len(prompt) - 1 : -1], logits, atol=1e-5)
    want = torch.tensor([expected(len(prompt) - 1 + t, len(prompt)) for t in range(len(completion))])
    torch.testing.assert_close(scored.logprobs[0, : len(completion)], want, atol=ATOL, rtol=0)
    torch.testing.assert_close(batch.logprobs[r][mask], want, atol=ATOL, rtol=0)
    # prompt positions: scored as if the prompt ended there (nothing generated yet: EOS banned, no counts)
    want_prompt = torch.tensor([expected(p, p + 1) for p in range(len(prompt) - 1)])
    torch.testing.assert_close(scored.prompt_logprobs[0, 1:], want_prompt, atol=ATOL, rtol=0)
