"""Batch-invariant mode on the GPU path: `rollout.kernels.triton_invariant` (linears, RMSNorm) and the Triton
per-row attention, chosen on CUDA, and on a CPU with `attn_backend='triton'` (under Triton's interpreter here).

Oracles: a request run alone (bit for bit, in batches of other compositions, chunk boundaries and neighbours'
lengths), the engine's own logprobs (the trainer's `InvariantForward` on the same kernels must give the same
bits), torch's linear / RMSNorm (close, not equal), and call counts (the Triton kernels did the work). On a CUDA
machine the same tests run the compiled kernels (`benchmarks/device_check.sh` runs `-m triton`). Skipped without
triton.
"""

from __future__ import annotations

import random

import pytest
import torch
from support.tiny_models import VOCAB, make_model, random_prompts
from support.triton_interpreter import device, load, ordered_dots
from transformers import GenerationConfig

from rollout import ContinuousBatchingConfig, RolloutEngine
from rollout.engine.core import EngineCore
from rollout.invariant.forward import InvariantForward
from rollout.invariant.mode import install
from rollout.invariant.ops import reference_rms_norm
from trainers.common import completion_forward, disable_dropout, scored_logprobs

pytestmark = [pytest.mark.triton, pytest.mark.timeout(240)]
GC = GenerationConfig(do_sample=True, eos_token_id=None, max_new_tokens=4)
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


@pytest.fixture(scope="module")
def kernels():
    load("rollout.kernels.triton_decode")
    module = load("rollout.kernels.triton_invariant")
    undo = ordered_dots()  # NOTE: the interpreter's dot summed in the kernel's order, not by numpy's BLAS
    yield module
    undo()


@pytest.fixture
def counted(kernels, monkeypatch):
    """Calls of the three Triton entry points the mode's ops reach, by name."""
    import rollout.kernels.triton_decode as decode

    calls = {"linear": 0, "rms_norm": 0, "attention": 0}
    for module, name, key in ((kernels, "linear", "linear"), (kernels, "rms_norm", "rms_norm"),
                              (decode, "paged_decode_attention", "attention")):
        fn = getattr(module, name)

        def wrapped(*args, _fn=fn, _key=key, **kwargs):
            calls[_key] += 1
            return _fn(*args, **kwargs)

        monkeypatch.setattr(module, name, wrapped)
    return calls


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_a_rows_linear_and_norm_bits_do_not_depend_on_the_other_rows(kernels, dtype):
    dt, dev = DTYPES[dtype], device()
    g = torch.Generator().manual_seed(0)
    for k, n in ((64, 128), (80, 96), (128, 200)):
        w = torch.randn(n, k, generator=g).to(dt).to(dev)
        b = torch.randn(n, generator=g).to(dt).to(dev)
        row = torch.randn(1, k, generator=g).to(dt).to(dev)
        ref = kernels.linear(row, w, b)[0]
        close = torch.nn.functional.linear(row.float(), w.float(), b.float())[0]
        torch.testing.assert_close(ref.float(), close, rtol=1e-2 if dt == torch.bfloat16 else 1e-5, atol=1e-4)
        norm_w = torch.randn(k, generator=g).to(dt).to(dev)
        refs = [kernels.rms_norm(row, norm_w, 1e-6, offset)[0] for offset in (False, True)]
        for offset, r in zip((False, True), refs, strict=True):
            want = reference_rms_norm(row, norm_w, 1e-6, offset)[0]
            torch.testing.assert_close(r.float(), want.float(), rtol=2e-2 if dt == torch.bfloat16 else 1e-5,
                                       atol=1e-5)
        for m in (2, 5, 33, 70):
            x = torch.randn(m, k, generator=g).to(dt).to(dev)
            at = (7 * m) // 9
            x[at] = row[0]
            assert torch.equal(kernels.linear(x, w, b)[at], ref), (k, n, m)
            for offset, r in zip((False, True), refs, strict=True):
                assert torch.equal(kernels.rms_norm(x, norm_w, 1e-6, offset)[at], r), (k, m, offset)


