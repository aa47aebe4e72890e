"""LoRA adapters served unmerged (`rollout.api.lora`): one call mixing two adapters and the base model gives every
row its own `PeftModel`'s greedy tokens and teacher-forced logprobs; updates, directories, state dicts, refusals."""

from __future__ import annotations

import pytest
import torch
from support.lora import make_peft, redraw
from support.tiny_models import hf_greedy, make_model, random_prompts, teacher_forced_logprobs
from transformers import GenerationConfig

from rollout import ContinuousBatchingConfig, RolloutEngine
from rollout.kernels import linear

peft = pytest.importorskip("peft", reason="LoRA tests need peft (the [lora] extra)")

NEW = 8
GC = GenerationConfig(do_sample=False, eos_token_id=None, max_new_tokens=NEW)


def _engine(base, max_loras: int = 2, max_lora_rank: int = 8, **config) -> RolloutEngine:
    cfg = ContinuousBatchingConfig(max_loras=max_loras, max_lora_rank=max_lora_rank, page_size=16, num_blocks=96,
                                   **config)
    return RolloutEngine(base, config=cfg, generation_config=GC)


def _prompts() -> list[list[int]]:
    """Random prompts, one of 40 tokens given to each adapter and to the base: rows that would share its prefix
    pages (and fork its KV) if the prefix cache did not key them by adapter."""
    shared = random_prompts(1, 40, 40, seed=7)[0]
    return random_prompts(5, 3, 30, seed=3) + [shared, shared, shared]


CHOICE = ["a", "b", None, "b", "a", "a", "b", None]


def _steps_mixing(engine: RolloutEngine) -> list[set]:
    """Record, per step, which adapters (None: the base) its rows ran under."""
    loras = engine.manager.core.runner.lora
    seen: list[set] = []
    begin = loras.begin

    def spy(out, drafts=None):
        seen.append({s.request.lora_slot for s in out.scheduled})
        return begin(out, drafts)

    loras.begin = spy
    return seen


@pytest.mark.parametrize("arch", ["qwen3", "llama", "gemma2"])
def test_one_call_mixing_two_adapters_and_the_base_matches_each_peft_model(arch):
    base = make_model(arch)
    pa = make_peft(base, seed=1, r=4)  # every linear
    pb = make_peft(base, seed=2, r=8, targets=["q_proj", "v_proj"], use_rslora=True)
    prompts = _prompts()
    oracle = {"a": pa, "b": pb, None: base}
    with _engine(base) as engine:
        assert engine.add_lora("a", pa).slot == 0 and engine.add_lora("b", pb).rank == 8
        steps = _steps_mixing(engine)
        out = engine.generate(prompts, temps=0.0, max_new_tokens=NEW, lora=CHOICE)
        assert any(s == {0, 1, None} for s in steps), "no step ran rows of both adapters and the base together"
        for i, (prompt, name) in enumerate(zip(prompts, CHOICE, strict=True)):
            got = out.completion_ids[i].tolist()
            assert got == hf_greedy(oracle[name], prompt, NEW), f"row {i} ({name})"
            want = teacher_forced_logprobs(oracle[name], prompt, got)
            torch.testing.assert_close(out.logprobs[i], want, atol=1e-5, rtol=0)
            # NOTE: the adapters matter (else the test could not fail): the other models score the row otherwise
            for other in {"a", "b", None} - {name}:
                assert (teacher_forced_logprobs(oracle[other], prompt, got) - want).abs().max() > 1e-3, (i, other)
        scored = engine.score(prompts, [r.tolist() for r in out.completion_ids], temps=0.0, lora=CHOICE)
        torch.testing.assert_close(scored.logprobs, out.logprobs, atol=1e-5, rtol=0)


def test_adapters_on_the_routed_linears_and_fused_mlps(monkeypatch):
    """Every linear on oneDNN's packed weights / the small-M kernel (tiny models stay on torch's linear by default),
    the gated MLPs fused: the deltas are added on those paths too."""
    monkeypatch.setattr(linear, "MIN_WEIGHT_ELEMENTS", 0)
    base = make_model("qwen3")
    pa, pb = make_peft(base, seed=1, r=4), make_peft(base, seed=2, r=2, targets=["gate_proj", "down_proj"])
    prompts = _prompts()
    with _engine(base) as engine:
        routed = linear.routed_copies(engine.manager.core.view.model.layers[0].mlp.down_proj)
        if routed.small is None and not linear.onednn_available():
            pytest.skip("no oneDNN and no small-M kernel on this machine")
        engine.add_lora("a", pa)
        engine.add_lora("b", pb)
        out = engine.generate(prompts, temps=0.0, max_new_tokens=NEW, lora=CHOICE)
    for i, (prompt, name) in enumerate(zip(prompts, CHOICE, strict=True)):
        assert out.completion_ids[i].tolist() == hf_greedy({"a": pa, "b": pb, None: base}[name], prompt, NEW)


