"""The engine view's fused Llama-family decoder layers and decoder stacks (`rollout.kernels.fused_decoder`): the same
kernels in the same order as the children's fused forwards called through the class forwards, so the same bits; the
class forward wherever the inputs, hooks, training or the transformers source are not the ones it was written for."""

from __future__ import annotations

import copy

import pytest
import torch
from support.planted import plant_drafts
from support.tiny_models import COMMON, make_model, random_prompts
from transformers import AttentionInterface, AutoModelForCausalLM, GenerationConfig, Qwen3Config
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

import rollout.kernels.fused_decoder as fused_decoder
import rollout.kernels.fused_layers as fused_layers
import rollout.model.engine_view as engine_view
from rollout.config import ContinuousBatchingConfig
from rollout.engine.core import EngineCore
from rollout.invariant import mode as batch_invariant
from rollout.kernels import cpu_kernels
from rollout.kernels.fused_attention import use_fused_attention

pytestmark = pytest.mark.skipif(cpu_kernels.qk_norm_rope() is None,
                                reason="rollout's CPU kernels unavailable here (no compiler)")
ARCHS = ["qwen3", "llama", "mistral", "qwen3_sliding"]
MAX_NEW = 24
GREEDY = GenerationConfig(do_sample=False, eos_token_id=None, max_new_tokens=MAX_NEW)


def model_of(arch: str):
    """A tiny model; "qwen3_sliding": Qwen3 with a full then a sliding (16-token) layer; Mistral slides over 24."""
    if arch != "qwen3_sliding":
        return make_model(arch)
    torch.manual_seed(0)
    config = Qwen3Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=16, max_position_embeddings=1024, use_sliding_window=True,
                         sliding_window=16, max_window_layers=1, **COMMON)
    assert config.layer_types == ["full_attention", "sliding_attention"]
    return AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()


def decoders(view: torch.nn.Module) -> list[str]:
    return sorted(vars(m)[fused_layers.KERNEL_ATTR] for m in view.modules()
                  if vars(m).get(fused_layers.KERNEL_ATTR) in ("decoder layer", "decoder stack"))


def counting(monkeypatch) -> dict[str, int]:
    """Counts the fast paths run: a layer's (its attention call) and a stack's (its globals lookup)."""
    runs = {"layer": 0, "stack": 0}
    attend, glb = fused_decoder.attention_forward, fused_decoder.module_globals

    def layer(*a, **k):
        runs["layer"] += 1
        return attend(*a, **k)

    def stack(cls):
        runs["stack"] += 1
        return glb(cls)

    monkeypatch.setattr(fused_decoder, "attention_forward", layer)
    monkeypatch.setattr(fused_decoder, "module_globals", stack)
    return runs


def run(model, prompts, truth=None):
    """Greedy tokens and logprobs; with `truth` (each row's tokens of a plain run), n-gram speculation with every row
    verified against planted drafts (`support.planted`: the true continuation, a wrong token at 0, 2 or none)."""
    extra = dict(speculative_method="ngram", num_speculative_tokens=4) if truth else {}
    core = EngineCore(model, GREEDY, ContinuousBatchingConfig(page_size=16, num_blocks=96, return_logprobs=True,
                                                              **extra))
    if truth:
        plant_drafts(core, truth, 4, MAX_NEW, model.config.vocab_size, wrongs=(0, 2, None))
    reqs = [core.make_request(p, request_id=f"r{i}") for i, p in enumerate(prompts)]
    for r in reqs:
        core.add(r)
    while core.has_work():
        core.step()
    return core, [(r.generated, r.logprobs) for r in reqs]


