"""The engine view's fused Llama-family attention and rotary embedding (`rollout.kernels.fused_attention`), their
kernels (`qk_norm_rope` in rollout/kernels/csrc/rms_norm.cpp, `small_linears` in small_gemm.cpp) and the gate / up
projections in
one call: each the class forward's bits, and only where the class forward is one the module was written against."""

from __future__ import annotations

import copy

import pytest
import torch
from support.tiny_models import make_model
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb
from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

import rollout.kernels.fused_attention as fused_attention
import rollout.kernels.fused_layers as fused_layers
from rollout.kernels import cpu_kernels
from rollout.model.engine_view import make_engine_view

rope = cpu_kernels.qk_norm_rope()
many = cpu_kernels.small_linears()
needs_rope = pytest.mark.skipif(rope is None, reason="rollout's CPU kernels unavailable here (no compiler)")
needs_many = pytest.mark.skipif(many is None, reason="rollout's CPU kernels unavailable here (no compiler or AVX-512)")


def _cos_sin(positions: torch.Tensor, d: int):
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
    freqs = positions[..., None].float() * inv
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


@needs_rope
@pytest.mark.parametrize("t,h,hk,d", [(1, 4, 2, 64), (16, 12, 4, 64), (5, 3, 3, 128), (37, 2, 1, 32), (3, 1, 1, 6)])
@pytest.mark.parametrize("normed", [True, False])
def test_qk_norm_rope_is_rmsnorm_then_apply_rotary_pos_emb_bit_for_bit(t, h, hk, d, normed):
    g = torch.Generator().manual_seed(t * 100 + d)
    q, k = torch.randn(t, h * d, generator=g) * 3, torch.randn(t, hk * d, generator=g)
    cos, sin = _cos_sin(torch.arange(t)[None] * 7 + 11, d)
    qn, kn = Qwen3RMSNorm(d, eps=1e-6), Qwen3RMSNorm(d, eps=1e-5)
    with torch.no_grad():
        qn.weight.normal_(generator=g)
        kn.weight.normal_(generator=g)
        want_q, want_k = q.view(1, t, h, d), k.view(1, t, hk, d)
        if normed:
            want_q, want_k = qn(want_q), kn(want_k)
        want_q, want_k = apply_rotary_pos_emb(want_q.transpose(1, 2), want_k.transpose(1, 2), cos, sin)
        got_q, got_k = rope(q, k, qn.weight if normed else None, kn.weight if normed else None, 1e-6, 1e-5,
                            cos[0], sin[0], d)
    assert got_q.shape == (t, h, d) and got_k.shape == (t, hk, d)
    assert torch.equal(got_q.view(1, t, h, d).transpose(1, 2), want_q)
    assert torch.equal(got_k.view(1, t, hk, d).transpose(1, 2), want_k)


@needs_rope
def test_qk_norm_rope_names_bad_inputs():
    q, k, cs = torch.randn(2, 64), torch.randn(2, 64), torch.randn(2, 64)
    with pytest.raises(RuntimeError, match="even"):
        rope(torch.randn(2, 63), torch.randn(2, 63), None, None, 0.0, 0.0, torch.randn(2, 63), torch.randn(2, 63), 63)
    with pytest.raises(RuntimeError, match=r"cos and sin \[rows, D\]"):
        rope(q, k, None, None, 0.0, 0.0, cs[:1], cs[:1], 64)
    with pytest.raises(RuntimeError, match="norm weights"):
        rope(q, k, torch.ones(32), None, 1e-6, 0.0, cs, cs, 64)
    with pytest.raises(RuntimeError, match="fp32"):
        rope(q.double(), k, None, None, 0.0, 0.0, cs, cs, 64)


