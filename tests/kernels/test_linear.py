"""The engine view's fp32 linears through oneDNN (`rollout.kernels.linear`): same results, same greedy tokens.

Tiny test models have no layer above `MIN_WEIGHT_ELEMENTS`, so the default path keeps torch's linear
here; these tests force every linear through oneDNN (threshold 0) and compare with the user's model.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from support.greedy import GREEDY_GC, MAX_NEW, PROMPTS, reference, run_engine
from support.tiny_models import hf_greedy, make_model, random_prompts
from transformers import GenerationConfig

import rollout.kernels.linear as linear
from rollout import ContinuousBatchingConfig, RolloutEngine
from rollout.engine.core import EngineCore
from rollout.model.engine_view import make_engine_view

pytestmark = pytest.mark.skipif(not linear.onednn_available(), reason="torch has no oneDNN fp32 linear here")


def routed(view: torch.nn.Module) -> list[str]:
    return [name for name, m in view.named_modules() if "forward" in vars(m) and isinstance(m, torch.nn.Linear)]


def test_routed_linears_match_torch_and_leave_the_users_model_alone():
    model = make_model("qwen3")
    view = make_engine_view(model)
    n = linear.use_onednn_linears(view, min_elements=0)
    linears = [name for name, m in view.named_modules() if type(m) is torch.nn.Linear]
    assert n == len(linears) > 0 and sorted(routed(view)) == sorted(linears)
    assert routed(model) == []  # the user's modules keep their class forward
    other = copy.deepcopy(model)  # NOTE: the view runs paged attention only inside the engine; this keeps sdpa
    assert linear.use_onednn_linears(other, min_elements=0) == n
    ids = torch.randint(1, 100, (1, 37))
    with torch.inference_mode():
        ours = other(input_ids=ids, use_cache=False).logits
        ref = model(input_ids=ids, use_cache=False).logits
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-5)
    # one layer on its own, with a bias: fp32, then the same module cast to bf16 (repacked), then fp16
    # (not routed: falls back to torch's linear)
    layer = torch.nn.Linear(64, 48)
    linear.use_onednn_linears(layer, min_elements=0)
    x = torch.randn(3, 5, 64)
    with torch.inference_mode():
        torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-5)
        xb = x.bfloat16()
        torch.testing.assert_close(layer.bfloat16()(xb), F.linear(xb, layer.weight, layer.bias), rtol=1e-2, atol=1e-2)
        if torch.bfloat16 in linear.onednn_dtypes():  # NOTE: CPUs without oneDNN's bf16 path keep torch's linear
            assert linear.routed_copies(layer).packed.dtype == torch.bfloat16
        with torch.autocast("cpu", dtype=torch.bfloat16):  # NOTE: autocast keeps torch's linear: same dtype out
            assert layer.float()(x).dtype == F.linear(x, layer.weight, layer.bias).dtype == torch.bfloat16
        xh = x.half()
        assert torch.equal(layer.half()(xh), F.linear(xh, layer.weight, layer.bias))


def test_only_large_plain_fp32_linears_are_routed():
    model = make_model("qwen3")
    view = make_engine_view(model)
    head = view.lm_head
    assert head.weight.numel() < linear.MIN_WEIGHT_ELEMENTS  # tiny models stay on torch's linear by default
    assert routed(view) == []
    wrapped = view.model.layers[0].mlp.up_proj
    wrapped.forward = wrapped.forward  # an instance forward (as accelerate's hooks set) is left alone
    linear.use_onednn_linears(view, min_elements=0)
    assert wrapped.forward.__func__ is torch.nn.Linear.forward
    assert linear.use_onednn_linears(make_engine_view(make_model("qwen3", dtype=torch.float16)), min_elements=0) == 0

    class Adapter(torch.nn.Linear):
        pass

    holder = torch.nn.Sequential(Adapter(64, 64), torch.nn.Linear(64, 64))
    assert linear.use_onednn_linears(holder, min_elements=0) == 1 and routed(holder) == ["1"]


@pytest.mark.parametrize("arch", ["llama", "qwen3", "mistral", "gemma2", "phi3"])
def test_greedy_through_onednn_linears_matches_hf_generate(arch, monkeypatch):
    model, expected = reference(arch)
    monkeypatch.setattr(linear, "MIN_WEIGHT_ELEMENTS", 0)
    cbc = ContinuousBatchingConfig(page_size=16, max_batch_tokens=48, num_blocks=128)
    core = EngineCore(model, GREEDY_GC, cbc)
    assert routed(core.view)  # every linear of the view runs through oneDNN
    reqs, _, _ = run_engine(core, PROMPTS)
    for i, (req, exp) in enumerate(zip(reqs, expected, strict=True)):
        assert req.generated == exp, f"{arch}: prompt {i} differs from generate"
        assert len(req.generated) == MAX_NEW


def test_update_weights_drops_packed_copies_even_for_writes_through_data(monkeypatch):
    monkeypatch.setattr(linear, "MIN_WEIGHT_ELEMENTS", 0)
    gc = GenerationConfig(do_sample=False, eos_token_id=None, max_new_tokens=6)
    prompts = random_prompts(3, 40, 60, seed=6)  # NOTE: a prefill step above SMALL_ROWS: oneDNN packs
    model, other = make_model("qwen3", seed=0), make_model("qwen3", seed=1)
    with RolloutEngine(
        model, config=ContinuousBatchingConfig(page_size=16, num_blocks=64), generation_config=gc
    ) as eng:
        assert eng.generate(prompts, temps=0.0).completion_ids.tolist() == [hf_greedy(model, p, 6) for p in prompts]
        for p, q in zip(model.parameters(), other.parameters(), strict=True):
            p.data.copy_(q.data)  # NOTE: no version bump: only update_weights tells the engine
        eng.update_weights(model)
        assert eng.generate(prompts, temps=0.0).completion_ids.tolist() == [hf_greedy(other, p, 6) for p in prompts]
        view = eng.manager.core.view
        assert any(getattr(m, "_rollout_packed", None) is not None for m in view.modules())
        eng.sleep()  # NOTE: the packed copies go with the KV cache, and come back at the next step
        assert all(getattr(m, "_rollout_packed", None) is None for m in view.modules())
        eng.wake()
        assert eng.generate(prompts, temps=0.0).completion_ids.tolist() == [hf_greedy(other, p, 6) for p in prompts]


def test_bf16_views_with_and_without_onednn_give_the_same_logits(monkeypatch):
    if torch.bfloat16 not in linear.onednn_dtypes():
        bf16 = make_model("qwen3", dtype=torch.bfloat16)
        assert linear.use_onednn_linears(bf16, min_elements=0) == 0  # NOTE: nothing routed, nothing raises
        pytest.skip("this CPU lacks oneDNN's bf16 path (AVX512-BF16 / AVX-NE-CONVERT or AVX512BW+VL+DQ)")
    model = make_model("qwen3", dtype=torch.bfloat16)
    plain, routed_copy = copy.deepcopy(model), copy.deepcopy(model)
    assert linear.use_onednn_linears(routed_copy, min_elements=0) > 0
    ids = torch.randint(1, 100, (1, 41))
    with torch.inference_mode():
        a = plain(input_ids=ids, use_cache=False).logits
        b = routed_copy(input_ids=ids, use_cache=False).logits
    torch.testing.assert_close(b, a, rtol=2e-2, atol=2e-2)
    assert torch.equal(a.argmax(-1), b.argmax(-1))


def test_the_environment_switch_turns_the_routing_off(monkeypatch):
    monkeypatch.setenv("ROLLOUT_ONEDNN_LINEARS", "0")
    assert linear.use_onednn_linears(make_engine_view(make_model("qwen3")), min_elements=0) == 0
    monkeypatch.setenv("ROLLOUT_ONEDNN_LINEARS", "1")
    assert linear.use_onednn_linears(make_engine_view(make_model("qwen3")), min_elements=0) > 0


def test_smaller_fp32_linears_run_decode_rows_on_the_small_m_kernel_only(monkeypatch):
    """A weight from `SMALL_WEIGHT_ELEMENTS` up to `MIN_WEIGHT_ELEMENTS` (a 5M model's q / k / v / o): the small-M
    kernel up to `SMALL_ROWS` rows, torch's own linear above, never a packed oneDNN copy; bf16, a weight below the
    range and `ROLLOUT_SMALL_LINEARS=0` stay on torch's linear."""
    from rollout.kernels import cpu_kernels

    kernel, pack = cpu_kernels.small_linear(), cpu_kernels.pack_panels()
    if kernel is None:
        pytest.skip("rollout's small-M kernel is unavailable here (no AVX-512 or no build)")
    torch.manual_seed(0)
    holder = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Linear(256, 64), torch.nn.Linear(1024, 256))
    small, tiny, large = holder
    assert tiny.weight.numel() < linear.SMALL_WEIGHT_ELEMENTS <= small.weight.numel() < linear.MIN_WEIGHT_ELEMENTS
    assert large.weight.numel() >= linear.MIN_WEIGHT_ELEMENTS
    assert linear.use_onednn_linears(holder) == 2 and routed(holder) == ["0", "2"]
    assert linear.onednn_routed(holder) == 1 and linear.small_only(small) and not linear.small_only(large)
    assert linear.small_rows(holder) == linear.SMALL_ROWS and linear.small_rows(torch.nn.Linear(8, 8)) is None
    with torch.inference_mode():
        for rows in (1, 4, 36, linear.SMALL_ROWS):
            x = torch.randn(rows, 256)
            assert torch.equal(small(x), kernel(x, pack(small.weight), small.bias, 256)), rows
        x = torch.randn(2, linear.SMALL_ROWS + 1, 256)  # NOTE: a prompt chunk: torch's linear, bit for bit
        assert torch.equal(small(x), F.linear(x, small.weight, small.bias))
        assert linear.routed_copies(small).packed is None and linear.routed_copies(small).panels is not None
        xb = x.bfloat16()  # NOTE: cast later: torch's linear
        assert torch.equal(small.bfloat16()(xb), F.linear(xb, small.weight, small.bias))
    assert linear.use_onednn_linears(torch.nn.Linear(256, 256).bfloat16()) == 0
    monkeypatch.setenv("ROLLOUT_SMALL_LINEARS", "0")
    assert linear.use_onednn_linears(torch.nn.Linear(256, 256)) == 0