@pytest.mark.parametrize("arch", ARCHS)
def test_engine_tokens_and_logprobs_are_the_same_bits_with_fused_decoders_on_and_off(arch, monkeypatch):
    """Prompts of 20-60 tokens (past Mistral's 24-token window and the 16-token one), 24 greedy tokens each."""
    model = model_of(arch)
    prompts = random_prompts(4, 20, 60, seed=5)
    runs = counting(monkeypatch)
    on_core, on = run(model, prompts)
    layers = model.config.num_hidden_layers
    assert decoders(on_core.runner.model) == ["decoder layer"] * layers + ["decoder stack"]
    assert runs["stack"] >= MAX_NEW and runs["layer"] == layers * runs["stack"]  # NOTE: every step, every layer
    monkeypatch.setattr(engine_view, "use_fused_decoder_layers", lambda view: 0)
    monkeypatch.setattr(engine_view, "use_fused_decoder_models", lambda view: 0)
    off_core, off = run(model, prompts)
    assert decoders(off_core.runner.model) == []
    for (a_tokens, a_logprobs), (b_tokens, b_logprobs) in zip(on, off, strict=True):
        assert len(a_tokens) == MAX_NEW and a_tokens == b_tokens
        assert torch.equal(torch.tensor(a_logprobs), torch.tensor(b_logprobs))


def fused_pair(arch: str):
    """(children fused, children and decoders fused) copies of one plain model, each with a recording attention."""
    seen = {"children": [], "decoders": []}

    def recording(name):
        def attend(module, q, k, v, mask, **kwargs):
            seen[name].append((module.layer_idx, q.shape, None if mask is None else mask.clone(),
                               sorted((key, val) for key, val in kwargs.items() if not isinstance(val, torch.Tensor))))
            return sdpa_attention_forward(module, q, k, v, mask, **kwargs)
        return attend

    model = model_of(arch)
    for m in model.modules():
        if fused_layers.is_llama_rms_norm(m):
            m.weight.data.normal_()  # NOTE: not all ones, so which norm runs where shows
    pair = []
    for name in seen:
        AttentionInterface.register(f"record_{name}", recording(name))
        AttentionMaskInterface.register(f"record_{name}", sdpa_mask)  # NOTE: so the stacks build their masks
        m = copy.deepcopy(model)
        m.set_attn_implementation(f"record_{name}")
        assert fused_layers.use_fused_layers(m) > 0 and use_fused_attention(m) > 0
        pair.append(m)
    layers = model.config.num_hidden_layers
    assert fused_decoder.use_fused_decoder_layers(pair[1]) == layers
    assert fused_decoder.use_fused_decoder_models(pair[1]) == 1
    return pair, seen


@pytest.mark.parametrize("arch", ARCHS)
def test_fused_decoders_give_the_class_forwards_bits_and_the_same_attention_calls(arch, monkeypatch):
    """On the plain model (sdpa, its masks), with the engine's call (position ids, use_cache=False) and without."""
    (children, fused), seen = fused_pair(arch)
    runs = counting(monkeypatch)
    ids = torch.randint(1, 100, (2, 40), generator=torch.Generator().manual_seed(1))
    pos = torch.arange(40)[None].expand(2, 40)
    with torch.inference_mode():
        for kw in (dict(position_ids=pos, use_cache=False), dict(use_cache=False), {}):
            before = dict(runs)
            want, got = children(input_ids=ids, **kw).logits, fused(input_ids=ids, **kw).logits
            assert torch.equal(got, want), kw
            fast = runs["stack"] - before["stack"]
            assert fast == (1 if "position_ids" in kw else 0), kw  # NOTE: else the stack's class forward
            layers = runs["layer"] - before["layer"]  # NOTE: no fast layer with a cache (use_cache's default)
            assert layers == (fused.config.num_hidden_layers if "use_cache" in kw else 0), kw
    assert len(seen["decoders"]) == len(seen["children"]) == 3 * fused.config.num_hidden_layers
    for a, b in zip(seen["decoders"], seen["children"], strict=True):
        assert a[:2] == b[:2] and a[3] == b[3]
        assert (a[2] is None and b[2] is None) or torch.equal(a[2], b[2])  # NOTE: each layer's mask (sliding, full)


