"""A bf16 engine against the bf16 model's own teacher-forced forward, at a tolerance set by bf16 (issue 33).

In fp32 the engine's logprobs match teacher forcing to ~1e-5 (`test_logprobs.py`). In bf16 two correct
evaluations of one model disagree: the rounding of every matmul depends on its shapes, so HF's own
forward of the same tokens over a prefix and over the whole sequence differ. The unit of that
disagreement is the rounding of the logits themselves: rounding each logit `z` to bf16 (unit roundoff
`u = 2**-8`) moves `log_softmax(z)[t] = z_t - logsumexp(z)` by up to `2 u max|z|`, and the hidden states'
roundings propagate on the same scale. Measured on these tiny models (qwen3, llama, gpt2, phi3, mistral,
gpt_neox, two seeds each, 288 sampled tokens each), per token in units of `u max|z|` of that position:

- HF's bf16 prefix forward vs its whole-sequence forward: up to 3.3, mean 0.06-0.29;
- the engine (bf16) vs the whole-sequence forward: up to 4.3, mean 0.33-0.74;
- the fp32 model vs the bf16 model: up to 5.6-16, mean 0.87-2.1.

So each token must lie within 6 units (~0.2 nats here, against the old bound of 1 nat) and the mean
within 1 unit: an engine running other weights, another precision of the weights, a shifted position
or a stale KV page is off by far more.
"""

from __future__ import annotations

import copy

import pytest
import torch
from support.tiny_models import make_model, random_prompts, teacher_forced_logits
from transformers import GenerationConfig

from rollout import ContinuousBatchingConfig, RolloutEngine

U = 2.0**-8  # bf16 unit roundoff (8 significant bits)
GROUP = 3


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def gaps_in_units(model, prompts, batch) -> torch.Tensor:
    """|engine - teacher forcing| of every sampled token over `u max|z|` at its position."""
    out = []
    for row in range(batch.completion_ids.shape[0]):
        completion = batch.completion_ids[row][batch.completion_mask[row].bool()].tolist()
        logits = teacher_forced_logits(model, prompts[row // GROUP], completion)  # [T, V] fp32 of bf16
        ref = logits.log_softmax(-1)[torch.arange(len(completion)), torch.tensor(completion)]
        gap = (batch.logprobs[row, : len(completion)] - ref).abs()
        out.append(gap / (U * logits.abs().amax(-1)))
    return torch.cat(out)


@pytest.mark.parametrize("arch", ["qwen3", "gpt2", "phi3"])
def test_bf16_engine_logprobs_match_the_bf16_model_within_bf16_rounding(arch):
    bf16 = make_model(arch, seed=0).to(torch.bfloat16)
    prompts = random_prompts(4, 8, 40, seed=13)
    config = ContinuousBatchingConfig(page_size=16, num_blocks=256)
    gc = GenerationConfig(do_sample=True, eos_token_id=None, max_new_tokens=24)
    with RolloutEngine(copy.deepcopy(bf16), config=config, generation_config=gc) as engine:
        batch = engine.generate(prompts, temps=1.0, group_size=GROUP, max_new_tokens=24, seed=0)
    units = gaps_in_units(bf16, prompts, batch)
    print(f"\n{arch} bf16 engine vs bf16 teacher forcing over {units.numel()} tokens, in units of "
          f"u max|z|: max {units.max():.2f}, mean {units.mean():.3f}")
    assert units.numel() == 4 * GROUP * 24
    assert units.max() <= 6.0 and units.mean() <= 1.0