@needs_many
def test_small_linears_are_each_small_linear_bit_for_bit_across_weights_and_bias():
    g = torch.Generator().manual_seed(0)
    ws = [torch.randn(n, 96, generator=g) for n in (96, 33, 16, 250)]
    bs = [None, torch.randn(33, generator=g), None, torch.randn(250, generator=g)]
    panels = [cpu_kernels.pack_panels()(w) for w in ws]
    for m in (11, 36):  # NOTE: panels one by one; pairs of panels (33 columns: a pair and a partial panel alone)
        x = torch.randn(m, 96, generator=g)
        ys = many(x, panels, bs, [w.shape[0] for w in ws])
        for y, p, b, w in zip(ys, panels, bs, ws, strict=True):
            assert torch.equal(y, cpu_kernels.small_linear()(x, p, b, w.shape[0]))
            torch.testing.assert_close(y, torch.nn.functional.linear(x, w, b), rtol=1e-5, atol=1e-4)
    with pytest.raises(RuntimeError, match=r"panels\[1\]"):
        many(x, [panels[0], panels[0]], [None, None], [96, 33])


def test_the_three_llama_family_forwards_are_recognised_and_others_are_not():
    want = {"llama": "llama", "qwen3": "qwen3", "mistral": "mistral", "qwen3_moe": "qwen3", "mixtral": "mistral"}
    for arch, variant in want.items():
        model = make_model(arch)
        attns = [m for m in model.modules() if type(m).__name__.endswith("Attention")]
        assert attns and all(fused_attention.attention_variant(m) == variant for m in attns), arch
        assert any(fused_attention.is_static_rotary(m) for m in model.modules()), arch
    for arch in ("gemma2", "phi3", "gpt2", "gpt_neox"):  # NOTE: softcaps, fused qkv, other layouts: class forwards
        assert not any(fused_attention.attention_variant(m) for m in make_model(arch).modules()), arch


def test_a_source_not_checked_against_is_not_fused(monkeypatch):
    model = make_model("qwen3")
    fused_attention.references.cache_clear()
    monkeypatch.setitem(fused_attention.KNOWN_SOURCES, "qwen3", set())
    monkeypatch.setitem(fused_attention.KNOWN_SOURCES, "rotary", set())
    try:
        assert not any(fused_attention.attention_variant(m) or fused_attention.is_static_rotary(m)
                       for m in model.modules())
    finally:
        monkeypatch.undo()
        fused_attention.references.cache_clear()
    assert any(fused_attention.attention_variant(m) for m in model.modules())