def test_other_inputs_hooks_and_training_take_the_class_forwards(monkeypatch):
    (children, fused), _ = fused_pair("qwen3")
    runs = counting(monkeypatch)
    ids = torch.randint(1, 100, (1, 30), generator=torch.Generator().manual_seed(2))
    kw = dict(input_ids=ids, position_ids=torch.arange(30)[None], use_cache=False)

    def check(want: dict, **extra) -> None:
        runs.update(layer=0, stack=0)
        with torch.inference_mode():
            assert torch.equal(fused(**kw, **extra).logits, children(**kw, **extra).logits)
        assert runs == want

    check({"layer": 2, "stack": 1})
    # NOTE: a hook on a child sends its layer to the class forward; on a layer, the stack (the layers' own run fast)
    for target, want in ((lambda m: m.model.layers[1].mlp, {"layer": 1, "stack": 1}),
                         (lambda m: m.model.layers[0], {"layer": 2, "stack": 0})):
        fired = []
        handles = [target(m).register_forward_hook(lambda *a, fired=fired: fired.append(1)) for m in (children, fused)]
        check(want)
        assert len(fired) == 2  # NOTE: the hook ran in both models
        for h in handles:
            h.remove()
    check({"layer": 2, "stack": 1})
    check({"layer": 2, "stack": 0}, attention_mask=torch.ones(1, 30, dtype=torch.long))  # NOTE: the stack's own masks
    with torch.no_grad():  # NOTE: bf16 is no plain input: every layer takes its class forward
        fused.bfloat16()
        children.bfloat16()
        check({"layer": 0, "stack": 1})
        fused.float()
        children.float()
    fused.train()
    children.train()
    check({"layer": 0, "stack": 0})  # NOTE: training, even without autograd
    runs.update(layer=0, stack=0)
    torch.testing.assert_close(fused(**kw).logits, children(**kw).logits, rtol=0, atol=0)  # NOTE: autograd on
    assert runs == {"layer": 0, "stack": 0}
    fused.eval()
    children.eval()
    with torch.inference_mode():  # NOTE: transformers hooks the layers and attentions to capture outputs, for good
        out = fused(**kw, output_hidden_states=True)
        assert len(out.hidden_states) == 3 and torch.equal(out.logits, children(**kw).logits)
    check({"layer": 0, "stack": 0})


def test_an_unknown_source_or_another_forward_keeps_the_class_forward(monkeypatch):
    model = make_model("qwen3")
    fused_layers.use_fused_layers(model)
    use_fused_attention(model)
    layer_cls = type(model.model.layers[0])

    class Scaled(layer_cls):  # NOTE: the same children, another forward
        def forward(self, hidden_states, **kwargs):
            return 2 * super().forward(hidden_states, **kwargs)

    assert fused_decoder.variant(model.model.layers[0]) == "layer" and fused_decoder.variant(model.model) == "qwen3"
    model.model.layers[0].__class__ = Scaled
    assert fused_decoder.variant(model.model.layers[0]) is None
    assert fused_decoder.use_fused_decoder_layers(model) == 1  # NOTE: layer 1 only; so the stack stays unfused
    assert fused_decoder.use_fused_decoder_models(model) == 0
    model = make_model("qwen3")  # NOTE: a child without its fused forward: its layer is not fused
    fused_layers.use_fused_layers(model)
    use_fused_attention(model)
    vars(model.model.layers[1].mlp).pop("forward")
    assert fused_decoder.use_fused_decoder_layers(model) == 1
    fused_decoder.references.cache_clear()
    for name in fused_decoder.KNOWN_SOURCES:
        monkeypatch.setitem(fused_decoder.KNOWN_SOURCES, name, set())
    try:
        model = make_model("qwen3")
        assert not any(fused_decoder.variant(m) for m in model.modules())
        assert decoders(engine_view.make_engine_view(model)) == []
    finally:
        monkeypatch.undo()
        fused_decoder.references.cache_clear()
    assert decoders(engine_view.make_engine_view(make_model("qwen3"))) == ["decoder layer"] * 2 + ["decoder stack"]