def _run(model, specs, **config):
    core = EngineCore(model, GC, ContinuousBatchingConfig(page_size=8, return_logprobs=True, attn_backend="triton",
                                                          batch_invariant=True, **config))
    reqs = []
    for i, (prompt, temperature, seed, n) in enumerate(specs):
        reqs.append(core.make_request(prompt, request_id=f"r{i}", temperature=temperature, seed=seed,
                                      max_new_tokens=n))
        core.add(reqs[-1])
    while core.has_work():
        core.step()
    return [r.to_output() for r in reqs], core.cache_stats()


@pytest.mark.parametrize("arch,dtype", [("qwen3", "fp32"), ("mistral", "bf16")])
def test_a_request_is_bitwise_the_same_alone_and_in_a_mixed_batch(counted, arch, dtype):
    """The target alone, then in a batch of other prompts (other lengths, greedy and sampled neighbours), a small
    token budget (other chunk boundaries, its decode rows beside prompt chunks) and a warm prefix cache; Qwen3's
    q / k norms, Mistral's sliding window in bf16."""
    model = make_model(arch, dtype=DTYPES[dtype]).to(device())
    rng = random.Random(0)
    prefix = [rng.randrange(1, VOCAB) for _ in range(17)]
    target = (prefix + [5, 6, 7], 1.0, 1234, 4)
    alone, _ = _run(model, [target], num_blocks=48, max_batch_tokens=128)
    assert min(counted.values()) > 0, f"the Triton kernels should have run: {counted}"
    others = [([rng.randrange(1, VOCAB) for _ in range(n)], t, rng.randrange(1000), 3)
              for n, t in ((5, 0.0), (19, 1.0), (11, 1.0))]
    sharer = (prefix + [rng.randrange(1, VOCAB)], 1.0, 7, 2)
    mixed, stats = _run(model, [sharer, others[0], target, *others[1:]], num_blocks=48, max_batch_tokens=16)
    assert stats["cached_prompt_tokens"] > 0
    assert len(alone[0].generated_tokens) == 4
    assert mixed[2].generated_tokens == alone[0].generated_tokens
    assert mixed[2].logprobs == alone[0].logprobs  # NOTE: float ==, bit for bit


@pytest.mark.parametrize("arch,dtype", [("qwen3", "fp32"), ("llama", "bf16")])
def test_trainer_logprobs_are_the_engine_logprobs_bit_for_bit(counted, arch, dtype):
    """The trainer's `InvariantForward` on the Triton kernels (padded [N, L] rows) gives the engine's bits."""
    model = make_model(arch).to(device())
    disable_dropout(model)
    dt = DTYPES[dtype]
    engine_model = model if dt == torch.float32 else make_model(arch).to(dt).to(device())
    cbc = ContinuousBatchingConfig(page_size=8, num_blocks=64, max_batch_tokens=24, return_logprobs=True,
                                   batch_invariant=True, attn_backend="triton")
    with RolloutEngine(engine_model, config=cbc) as engine:
        batch = engine.generate(random_prompts(2, 4, 16, seed=1), temps=[1.0, 0.0], group_size=2,
                                max_new_tokens=4, seed=3)
    before = dict(counted)
    data = {
        "input_ids": batch.input_ids.masked_fill(batch.attention_mask == 0, 0),
        "attention_mask": batch.attention_mask,
        "completion_ids": batch.completion_ids.masked_fill(batch.completion_mask == 0, 0),
        "temperatures": batch.temperatures,
    }
    model.train()
    invariant = InvariantForward(model, page_size=8, dtype=None if dt == torch.float32 else dt, kernels="triton")
    logprobs, _ = scored_logprobs(completion_forward(invariant, data).logits, data)
    assert all(counted[k] > before[k] for k in counted), f"the trainer pass should run the Triton kernels: {counted}"
    mask = batch.completion_mask.bool()
    assert mask.sum() > 6
    assert torch.equal(logprobs[mask], batch.logprobs[mask])
    with torch.no_grad():  # NOTE: the control: the model's own forward is close, not equal
        plain, _ = scored_logprobs(completion_forward(model, data).logits, data)
    assert not torch.equal(plain[mask], batch.logprobs[mask])
    if dt == torch.float32:  # NOTE: (the bf16 engine is a cast copy of the fp32 model: further off)
        torch.testing.assert_close(plain[mask], batch.logprobs[mask], atol=1e-4, rtol=0)


