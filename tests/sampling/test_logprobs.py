"""Per-token logprobs against a teacher-forced forward of the same tokens (fp32, within 1e-4).

"raw" is `log_softmax(logits)`; "processed" is the log-probability under the distribution the token
was drawn from: `log_softmax(logits / T)` restricted to the kept set (top-k, then top-p, as
transformers' TopK then TopP warpers) and renormalised. Greedy requests report the raw logprob. The
reference below is written independently of `rollout.sampling.sampler` (fp64, HF's ascending-cumsum top-p).
"""

from __future__ import annotations

import functools

import pytest
import torch
from support.tiny_models import VOCAB, make_model, teacher_forced_logits
from transformers import GenerationConfig
from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from rollout import ContinuousBatchingConfig, generate_batch
from rollout.engine.core import EngineCore

ATOL = 1e-4
MAX_NEW = 8
GC = GenerationConfig(do_sample=True, eos_token_id=None, max_new_tokens=MAX_NEW)
TEMPS = (0.7, 1.0, 1.5)
FILTERS = ((0, 1.0), (5, 1.0), (0, 0.8), (10, 0.9))  # (top_k, top_p); 0 and 1.0 mean off


def reference_logprobs(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """[V] log-probabilities of the processed distribution, -inf outside the kept set (fp64)."""
    scores = logits.double() / temperature
    if top_k > 0:
        kth = scores.sort(descending=True).values[min(top_k, scores.numel()) - 1]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if top_p < 1.0:
        ascending, order = scores.sort()
        cum = ascending.softmax(-1).cumsum(-1)
        drop = cum <= 1 - top_p
        drop[-1] = False  # the most likely token always stays
        scores = scores.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))
    return scores.log_softmax(-1)


@pytest.mark.parametrize("temperature", TEMPS)
@pytest.mark.parametrize("top_k, top_p", FILTERS)
def test_reference_agrees_with_transformers_warpers(temperature, top_k, top_p):
    logits = torch.randn(4, VOCAB, generator=torch.Generator().manual_seed(7)) * 3
    warped = TemperatureLogitsWarper(temperature)(None, logits)
    if top_k:
        warped = TopKLogitsWarper(top_k)(None, warped)
    if top_p < 1.0:
        warped = TopPLogitsWarper(top_p)(None, warped)
    for row in range(4):
        ours = reference_logprobs(logits[row], temperature, top_k, top_p)
        assert torch.equal(ours.isfinite(), warped[row].isfinite())
        torch.testing.assert_close(
            ours.float()[ours.isfinite()], warped[row].log_softmax(-1)[ours.isfinite()]
        )


@functools.cache
def model_and_prompts():
    model = make_model("llama", seed=3)
    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(1, VOCAB, (n,), generator=g).tolist() for n in (5, 19, 40)]
    return model, prompts


def request_specs(prompts):
    """(prompt, temperature, top_k, top_p, seed): a greedy request per prompt, then every combination
    twice (on different prompts), all in one batch."""
    specs = [(p, 0.0, 0, 1.0, None) for p in prompts]
    combos = [(t, k, p) for t in TEMPS for k, p in FILTERS] * 2
    specs += [(prompts[i % len(prompts)], t, k, p, i) for i, (t, k, p) in enumerate(combos)]
    return specs


def run(mode: str, specs, backend: str = "auto"):
    model, _ = model_and_prompts()
    cbc = ContinuousBatchingConfig(
        page_size=16, num_blocks=256, max_batch_tokens=256, return_logprobs=True, logprobs_mode=mode,
        attn_backend=backend,
    )
    core = EngineCore(model, GC, cbc)
    reqs = []
    for i, (prompt, t, k, p, seed) in enumerate(specs):
        reqs.append(core.make_request(prompt, request_id=f"r{i}", temperature=t, top_k=k, top_p=p, seed=seed))
        core.add(reqs[-1])
    while core.has_work():
        core.step()
    return model, [r.to_output() for r in reqs]


def check(model, spec, out, mode: str) -> None:
    prompt, t, k, p, _ = spec
    tokens = out.generated_tokens
    assert len(tokens) == MAX_NEW and len(out.logprobs) == MAX_NEW
    logits = teacher_forced_logits(model, prompt, tokens)  # [T, V]
    for pos, tok in enumerate(tokens):
        raw = logits[pos].log_softmax(-1)
        if t == 0.0:
            assert tok == int(logits[pos].argmax()), "greedy request did not take the argmax"
            expected = float(raw[tok])  # greedy reports the raw logprob in both modes
        else:
            kept = reference_logprobs(logits[pos], t, k, p)
            assert kept[tok].isfinite(), f"sampled token {tok} is outside the kept set (T={t}, k={k}, p={p})"
            expected = float(raw[tok]) if mode == "raw" else float(kept[tok])
        assert out.logprobs[pos] == pytest.approx(expected, abs=ATOL), (spec[1:], pos)