def test_update_lora_is_seen_by_the_next_call_and_drops_its_prefix_kv():
    base = make_model("qwen3")
    pa = make_peft(base, seed=1)
    prompt = random_prompts(1, 40, 40, seed=9)[0]  # NOTE: two full pages, cached by the first call
    with _engine(base) as engine:
        engine.add_lora("a", pa)
        before = engine.generate([prompt], temps=0.0, lora="a").completion_ids[0].tolist()
        assert before == hf_greedy(pa, prompt, NEW)
        redraw(pa, seed=11)
        assert engine.update_lora("a", pa) == 2
        after = engine.generate([prompt], temps=0.0, lora="a").completion_ids[0].tolist()
        assert after == hf_greedy(pa, prompt, NEW) and after != before
        assert [(i.name, i.version) for i in engine.list_loras()] == [("a", 2)]
        # NOTE: the base model's own weights were never touched
        assert engine.generate([prompt], temps=0.0).completion_ids[0].tolist() == hf_greedy(base, prompt, NEW)


def test_adapters_load_from_a_peft_directory_and_a_state_dict(tmp_path):
    from peft import get_peft_model_state_dict

    base = make_model("llama")
    pa = make_peft(base, seed=1, r=4, rank_pattern={"v_proj": 2}, alpha_pattern={"o_proj": 3})
    pb = make_peft(base, seed=2, r=8, targets=["k_proj", "up_proj"], use_rslora=True)
    pa.save_pretrained(tmp_path / "a")
    prompts = random_prompts(3, 5, 20, seed=4)
    with _engine(base) as engine:
        info = engine.add_lora("dir", str(tmp_path / "a"))
        assert info.rank == 4 and "model.layers.0.self_attn.v_proj" in info.target_modules
        engine.add_lora("sd", get_peft_model_state_dict(pb), config=pb.peft_config["default"])
        out = engine.generate(prompts * 2, temps=0.0, lora=["dir"] * 3 + ["sd"] * 3)
    for i, prompt in enumerate(prompts * 2):
        assert out.completion_ids[i].tolist() == hf_greedy(pa if i < 3 else pb, prompt, NEW), i


def test_remove_lora_frees_its_slot():
    base = make_model("qwen3")
    pa, pb = make_peft(base, seed=1), make_peft(base, seed=2)
    with _engine(base, max_loras=1) as engine:
        engine.add_lora("a", pa)
        with pytest.raises(ValueError, match=r"table is full: max_loras=1 .*\(a\)"):
            engine.add_lora("b", pb)
        assert engine.remove_lora("a").name == "a" and engine.list_loras() == []
        with pytest.raises(ValueError, match="unknown LoRA adapter 'a'"):
            engine.generate([[1, 2, 3]], lora="a")
        assert engine.add_lora("b", pb).slot == 0
        prompt = [5, 6, 7, 8]
        assert engine.generate([prompt], temps=0.0, lora="b").completion_ids[0].tolist() == hf_greedy(pb, prompt, NEW)


