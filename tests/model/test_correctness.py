"""Greedy outputs of the engine are token-identical to `model.generate`, one prompt at a time.

Seven architectures (RoPE, GQA, sliding windows shorter than the prompts, logit softcapping, learned
positions, partial rotary, fused QKV), prompts of 3-80 tokens, several sharing a 40-token prefix, with a
48-token step budget and 16-token pages, so long prompts are prefilled in chunks, chunks straddle
pages, and prefix-cache hits (where the model has no sliding window) feed later requests.

Every attention backend runs the matrix (`attn_backend`: "cpu", "sdpa", "flex"). The flex kernel
compiles once per head layout (~10-40 s on 2 cores): the default suite runs it on the four
architectures that share test_flex_backend's layout (4 heads, 2 KV heads, head size 16), the rest
is `slow`.
"""

from __future__ import annotations

import pytest
from support.greedy import (
    ARCHS,
    BUDGET,
    GREEDY_GC,
    LONG,
    MAX_NEW,
    PROMPTS,
    PS,
    backend_matrix,
    reference,
    run_engine,
)
from transformers import GenerationConfig

from rollout import ContinuousBatchingConfig, RequestStatus, generate_batch
from rollout.engine.core import EngineCore


@pytest.mark.parametrize("arch, backend", backend_matrix(ARCHS))
def test_greedy_matches_hf_generate_with_chunked_prefill(arch, backend):
    model, expected = reference(arch)
    cbc = ContinuousBatchingConfig(page_size=PS, max_batch_tokens=BUDGET, num_blocks=128, attn_backend=backend)
    core = EngineCore(model, GREEDY_GC, cbc)
    reqs, chunks, step_tokens = run_engine(core, PROMPTS)

    for i, (req, exp) in enumerate(zip(reqs, expected, strict=True)):
        assert req.status == RequestStatus.FINISHED and req.finish_reason == "length"
        assert req.generated == exp, f"{arch}: prompt {i} ({len(PROMPTS[i])} tokens) differs from generate"

    # the budget holds every step, and long prompts really were split across steps
    assert max(step_tokens) <= BUDGET
    assert len(step_tokens) >= -(-sum(map(len, PROMPTS)) // BUDGET)
    long_id = f"r{PROMPTS.index(next(p for p in PROMPTS if len(p) == LONG))}"
    prompt_chunks = chunks[long_id][: len(chunks[long_id]) - (MAX_NEW - 1)]  # drop the 1-token decodes
    assert sum(prompt_chunks) == LONG and len(prompt_chunks) >= 2, prompt_chunks
    assert all(n <= BUDGET for n in prompt_chunks)

    stats = core.cache_stats()
    assert stats["preemptions"] == 0
    assert stats["free_blocks"] == stats["num_blocks"]
    assert stats["generated_tokens"] == MAX_NEW * len(PROMPTS)
    assert stats["computed_prompt_tokens"] + stats["cached_prompt_tokens"] == sum(map(len, PROMPTS))


@pytest.mark.parametrize("backend", ["cpu", "sdpa", "flex"])
@pytest.mark.parametrize(
    "arch, policy, sharing",
    # NOTE: Mistral's sliding window turns prefix caching off: there preemption means recomputation
    [("llama", "fifo", True), ("llama", "prefill_first", False), ("mistral", "prefill_first", True)],
)
def test_greedy_matches_hf_generate_under_preemption(arch, policy, sharing, backend):
    """A pool of 7 pages (the longest request needs 6): requests are preempted and resumed."""
    model, expected = reference(arch)
    cbc = ContinuousBatchingConfig(
        page_size=PS,
        max_batch_tokens=BUDGET,
        num_blocks=7,
        scheduler_type=policy,
        allow_block_sharing=sharing,
        attn_backend=backend,
    )
    core = EngineCore(model, GREEDY_GC, cbc)
    reqs, _, _ = run_engine(core, PROMPTS)
    assert [r.generated for r in reqs] == expected
    stats = core.cache_stats()
    assert stats["preemptions"] > 0
    assert stats["free_blocks"] == stats["num_blocks"]


def test_generate_batch_public_api_and_eos():
    model, expected = reference("llama")
    cbc = ContinuousBatchingConfig(page_size=PS, max_batch_tokens=BUDGET, num_blocks=128)
    out = generate_batch(model, PROMPTS, generation_config=GREEDY_GC, continuous_batching_config=cbc)
    assert list(out) == [f"req_{i}" for i in range(len(PROMPTS))]  # submission order
    for i, o in enumerate(out.values()):
        assert o.prompt_ids == PROMPTS[i]
        assert o.generated_tokens == expected[i]
        assert o.status == RequestStatus.FINISHED and o.finish_reason == "length" and o.error is None
        assert o.logprobs is None

    # with an EOS token, each request stops right after the first time generate produced it
    eos = expected[0][2]
    gc = GenerationConfig(do_sample=False, eos_token_id=eos, max_new_tokens=MAX_NEW)
    out = generate_batch(model, PROMPTS, generation_config=gc, continuous_batching_config=cbc)
    stopped = 0
    for i, o in enumerate(out.values()):
        ref = expected[i]
        if eos in ref:
            stopped += 1
            assert o.generated_tokens == ref[: ref.index(eos) + 1] and o.finish_reason == "stop"
        else:
            assert o.generated_tokens == ref and o.finish_reason == "length"
    assert stopped >= 1
