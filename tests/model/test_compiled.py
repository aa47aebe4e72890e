"""`default_compile_level >= 1` on a CPU: the engine forward as one compiled graph (`rollout.model.compiled`).

Greedy outputs equal `model.generate` with the forward compiled (chunked prefill, prefix-cache hits,
one-token steps), the graph has no break, later steps of other sizes compile nothing more, and an
in-place weight update reaches the compiled forward (the packed oneDNN copies are refreshed outside the
graph). Each engine compiles its forward once (~5-10 s here).
"""

from __future__ import annotations

import pytest
import torch
from support.greedy import BUDGET, GREEDY_GC, MAX_NEW, PROMPTS, PS, reference, run_engine
from support.tiny_models import hf_greedy

import rollout.kernels.linear as linear
from rollout import ContinuousBatchingConfig
from rollout.engine.core import EngineCore
from rollout.model.compiled import CompiledForward


def _counts() -> tuple[int, int]:
    from torch._dynamo.utils import counters

    return counters["stats"].get("unique_graphs", 0), sum(counters["graph_break"].values())


def _engine(model) -> EngineCore:
    cbc = ContinuousBatchingConfig(page_size=PS, max_batch_tokens=BUDGET, num_blocks=128, default_compile_level=1)
    core = EngineCore(model, GREEDY_GC, cbc)
    assert isinstance(core.runner.forward, CompiledForward)
    return core


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_compiled_forward_greedy_matches_hf_generate(arch, monkeypatch):
    if arch == "llama":  # NOTE: every linear through the packed oneDNN op (the tiny layers are below the size cut)
        monkeypatch.setattr(linear, "MIN_WEIGHT_ELEMENTS", 1)
    model, expected = reference(arch)
    graphs0, breaks0 = _counts()
    core = _engine(model)
    routed = len(core.runner.forward.linears)
    assert routed == (7 * model.config.num_hidden_layers + 1 if arch == "llama" and linear.onednn_available() else 0)
    reqs, _, step_tokens = run_engine(core, PROMPTS)
    for i, (req, exp) in enumerate(zip(reqs, expected, strict=True)):
        assert req.generated == exp, f"{arch}: prompt {i} differs from generate with the compiled forward"
    assert min(step_tokens) >= 1 and max(step_tokens) > 1
    graphs, breaks = _counts()
    assert breaks == breaks0, "the compiled forward has a graph break"
    assert core.runner.forward.fn is not core.runner.forward.eager, "the compile fell back to eager"
    assert 1 <= graphs - graphs0 <= 2  # NOTE: dynamic token count; torch specialises one-token steps

    # other prompt and step sizes: nothing compiles again
    more = [p[: len(p) // 2 + 2] for p in PROMPTS[:6]]
    reqs, _, _ = run_engine(core, more, max_new_tokens=9)
    assert [r.generated for r in reqs] == [hf_greedy(model, p, 9) for p in more]
    assert _counts()[0] == graphs

    if arch == "llama":  # an in-place update of the weights (what `update_weights` does) reaches the graph
        twin = reference(arch)[0]
        state = {k: v.clone() for k, v in twin.state_dict().items()}
        try:
            with torch.no_grad():
                for p in twin.parameters():
                    p.mul_(1.1)
            prompts = PROMPTS[:4]
            want = [hf_greedy(twin, p, MAX_NEW) for p in prompts]
            assert want != expected[:4]  # NOTE: the update changes the greedy tokens, so the check can fail
            reqs, _, _ = run_engine(core, prompts)
            assert [r.generated for r in reqs] == want
        finally:
            twin.load_state_dict(state)
        assert _counts()[0] == graphs


def test_compiled_engines_keep_their_own_graphs():
    """Engines on three architectures, interleaved, with dynamo allowed two graphs per code object (a
    one-token step takes a second): each engine compiles its own forward and matches its model. HF's
    forwards share one decorator's code, and past the limit a fullgraph compile raises (the engine would
    fall back to eager): sharing it would leave one graph for the three."""
    archs = ["llama", "qwen3", "phi3"]
    prompts = PROMPTS[:5]
    with torch._dynamo.config.patch(recompile_limit=2):
        engines = [_engine(reference(a)[0]) for a in archs]
        for i in (0, 1, 2, 0):
            reqs, _, _ = run_engine(engines[i], prompts)
            assert [r.generated for r in reqs] == reference(archs[i])[1][:5], archs[i]
    for core in engines:
        assert core.runner.forward.fn is not core.runner.forward.eager, "an engine fell back to eager"


def test_a_compiled_forward_gives_smaller_linears_torch_s_own_forward():
    """A linear routed to the small-M kernel only (`rollout.kernels.linear.SMALL_WEIGHT_ELEMENTS`: here the q / k / v
    / o of a 256-wide model) calls a C++ kernel dynamo cannot trace: the compiled forward gives it the class forward
    back (traced as torch's linear) and keeps the packed oneDNN op for the larger ones."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from rollout.model.engine_view import make_engine_view

    if not linear.onednn_available():
        pytest.skip("torch has no oneDNN fp32 linear here")
    torch.manual_seed(0)
    cfg = Qwen3Config(hidden_size=256, intermediate_size=768, num_hidden_layers=1, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=64, vocab_size=128, max_position_embeddings=256)
    view = make_engine_view(Qwen3ForCausalLM(cfg).eval())
    attn, mlp = view.model.layers[0].self_attn, view.model.layers[0].mlp
    small = [attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj]
    if not all(linear.small_only(m) for m in small):
        pytest.skip("rollout's small-M kernel is unavailable here: nothing is routed to it alone")
    assert all("forward" in vars(m) for m in small)
    forward = CompiledForward(view, None)  # NOTE: None: the eager forward, nothing compiled
    assert not any("forward" in vars(m) for m in small)
    assert sorted(map(id, forward.linears)) == sorted(map(id, [mlp.gate_proj, mlp.up_proj, mlp.down_proj]))