def test_refusals_name_the_problem():
    base = make_model("qwen3")
    pa = make_peft(base, seed=1, r=4)
    state = peft.get_peft_model_state_dict(pa)
    config = pa.peft_config["default"]
    with _engine(base, max_lora_rank=2) as engine:
        with pytest.raises(ValueError, match=r"rank 4 .* above max_lora_rank=2"):
            engine.add_lora("a", pa)
        alien = {k.replace("layers.0.", "layers.9."): v[:2] if "lora_A" in k else v[:, :2] for k, v in state.items()}
        with pytest.raises(ValueError, match=r"targets modules the base model lacks: \['model.layers.9"):
            engine.add_lora("a", alien, config=config)
        with pytest.raises(ValueError, match="needs its LoraConfig"):
            engine.add_lora("a", state)
        with pytest.raises(ValueError, match="no adapter_config.json"):
            engine.add_lora("a", "/nonexistent/adapter")
        with pytest.raises(ValueError, match="DoRA"):
            engine.add_lora("a", make_peft(base, seed=3, r=2, use_dora=True))
        with pytest.raises(ValueError, match="unknown LoRA adapter 'nope'"):
            engine.generate([[1, 2, 3]], lora="nope")
        with pytest.raises(ValueError, match="unknown LoRA adapter 'nope'"):
            engine.update_lora("nope", pa)
        assert engine.list_loras() == []  # NOTE: nothing refused was loaded
        engine.add_lora("small", make_peft(base, seed=4, r=2))
        with pytest.raises(ValueError, match="lora has 1 entries for 2 prompts"):
            engine.generate([[1, 2], [3, 4]], lora=["small"])
        with pytest.raises(ValueError, match="already loaded"):
            engine.add_lora("small", make_peft(base, seed=4, r=2))
    with _engine(base, max_loras=0) as engine, pytest.raises(ValueError, match=r"max_loras=K"):
        engine.add_lora("a", pa)
    with pytest.raises(ValueError, match="max_lora_rank must be >= 1"):
        ContinuousBatchingConfig(max_lora_rank=0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_mixing_adapters_on_a_gpu():
    """The same grouped product on CUDA (torch ops): each row its own PeftModel's greedy tokens."""
    base = make_model("qwen3").cuda()
    pa, pb = make_peft(base, seed=1, r=4), make_peft(base, seed=2, r=8, targets=["q_proj", "v_proj"])
    prompts = _prompts()
    with _engine(base, attn_backend="sdpa") as engine:
        engine.add_lora("a", pa)
        engine.add_lora("b", pb)
        out = engine.generate(prompts, temps=0.0, max_new_tokens=NEW, lora=CHOICE)
    for i, (prompt, name) in enumerate(zip(prompts, CHOICE, strict=True)):
        model = {"a": pa, "b": pb, None: base}[name]
        got = out.completion_ids[i].tolist()
        assert got == hf_greedy(model, prompt, NEW), i
        torch.testing.assert_close(out.logprobs[i].cpu(), teacher_forced_logprobs(model, prompt, got).cpu(),
                                   atol=1e-4, rtol=0)


def test_groups_of_forks_under_different_adapters():
    """GRPO groups (a prompt's samples fork its KV) under different adapters in one call, one prompt shared by all:
    forks never cross adapters, and rows ordered by adapter keep each group's samples apart."""
    base = make_model("qwen3")
    pa, pb = make_peft(base, seed=1, r=4), make_peft(base, seed=2, r=8, targets=["q_proj", "v_proj"])
    shared = random_prompts(1, 40, 40, seed=7)[0]
    prompts = [shared, shared, shared, random_prompts(1, 20, 20, seed=8)[0]]
    choice = ["b", None, "a", "b"]
    with _engine(base) as engine:
        engine.add_lora("a", pa)
        engine.add_lora("b", pb)
        out = engine.generate(prompts, temps=0.0, group_size=3, lora=choice)
    oracle = {"a": pa, "b": pb, None: base}
    for i, (prompt, name) in enumerate(zip(prompts, choice, strict=True)):
        want = hf_greedy(oracle[name], prompt, NEW)
        for j in range(3):
            assert out.completion_ids[3 * i + j].tolist() == want, (i, j, name)


def test_speculative_steps_run_each_rows_adapter():
    """n-gram speculation (rows run their drafts too, in the scheduler's order): every row its PeftModel's greedy."""
    base = make_model("qwen3")
    pa, pb = make_peft(base, seed=1, r=4), make_peft(base, seed=2, r=8, targets=["q_proj", "v_proj"])
    prompts = [p * 4 for p in random_prompts(6, 3, 6, seed=12)]  # NOTE: repeats, so the n-gram drafter proposes
    choice = ["a", "b", None, "b", "a", None]
    with _engine(base, speculative_method="ngram", num_speculative_tokens=3) as engine:
        engine.add_lora("a", pa)
        engine.add_lora("b", pb)
        first = engine.generate(prompts, temps=0.0, max_new_tokens=12, lora=choice)
        # NOTE: the same prompts again: each row drafts its first rollout's text (the cost model verifies drafts
        # that likely; this random model's own text rarely repeats its prompt's cycle)
        out = engine.generate(prompts, temps=0.0, max_new_tokens=12, lora=choice)
        assert engine.cache_stats()["spec_accepted_tokens"] > 0
    for i, (prompt, name) in enumerate(zip(prompts, choice, strict=True)):
        want = hf_greedy({"a": pa, "b": pb, None: base}[name], prompt, 12)
        assert first.completion_ids[i].tolist() == out.completion_ids[i].tolist() == want, i


def test_modes_without_unmerged_adapters_refuse_by_name():
    base = make_model("qwen3")
    pa = make_peft(base, seed=1, r=4)
    with _engine(base, default_compile_level=1) as engine, pytest.raises(ValueError, match="a compiled forward"):
        engine.add_lora("a", pa)
    with _engine(base, batch_invariant=True) as engine, pytest.raises(ValueError, match="batch_invariant=True"):
        engine.add_lora("a", pa)