def test_the_cpu_default_and_cpu_mode_do_not_take_the_triton_path(counted):
    """On a CPU without attn_backend='triton' the mode runs its C++ kernels (the Triton ones stay unused)."""
    model = make_model("qwen3")
    core = EngineCore(model, GC, ContinuousBatchingConfig(page_size=8, num_blocks=16, batch_invariant=True))
    assert core.backend.kernels == "cpu"
    req = core.make_request(random_prompts(1, 9, 9, seed=2)[0], request_id="a", max_new_tokens=2)
    core.add(req)
    while core.has_work():
        core.step()
    assert counted == {"linear": 0, "rms_norm": 0, "attention": 0}


def test_a_layernorm_model_is_refused_on_the_triton_path(kernels):
    with pytest.raises(ValueError, match="batch_invariant: LayerNorm has no Triton kernel yet"):
        install(make_model("gpt2"), "triton")
    with pytest.raises(ValueError, match="batch_invariant: kernels must be one of"):
        install(make_model("qwen3"), "cuda")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_cuda_a_row_is_bitwise_the_same_alone_and_in_a_48_row_bf16_batch():
    """On CUDA the mode takes the Triton kernels by itself (attn_backend 'auto'): a Qwen3-shaped bf16 model
    (hidden 1024, head size 128, GQA 16/8), request 0 alone and among 47 others (prompts 20-300 tokens) gives the
    same greedy tokens and logprobs bit for bit; the control (the triton backend without the mode, cuBLAS GEMMs)
    gives request 0 other logprob bits in the batch; and the trainer's `InvariantForward` pass (Triton kernels,
    by the model's device) gives a sampled batch's logprobs bit for bit at this vocabulary."""
    from transformers import AutoModelForCausalLM, Qwen3Config

    torch.manual_seed(0)
    config = Qwen3Config(hidden_size=1024, intermediate_size=3072, num_hidden_layers=4, num_attention_heads=16,
                         num_key_value_heads=8, head_dim=128, vocab_size=32000, max_position_embeddings=4096)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).cuda().eval()
    rng = random.Random(1)
    prompts = [[rng.randrange(1, 32000) for _ in range(rng.randrange(20, 300))] for _ in range(48)]

    def run(batch: list, **fields):
        core = EngineCore(model, GenerationConfig(do_sample=False, eos_token_id=None),
                          ContinuousBatchingConfig(return_logprobs=True, **fields))
        reqs = [core.make_request(p, request_id=f"r{i}", max_new_tokens=24) for i, p in enumerate(batch)]
        for r in reqs:
            core.add(r)
        while core.has_work():
            core.step()
        return core, reqs[0].to_output()

    core, alone = run(prompts[:1], batch_invariant=True)
    assert core.backend.kernels == "triton"
    _, mixed = run(prompts, batch_invariant=True)
    assert mixed.generated_tokens == alone.generated_tokens and mixed.logprobs == alone.logprobs
    _, plain_alone = run(prompts[:1], attn_backend="triton")
    _, plain_mixed = run(prompts, attn_backend="triton")
    assert plain_mixed.logprobs != plain_alone.logprobs, "the control should depend on the batch"
    # NOTE: the trainer's pass at a real vocabulary (32,000: torch's CUDA log-softmax takes its large-row kernels)
    cbc = ContinuousBatchingConfig(return_logprobs=True, batch_invariant=True)
    with RolloutEngine(model, config=cbc) as engine:
        batch = engine.generate(prompts[:8], temps=[1.0, 0.0, 0.7, 1.0], group_size=2, max_new_tokens=16, seed=5)
    data = {"input_ids": batch.input_ids.masked_fill(batch.attention_mask == 0, 0),
            "attention_mask": batch.attention_mask,
            "completion_ids": batch.completion_ids.masked_fill(batch.completion_mask == 0, 0),
            "temperatures": batch.temperatures}
    data = {k: v.cuda() for k, v in data.items()}
    invariant = InvariantForward(model, page_size=cbc.page_size)
    assert invariant.kernels == "triton"
    with torch.no_grad():
        logprobs, _ = scored_logprobs(completion_forward(invariant, data).logits, data)
    mask = batch.completion_mask.bool().cuda()
    assert torch.equal(logprobs[mask], batch.logprobs.cuda()[mask])