@pytest.mark.parametrize("mode, backend", [("raw", "auto"), ("processed", "auto"), ("processed", "sdpa"),
                                           ("processed", "flex")])
def test_logprobs_match_teacher_forcing(mode, backend):
    _, prompts = model_and_prompts()
    specs = request_specs(prompts)
    model, outs = run(mode, specs, backend)
    for spec, out in zip(specs, outs, strict=True):
        check(model, spec, out, mode)


def test_processed_differs_from_raw_under_temperature_and_filters():
    """Same seeds, both modes: identical tokens, and the two logprobs disagree where they should."""
    _, prompts = model_and_prompts()
    specs = [(prompts[1], 1.5, 0, 1.0, 1), (prompts[1], 1.0, 3, 1.0, 2), (prompts[1], 1.0, 1, 1.0, 4)]
    model, raw = run("raw", specs)
    _, processed = run("processed", specs)
    for r, p in zip(raw, processed, strict=True):
        assert r.generated_tokens == p.generated_tokens
    pairs = [list(zip(r.logprobs, p.logprobs, strict=True)) for r, p in zip(raw, processed, strict=True)]
    assert all(abs(a - b) > 1e-3 for a, b in pairs[0])  # T != 1 changes every probability
    assert all(b >= a - ATOL for a, b in pairs[1])  # top-k renormalises onto fewer tokens
    assert processed[2].logprobs == pytest.approx([0.0] * MAX_NEW, abs=ATOL)  # top_k=1: one token, p = 1


def test_sampled_tokens_stay_in_a_small_kept_set():
    """Hot sampling with tight filters: every one of 128 draws must be inside the top-k / top-p set."""
    _, prompts = model_and_prompts()
    specs = [
        (prompts[i % 3], 2.0, k, p, 100 + i) for i, (k, p) in enumerate([(3, 1.0), (0, 0.5), (4, 0.7)] * 6)
    ]
    model, outs = run("processed", specs)
    for spec, out in zip(specs, outs, strict=True):
        check(model, spec, out, "processed")


def test_generate_batch_kwargs_apply_to_every_request():
    model, prompts = model_and_prompts()
    cbc = ContinuousBatchingConfig(page_size=16, num_blocks=64, return_logprobs=True)
    out = generate_batch(
        model,
        prompts,
        generation_config=GC,
        continuous_batching_config=cbc,
        temperature=0.7,
        top_k=5,
        top_p=0.9,
        seed=3,
    )
    for prompt, o in zip(prompts, out.values(), strict=True):
        check(model, (prompt, 0.7, 5, 0.9, 3), o, "processed")


@pytest.mark.skipif(__import__("rollout.kernels.cpu_kernels", fromlist=["x"]).greedy_verify() is None,
                    reason="rollout's CPU kernels unavailable here (no compiler)")
def test_a_greedy_step_s_logprobs_in_one_kernel_call(monkeypatch):
    """Greedy rows with logprobs (an RL engine's default) take `cpu_kernels.greedy_verify` on fp32 CPU logits: the
    same tokens as torch's argmax, logprobs within float rounding of torch's log_softmax; `exact_logprobs` (what a
    batch-invariant engine sets) keeps torch's, bit for bit; a sampled row, a processor, top-k logprobs or a mask
    takes the full path as before."""
    from rollout.kernels import cpu_kernels
    from rollout.requests import SamplingParams
    from rollout.sampling import sampler as sampler_module

    calls = []
    kernel = cpu_kernels.greedy_verify()
    monkeypatch.setattr(cpu_kernels, "greedy_verify", lambda: lambda *a: calls.append(1) or kernel(*a))
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 300, generator=g) * 4
    logits[2, 7] = logits[2, 9] = logits[2].max() + 1  # NOTE: a tie: the first index, as torch's argmax
    want_tokens = logits.argmax(-1).tolist()
    want = logits.log_softmax(-1).gather(1, logits.argmax(-1)[:, None])[:, 0].tolist()
    greedy = [SamplingParams(temperature=0.0)] * 6
    ids = [f"r{i}" for i in range(6)]
    for mode in ("processed", "raw"):
        fast = sampler_module.Sampler(torch.device("cpu"))(logits, greedy, ids, mode)
        assert calls and fast.tokens == want_tokens == [int(t) for t in fast.tokens] and fast.tokens[2] == 7
        assert fast.logprobs == pytest.approx(want, rel=2e-7, abs=1e-7)
        calls.clear()
        exact = sampler_module.Sampler(torch.device("cpu"), exact_logprobs=True)(logits, greedy, ids, mode)
        assert not calls and exact.tokens == want_tokens and exact.logprobs == want  # NOTE: torch's, bit for bit
    mixed = [SamplingParams(temperature=0.0)] * 5 + [SamplingParams(temperature=1.0, seed=3)]
    sampler_module.Sampler(torch.device("cpu"))(logits, mixed, ids, "processed")
    assert not calls  # NOTE: a sampled row in the step: the full path
