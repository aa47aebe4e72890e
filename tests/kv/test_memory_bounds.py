"""No buffer of a default engine step grows with the square of its tokens (issue 33).

A 4096-token prompt is one prefill step at the default config (`max_batch_tokens` 8192). The peak of
the bytes allocated during that step (every CPU allocation, kernels' internal ones included, from
the profiler's memory timeline) must grow linearly with the tokens: 4096 tokens at most ~2x the
2048-token step, and far below one head's fp32 T x T scores (64 MiB). The measure itself is checked
to see a quadratic buffer: HF's eager attention (dense scores) quadruples from 512 to 1024 tokens.
"""

from __future__ import annotations

import pytest
import torch
from torch.profiler import ProfilerActivity, profile
from torch.profiler._memory_profiler import Action
from transformers import AutoModelForCausalLM, GenerationConfig, Qwen3Config

from rollout import ContinuousBatchingConfig, RequestStatus
from rollout.engine.core import EngineCore

MiB = 2**20


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def long_model(attn: str = "sdpa"):
    """The tiny Qwen3 of `support.tiny_models` with an 8k context."""
    torch.manual_seed(0)
    cfg = Qwen3Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16, max_position_embeddings=8192, vocab_size=128,
                      initializer_range=0.3)
    return AutoModelForCausalLM.from_config(cfg, attn_implementation=attn).eval()


def peak_allocated(fn) -> tuple[int, int]:
    """(peak bytes live at once, largest single allocation) among the allocations `fn` makes."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True, with_stack=True) as prof:
        fn()
    created: dict = {}
    live = peak = largest = 0
    for _, action, key, size in prof._memory_profile().timeline:
        if action == Action.CREATE:
            created[key] = size
            live += size
            largest = max(largest, size)
        elif action == Action.DESTROY and key in created:  # NOTE: frees of older tensors don't count
            live -= created.pop(key)
        peak = max(peak, live)
    return peak, largest


def test_the_measure_sees_a_quadratic_buffer():
    model = long_model("eager")
    peaks = {}
    for n in (512, 1024):
        ids = torch.randint(1, 128, (1, n), generator=torch.Generator().manual_seed(n))
        with torch.no_grad():
            peaks[n], _ = peak_allocated(lambda ids=ids: model(ids, logits_to_keep=1))
    assert peaks[1024] > 3 * peaks[512], peaks


@pytest.mark.timeout(120)
def test_a_4096_token_default_step_allocates_linearly():
    model = long_model()
    greedy = GenerationConfig(do_sample=False, eos_token_id=None)
    peaks, largest, tokens = {}, {}, {}
    for n in (2048, 4096):
        core = EngineCore(model, greedy, ContinuousBatchingConfig())
        assert core.cache_stats()["max_batch_tokens"] >= 4096  # NOTE: the whole prompt is one step
        warm = core.make_request([5, 6, 7], request_id="warm", max_new_tokens=1)
        core.add(warm)
        core.step()  # NOTE: the KV pages are touched on the first step; they are not the step's buffers
        prompt = torch.randint(1, 128, (n,), generator=torch.Generator().manual_seed(n)).tolist()
        req = core.make_request(prompt, request_id="long", max_new_tokens=1)
        core.add(req)
        peaks[n], largest[n] = peak_allocated(core.step)
        assert req.status == RequestStatus.FINISHED, (req.status, req.error)
        with torch.no_grad():
            tokens[n] = int(model(torch.tensor([prompt]), logits_to_keep=1).logits[0, -1].argmax())
        assert req.generated == [tokens[n]]
    print(f"\npeak allocated in one prefill step: {peaks[2048] / MiB:.1f} MiB at 2048 tokens, "
          f"{peaks[4096] / MiB:.1f} MiB at 4096; largest allocation {largest[4096] / MiB:.2f} MiB")
    assert peaks[4096] <= 2.3 * peaks[2048], peaks
    one_head_scores = 4096 * 4096 * 4
    assert peaks[4096] < one_head_scores / 2 and largest[4096] < one_head_scores / 16, (peaks, largest)
