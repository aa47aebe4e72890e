"""rollout's decode-step CPU kernels beside attention: the small-M linear (`rollout/kernels/csrc/small_gemm.cpp`, routed
by `rollout.kernels.linear` up to `SMALL_ROWS` fp32 rows) and the one-call RMSNorm (`rollout/kernels/csrc/rms_norm.cpp`,
put on the
engine view by `rollout.fused_norm`)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from support.tiny_models import make_model

import rollout.kernels.fused_decoder as fused_decoder
import rollout.kernels.fused_layers as fused_layers
import rollout.kernels.linear as linear
from rollout.invariant import mode as batch_invariant
from rollout.kernels import cpu_kernels
from rollout.kernels.fused_attention import use_fused_attention
from rollout.model.engine_view import make_engine_view

small = cpu_kernels.small_linear()
rms = cpu_kernels.rms_norm()
needs_small = pytest.mark.skipif(
    small is None, reason="rollout's CPU kernels unavailable here (no compiler or AVX-512)"
)
needs_rms = pytest.mark.skipif(rms is None, reason="rollout's CPU kernels unavailable here (no compiler)")


@needs_small
@pytest.mark.parametrize("n,k", [(768, 64), (250, 67), (33, 16), (16, 1), (5, 40)])
def test_small_linear_matches_f_linear_across_tile_edges(n, k):
    g = torch.Generator().manual_seed(n + k)
    w, b = torch.randn(n, k, generator=g), torch.randn(n, generator=g)
    panels = cpu_kernels.pack_panels()(w)
    assert panels.shape == ((n + 15) // 16, k, 16)
    for m in (1, 2, 15, 16, 17, 28, 29, 31, 32, 33, 36, 43, 48):  # NOTE: above 16 rows, tiles of two panels
        x = torch.randn(m, k, generator=g)
        for bias in (None, b):
            got = small(x, panels, bias, n)
            assert got.shape == (m, n)
            torch.testing.assert_close(got, F.linear(x, w, bias), rtol=1e-5, atol=1e-4)
    # a non-contiguous x is read as its values
    xt = torch.randn(k, 7, generator=g).t()
    torch.testing.assert_close(small(xt, panels, b, n), F.linear(xt, w, b), rtol=1e-5, atol=1e-4)


@needs_small
def test_small_linear_rows_do_not_depend_on_the_batch_around_them():
    g = torch.Generator().manual_seed(3)
    w = torch.randn(100, 96, generator=g)
    panels = cpu_kernels.pack_panels()(w)
    x = torch.randn(45, 96, generator=g)
    for m in (13, 29, 45):  # NOTE: one 16-row pass; 2 and 4 tiles of two panels (100 columns: 7 panels, the last
        full = small(x[:m], panels, None, 100)  # one alone and partial)
        for i in (0, 12, 15, 16, 28, 44):  # NOTE: alone, in a 16-row tile, in the remainder tile, in a pair's tiles
            if i < m:
                assert torch.equal(small(x[i:i + 1], panels, None, 100)[0], full[i]), (m, i)


@needs_small
def test_small_linear_names_bad_inputs():
    w = torch.randn(32, 8)
    panels = cpu_kernels.pack_panels()(w)
    with pytest.raises(RuntimeError, match="panels must be pack_panels"):
        small(torch.randn(2, 9), panels, None, 32)
    with pytest.raises(RuntimeError, match="bias is"):
        small(torch.randn(2, 8), panels, torch.randn(31), 32)
    with pytest.raises(RuntimeError, match="fp32"):
        small(torch.randn(2, 8).double(), panels, None, 32)
    with pytest.raises(RuntimeError, match="2-D fp32"):
        cpu_kernels.pack_panels()(w.bfloat16())


@needs_small
@pytest.mark.skipif(not linear.onednn_available(), reason="torch has no oneDNN fp32 linear here")
def test_the_view_runs_decode_rows_on_panels_and_prompt_chunks_on_onednn(monkeypatch):
    monkeypatch.setattr(linear, "MIN_WEIGHT_ELEMENTS", 0)
    layer = torch.nn.Linear(64, 48)
    assert linear.use_onednn_linears(layer, min_elements=0) == 1
    with torch.inference_mode():
        for rows in (1, linear.SMALL_ROWS):
            x = torch.randn(1, rows, 64)
            torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-5)
        assert linear.routed_copies(layer).panels is not None and linear.routed_copies(layer).packed is None
        x = torch.randn(linear.SMALL_ROWS + 1, 64)
        torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-5)
        assert linear.routed_copies(layer).packed is not None
        layer.weight.mul_(2)  # NOTE: an in-place write: the panels are rebuilt at the next call
        x = torch.randn(3, 64)
        torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-5)
    assert linear.drop_packed(layer) == 2 and linear.routed_copies(layer).panels is None
    monkeypatch.setenv("ROLLOUT_SMALL_LINEARS", "0")
    off = torch.nn.Linear(64, 48)
    linear.use_onednn_linears(off, min_elements=0)
    with torch.inference_mode():
        off(torch.randn(2, 64))
    assert (
        linear.routed_copies(off).small is None
        and linear.routed_copies(off).panels is None
        and linear.routed_copies(off).packed is not None
    )


def test_llama_family_norms_are_recognised_by_their_forward_and_others_are_not():
    for arch in ("llama", "qwen3", "mistral", "phi3"):
        norms = [m for m in make_model(arch).modules() if type(m).__name__.endswith("RMSNorm")]
        assert norms and all(fused_layers.is_llama_rms_norm(m) for m in norms), arch
    gemma = [m for m in make_model("gemma2").modules() if type(m).__name__.endswith("RMSNorm")]
    assert gemma and not any(fused_layers.is_llama_rms_norm(m) for m in gemma)  # NOTE: (1 + weight)


@needs_rms
def test_fused_norms_and_mlps_match_the_class_forward_and_leave_the_users_model_alone():
    model = make_model("qwen3")
    for m in model.modules():
        if fused_layers.is_llama_rms_norm(m):
            m.weight.data.normal_()  # NOTE: not all ones, so the weight's product is checked
    view = make_engine_view(model)
    fused = [m for m in view.modules() if fused_layers.KERNEL_ATTR in vars(m)]
    stacks = [m for m in fused if fused_decoder.variant(m)]  # NOTE: the decoder layers and stack calling the others
    assert len(stacks) == model.config.num_hidden_layers + 1
    fused = [m for m in fused if m not in stacks]
    norms = [m for m in fused if fused_layers.is_llama_rms_norm(m)]
    mlps = [m for m in fused if fused_layers.is_silu_gated_mlp(m)]
    attention = [m for m in fused if type(m).__name__.endswith(("Attention", "RotaryEmbedding"))]
    assert norms and mlps and attention and len(fused) == len(norms) + len(mlps) + len(attention)
    assert len(norms) == sum(fused_layers.is_llama_rms_norm(m) for m in view.modules())
    assert not any("forward" in vars(m) for m in model.modules() if fused_layers.is_llama_rms_norm(m))
    norm, mlp = norms[0], mlps[0]
    for h in (1, 7, 8, 64, 100, 768, 1000, 2048, 4104):  # NOTE: every branch of ATen's cascaded sum
        w, x = torch.randn(h), torch.randn(3, h) * 3
        want = w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))
        assert torch.equal(cpu_kernels.rms_norm()(x, w, 1e-6), want), h  # NOTE: bit for bit
    x = torch.randn(2, 7, mlp.gate_proj.in_features)
    with torch.inference_mode():
        torch.testing.assert_close(mlp(x), type(mlp).forward(mlp, x), rtol=1e-5, atol=1e-5)
    for shape in ((3, norm.weight.numel()), (2, 5, 3, norm.weight.numel())):
        x = torch.randn(*shape) * 3
        with torch.inference_mode():
            torch.testing.assert_close(norm(x), type(norm).forward(norm, x), rtol=1e-5, atol=1e-5)
        xb = x.bfloat16()  # NOTE: other dtypes take the class forward: the same bits
        assert torch.equal(norm.bfloat16()(xb), type(norm).forward(norm, xb))
        norm.float()
    ids = torch.randint(1, 100, (1, 23))
    plain = copy.deepcopy(model)
    assert fused_layers.use_fused_layers(model) + use_fused_attention(model) == len(fused)
    with torch.inference_mode():
        torch.testing.assert_close(model(input_ids=ids).logits, plain(input_ids=ids).logits, rtol=1e-4, atol=1e-4)
    assert fused_layers.drop_fused_layers(model) == len(fused) and not any(
        "forward" in vars(m) for m in model.modules()
    )


@needs_rms
def test_batch_invariant_mode_and_the_switch_give_norms_their_class_forward(monkeypatch):
    view = make_engine_view(make_model("qwen3"))
    assert any(fused_layers.KERNEL_ATTR in vars(m) for m in view.modules())
    batch_invariant.install(view)
    assert not any(fused_layers.KERNEL_ATTR in vars(m) or ("forward" in vars(m) and fused_layers.is_llama_rms_norm(m))
                   for m in view.modules())
    monkeypatch.setenv("ROLLOUT_FUSED_LAYERS", "0")
    view = make_engine_view(make_model("qwen3"))
    assert not any(fused_layers.KERNEL_ATTR in vars(m) for m in view.modules())
    assert fused_layers.use_fused_layers(view) == 0 and use_fused_attention(view) == 0


@needs_rms
def test_silu_mul_matches_torch_over_the_whole_float_range():
    g = torch.cat([torch.linspace(-120, 120, 4001), torch.tensor([0.0, -0.0, 1e-30, -1e-30, 88.5, -88.5, 1e4, -1e4])])
    up = torch.randn(g.numel(), generator=torch.Generator().manual_seed(0))
    got = cpu_kernels.silu_mul()(g, up)
    torch.testing.assert_close(got, F.silu(g) * up, rtol=2e-6, atol=1e-30)
    big = torch.randn(3, 70000)  # NOTE: above the one-thread size: split across the team
    torch.testing.assert_close(
        cpu_kernels.silu_mul()(big, big.flip(0)), F.silu(big) * big.flip(0), rtol=2e-6, atol=1e-6
    )
    with pytest.raises(RuntimeError, match="same shape"):
        cpu_kernels.silu_mul()(g, up[:-1])


def test_gemma_and_phi3_mlps_keep_their_forward():
    assert not any(fused_layers.is_silu_gated_mlp(m) for m in make_model("gemma2").modules())  # NOTE: GELU
    assert not any(fused_layers.is_silu_gated_mlp(m) for m in make_model("phi3").modules())  # NOTE: gate_up_proj
    assert any(fused_layers.is_silu_gated_mlp(m) for m in make_model("llama").modules())


def test_models_off_the_cpu_never_build_the_kernels(monkeypatch):
    """A view with no CPU weights (here on the meta device, as on a GPU) routes nothing and builds nothing."""
    def refuse():
        raise AssertionError("the CPU kernels were requested for a model with no CPU weights")

    for name in ("small_linear", "small_linears", "rms_norm", "silu_mul", "qk_norm_rope"):
        monkeypatch.setattr(cpu_kernels, name, refuse)
    with torch.device("meta"):
        model = make_model("qwen3")
    assert fused_layers.use_fused_layers(model) == 0 and use_fused_attention(model) == 0
    assert linear.use_onednn_linears(model, min_elements=0) == 0