@needs_rope
@pytest.mark.parametrize("arch", ["llama", "qwen3", "mistral"])
def test_fused_attention_and_rotary_give_the_class_forwards_bits(arch):
    """On the user's plain model (torch's linears) the fused forwards must change nothing: every logit equal, and the
    attention function called with the same arguments (Mistral's sliding window, 24, over 40 tokens)."""
    seen = {"plain": [], "fused": []}

    def recording(name):
        def attend(module, q, k, v, mask, **kwargs):
            seen[name].append((module.layer_idx, q.shape, q.stride(), k.stride(), v.stride(),
                               sorted((key, val) for key, val in kwargs.items() if not isinstance(val, torch.Tensor))))
            return sdpa_attention_forward(module, q, k, v, mask, **kwargs)
        return attend

    AttentionInterface.register("record_plain", recording("plain"))
    AttentionInterface.register("record_fused", recording("fused"))
    model = make_model(arch)
    for m in model.modules():
        if fused_layers.is_llama_rms_norm(m):
            m.weight.data.normal_()
    plain = copy.deepcopy(model)
    plain.set_attn_implementation("record_plain")
    model.set_attn_implementation("record_fused")
    n = fused_attention.use_fused_attention(model)
    assert n == model.config.num_hidden_layers + 1, (arch, n)  # NOTE: every attention and the one rotary embedding
    calls = []
    for m in model.modules():
        if fused_attention.attention_variant(m):
            kernel = m._rollout_fused
            m._rollout_fused = lambda *a, kernel=kernel: calls.append(1) or kernel(*a)
    ids = torch.randint(1, model.config.vocab_size, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        assert torch.equal(model(input_ids=ids, use_cache=False).logits, plain(input_ids=ids, use_cache=False).logits)
        assert torch.equal(model(input_ids=ids[:1, :7], use_cache=False).logits,
                           plain(input_ids=ids[:1, :7], use_cache=False).logits)
    assert len(calls) == 2 * model.config.num_hidden_layers  # NOTE: the fused path ran in every layer
    assert seen["fused"] == seen["plain"] and len(seen["plain"]) == 2 * model.config.num_hidden_layers
    with torch.no_grad():  # NOTE: bf16 takes the class forward of the attention, a bf16 table of the rotary
        assert torch.equal(model.bfloat16()(input_ids=ids, use_cache=False).logits,
                           plain.bfloat16()(input_ids=ids, use_cache=False).logits)
    assert len(calls) == 2 * model.config.num_hidden_layers
    assert fused_layers.drop_fused_layers(model) == n and not any("forward" in vars(m) for m in model.modules())


def test_the_rotary_table_grows_with_positions_and_follows_inv_freq():
    model = make_model("qwen3")
    rotary = model.model.rotary_emb
    assert fused_attention.use_fused_attention(copy.deepcopy(model)) > 0
    fused = copy.deepcopy(rotary)
    fused.inv_freq = rotary.inv_freq  # NOTE: shared, as the engine view shares the model's buffers
    assert fused_attention.use_fused_attention(fused) == 1
    x = torch.randn(1, 3, 8)
    for positions in ([0, 1, 2], [5, 300, 7], [4000, 2, 4100]):  # NOTE: past the first table (256) and its double
        ids = torch.tensor([positions])
        for got, want in zip(fused(x, ids), rotary(x, ids), strict=True):
            assert torch.equal(got, want), positions
    assert fused_attention.rotary_table_size(fused) >= 4101
    with torch.no_grad():
        rotary.inv_freq.mul_(0.5)  # NOTE: changed in place: the table is rebuilt
    ids = torch.tensor([[3, 9, 1]])
    for got, want in zip(fused(x, ids), rotary(x, ids), strict=True):
        assert torch.equal(got, want)


@needs_rope
def test_the_engine_view_fuses_attention_and_keeps_the_users_model_alone():
    model = make_model("qwen3")
    view = make_engine_view(model)
    kinds = {type(m).__name__ for m in view.modules() if fused_layers.KERNEL_ATTR in vars(m)}
    assert {"Qwen3Attention", "Qwen3RotaryEmbedding", "Qwen3RMSNorm", "Qwen3MLP"} <= kinds
    assert not any("forward" in vars(m) for m in model.modules())


@needs_many
def test_linears_is_one_small_call_where_each_module_would_run_small_and_each_modules_own_call_elsewhere(monkeypatch):
    import rollout.kernels.linear as linear

    view = make_engine_view(make_model("qwen3"))
    assert linear.use_onednn_linears(view, min_elements=0) > 0  # NOTE: the tiny model's weights, routed
    attn = next(m for m in view.modules() if fused_attention.attention_variant(m))
    mods = (attn.q_proj, attn.k_proj, attn.v_proj)
    calls = []
    kernel = cpu_kernels.small_linears()
    monkeypatch.setattr(cpu_kernels, "small_linears", lambda: lambda *a: calls.append(1) or kernel(*a))
    with torch.inference_mode():
        for rows in (1, 5, linear.SMALL_ROWS, linear.SMALL_ROWS + 1, 100):
            x = torch.randn(1, rows, attn.q_proj.in_features)
            n = len(calls)
            got, want = linear.linears(x, mods), [m(x) for m in mods]
            assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True)), rows
            assert len(calls) - n == (1 if rows <= linear.SMALL_ROWS else 0), rows
        hook = attn.k_proj.register_forward_hook(lambda *a: None)  # NOTE: a hooked module runs its own call
        n = len(calls)
        linear.linears(torch.randn(1, 2, attn.q_proj.in_features), mods)
        assert len(calls) == n
        hook.remove()