def test_drop_batch_invariant_mode_and_the_switch_leave_the_class_forwards(monkeypatch):
    view = engine_view.make_engine_view(make_model("llama"))
    assert decoders(view) == ["decoder layer"] * 2 + ["decoder stack"]
    assert fused_layers.drop_fused_layers(view) > 3 and decoders(view) == []
    assert not any("forward" in vars(m) for m in view.modules() if fused_decoder.variant(m))
    view = engine_view.make_engine_view(make_model("llama"))
    batch_invariant.install(view)
    assert decoders(view) == [] and not any("forward" in vars(m) for m in view.modules() if fused_decoder.variant(m))
    monkeypatch.setenv("ROLLOUT_FUSED_LAYERS", "0")
    assert decoders(engine_view.make_engine_view(make_model("llama"))) == []
    monkeypatch.delenv("ROLLOUT_FUSED_LAYERS")
    view = engine_view.make_engine_view(make_model("llama"))
    for m in view.modules():  # NOTE: the children keep their fused forwards: only the switch can refuse
        if fused_decoder.variant(m):
            vars(m).pop("forward")
            delattr(m, fused_layers.KERNEL_ATTR)
    monkeypatch.setenv("ROLLOUT_FUSED_LAYERS", "0")
    assert fused_decoder.use_fused_decoder_layers(view) == 0 and decoders(view) == []
    monkeypatch.delenv("ROLLOUT_FUSED_LAYERS")
    assert fused_decoder.use_fused_decoder_layers(view) == 2 and fused_decoder.use_fused_decoder_models(view) == 1


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("spec", [False, True], ids=["decode", "speculative"])
def test_native_layers_give_the_python_path_s_bits(arch, spec, monkeypatch):
    """Every linear on the small-M kernel (the tiny layers routed as a 5M model's are): decode steps and verifying
    steps (planted drafts, kept whole, in part or not at all) run each layer as one `decoder_layer` call, prompt
    chunks the Python path; tokens and logprobs the same bits as with `ROLLOUT_NATIVE_LAYERS=0`. Two requests share
    a prompt (the cascade kernel's shared pages); prompts pass Mistral's 24-token window and the 16-token one."""
    import rollout.kernels.linear as linear

    if cpu_kernels.decoder_layer() is None:
        pytest.skip("rollout's small-M kernel is unavailable here (no AVX-512)")
    monkeypatch.setattr(linear, "SMALL_WEIGHT_ELEMENTS", 1)
    model = model_of(arch)
    prompts = random_prompts(3, 20, 60, seed=5)
    prompts.append(list(prompts[0]))
    calls = {"native": 0, "rows": 0}
    kernel = cpu_kernels.decoder_layer()

    def counted(x, *args):
        calls["native"] += 1
        calls["rows"] = max(calls["rows"], x.shape[0])
        return kernel(x, *args)

    monkeypatch.setattr(cpu_kernels, "decoder_layer", lambda: counted)
    truth = [t for t, _ in run(model, prompts)[1]] if spec else None
    on_core, on = run(model, prompts, truth)
    layers = model.config.num_hidden_layers
    assert calls["native"] >= layers * (MAX_NEW // 2 if spec else MAX_NEW - 1)
    if spec:
        st = on_core.cache_stats()
        assert st["spec_draft_tokens"] > st["spec_accepted_tokens"] > 0
        assert calls["rows"] > len(prompts)  # NOTE: verifying steps ran natively too
    monkeypatch.setenv("ROLLOUT_NATIVE_LAYERS", "0")
    before = calls["native"]
    _, off = run(model, prompts, truth)
    assert calls["native"] == before
    for i, ((a_tokens, a_logprobs), (b_tokens, b_logprobs)) in enumerate(zip(on, off, strict=True)):
        assert len(a_tokens) == MAX_NEW and a_tokens == b_tokens
        assert torch.equal(torch.tensor(a_logprobs), torch.tensor(b_logprobs))
        assert truth is None or a_tokens == truth[i]
