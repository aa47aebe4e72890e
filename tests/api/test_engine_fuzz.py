"""Random RL rollout calls against one persistent `RolloutEngine`, greedy, on the architectures with
sliding windows (Mistral; Gemma 2, which alternates sliding and full layers) and Qwen3, for the `cpu`
and `flex` backends.

Each case draws a configuration (page size 4-16, a cache of 30-400 pages, step budgets of 16-256 tokens,
CPU offload on or off) and runs three `generate` calls on the same engine, each with 1-4 prompts that
share a random prefix and 1-4 samples per prompt: forks of a group leader, prefix-cache hits within and
across calls, chunked prompts, preemption under cache pressure, sliding pages recycled, block-table
rows handed from finished requests to new ones. Every row must equal `model.generate` of its prompt,
and the engine must hold no page afterwards.

The `cpu` cases run by default (~5 s); the `flex` ones compile kernels for page sizes the other tests
do not use, so they are marked slow (run with `-m slow`).
"""

from __future__ import annotations

import random

import pytest
from support.tiny_models import hf_greedy, make_model
from transformers import GenerationConfig

from rollout import ContinuousBatchingConfig, RolloutEngine


@pytest.mark.parametrize("backend", ["cpu", pytest.param("flex", marks=pytest.mark.slow)])
@pytest.mark.parametrize("arch", ["mistral", "gemma2", "qwen3"])
def test_random_rollout_calls_equal_generate(arch, backend):
    model = make_model(arch)
    vocab = model.config.vocab_size
    gc = GenerationConfig(do_sample=False, max_new_tokens=20, eos_token_id=None, pad_token_id=0)
    for case in range(5):
        rng = random.Random(100 + case)
        cfg = ContinuousBatchingConfig(page_size=rng.choice([4, 8, 16]), num_blocks=rng.choice([30, 48, 64, 400]),
                                       max_batch_tokens=rng.choice([16, 48, 256]),
                                       cpu_offload_space=rng.choice([0.0, 0.01]), attn_backend=backend)
        engine = RolloutEngine(model, config=cfg, generation_config=gc)
        try:
            for call in range(3):
                n, group = rng.randint(1, 4), rng.randint(1, 4)
                base = [rng.randrange(vocab) for _ in range(rng.randint(8, 40))]
                prompts = [base[: rng.randint(4, len(base))] + [rng.randrange(vocab) for _ in range(rng.randint(0, 8))]
                           for _ in range(n)]
                new = rng.randint(3, 20)
                batch = engine.generate(prompts, temps=0.0, group_size=group, max_new_tokens=new)
                for i, prompt in enumerate(prompts):
                    want = hf_greedy(model, prompt, new)
                    for j in range(group):
                        r = i * group + j
                        got = batch.completion_ids[r][batch.completion_mask[r].bool()].tolist()
                        assert got == want, f"case {case} ({cfg}), call {call}, prompt {i}, sample {j}"
            pool = engine.manager.core.page_pool
            pool.check_invariants()
            assert pool.num_free_pages == pool.num_pages, f"case {case}: pages held after the calls"
        finally:
            engine.close()
