"""Acceptance of `RolloutEngine` (issue "RolloutEngine"): the RL-facing API on tiny random models.

Covers the `RolloutBatch` layout (groups, per-prompt temperatures, padding, masks, finish reasons),
processed logprobs against a teacher-forced forward, seeds, prompt forking within a group, weight
updates (state dict / iterable / DDP names / tied embeddings / zero-copy on the trainer's model /
bf16 from fp32), the trainer's model left untouched (mode, requires_grad, attention, autograd),
sleep / wake, in-flight handling of updates, and bad input.
"""

from __future__ import annotations

import copy
import logging
import statistics
import threading
import time
from collections import Counter

import pytest
import torch
from support.tiny_models import (
    _qwen3,
    hf_greedy,
    make_model,
    random_prompts,
    teacher_forced_logits,
    teacher_forced_logprobs,
)
from transformers import AutoModelForCausalLM, GenerationConfig

from rollout import ContinuousBatchingConfig, RolloutBatch, RolloutEngine

SMALL = dict(page_size=16, num_blocks=256)  # 4096 tokens of KV: enough for every test here


def gen_config(eos: int | None = None, max_new_tokens: int = 16) -> GenerationConfig:
    return GenerationConfig(do_sample=True, eos_token_id=eos, max_new_tokens=max_new_tokens)


def make_engine(model, eos: int | None = None, tokenizer=None, **cfg) -> RolloutEngine:
    config = ContinuousBatchingConfig(**(cfg or SMALL))
    gc = None if tokenizer is not None else gen_config(eos)
    return RolloutEngine(model, tokenizer=tokenizer, config=config, generation_config=gc)


def rows(batch: RolloutBatch) -> list[list[int]]:
    """Each row's completion tokens (mask applied)."""
    return [r[m.bool()].tolist() for r, m in zip(batch.completion_ids, batch.completion_mask, strict=True)]


def tied_qwen3(seed: int):
    torch.manual_seed(seed)
    config = _qwen3()
    config.tie_word_embeddings = True
    return AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()


@pytest.fixture(scope="module")
def model():
    return make_model("qwen3", seed=0)


@pytest.fixture(scope="module")
def new_model():
    return make_model("qwen3", seed=1)


# ------------------------------------------------------------------------------------- 1. layout


def check_layout(batch: RolloutBatch, prompts, temps, group_size: int, max_new_tokens: int) -> None:
    n = len(prompts) * group_size
    p_len = max(len(p) for p in prompts)
    assert batch.prompt_ids.shape == batch.prompt_mask.shape == (n, p_len)
    t_len = batch.completion_ids.shape[1]
    assert 1 <= t_len <= max_new_tokens
    assert batch.completion_mask.shape == batch.logprobs.shape == (n, t_len)
    assert batch.logprobs.dtype == torch.float32
    assert batch.group_ids.tolist() == [i for i in range(len(prompts)) for _ in range(group_size)]
    assert batch.temperatures.tolist() == pytest.approx([t for t in temps for _ in range(group_size)])
    assert len(batch.finish_reasons) == len(batch) == n
    for row in range(n):
        prompt = prompts[row // group_size]
        mask = batch.prompt_mask[row]
        assert mask.sum() == len(prompt)
        assert mask[p_len - len(prompt):].all() and not mask[: p_len - len(prompt)].any()  # left padding
        assert batch.prompt_ids[row, p_len - len(prompt):].tolist() == prompt
        cmask = batch.completion_mask[row]
        k = int(cmask.sum())
        assert cmask[:k].all() and not cmask[k:].any()  # right padding
        assert (batch.logprobs[row, k:] == 0).all()  # exactly 0 where masked
        assert (batch.logprobs[row, :k] <= 0).all() and torch.isfinite(batch.logprobs[row, :k]).all()
        reason = batch.finish_reasons[row]  # NOTE: a full row is "length", or "stop" when its last token is EOS
        assert (reason == "length") == (k == max_new_tokens) or (reason == "stop" and k == max_new_tokens)
    assert torch.equal(batch.input_ids, torch.cat([batch.prompt_ids, batch.completion_ids], dim=1))
    assert torch.equal(batch.attention_mask, torch.cat([batch.prompt_mask, batch.completion_mask], dim=1))


def test_batch_layout_groups_temperatures_and_finish_reasons(model):
    prompts = random_prompts(3, 4, 12, seed=1)
    assert len({len(p) for p in prompts}) > 1  # padding is exercised
    temps, group, max_new = [0.7, 1.0, 1.3], 4, 10
    with make_engine(model) as engine:
        free = engine.cache_stats()["free_blocks"]
        no_eos = engine.generate(prompts, temps=temps, group_size=group, max_new_tokens=max_new, seed=7)
        assert engine.cache_stats()["free_blocks"] == free
    check_layout(no_eos, prompts, temps, group, max_new)
    assert no_eos.finish_reasons == ["length"] * 12
    assert no_eos.policy_version == 0

    moved = no_eos.to("cpu")
    assert isinstance(moved, RolloutBatch) and moved.finish_reasons == no_eos.finish_reasons
    for name in ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "logprobs", "group_ids",
                 "temperatures"):
        assert getattr(moved, name).device.type == "cpu"
        assert torch.equal(getattr(moved, name), getattr(no_eos, name))

    # EOS: the most frequent token that some rows emit and others do not. The same seeds draw the same
    # noise, so each row is its EOS-free twin cut just after its first EOS ("stop"), or whole ("length").
    samples = rows(no_eos)
    counts = Counter(t for r in samples for t in r)
    eos = next(t for t, _ in counts.most_common() if 0 < sum(t in r for r in samples) < len(samples))
    with make_engine(model, eos=eos) as engine:
        stopped = engine.generate(prompts, temps=temps, group_size=group, max_new_tokens=max_new, seed=7)
    check_layout(stopped, prompts, temps, group, max_new)
    for row, (full, got) in enumerate(zip(samples, rows(stopped), strict=True)):
        if eos in full:
            cut = full[: full.index(eos) + 1]
            assert got == cut and stopped.finish_reasons[row] == "stop"
        else:
            assert got == full and stopped.finish_reasons[row] == "length"
        torch.testing.assert_close(stopped.logprobs[row, : len(got)], no_eos.logprobs[row, : len(got)],
                                   rtol=0, atol=1e-5)
    assert "stop" in stopped.finish_reasons and "length" in stopped.finish_reasons
    assert stopped.completion_ids.shape[1] == max_new  # padded to the longest row


def word_tokenizer(eos: int):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({word(i): i for i in range(128)}, unk_token=word(0)))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token=word(0), pad_token=word(0), eos_token=word(eos))


def word(i: int) -> str:
    return f"w{i:03d}"  # fixed width: a special token never matches inside another word


def test_string_prompts_with_a_tokenizer_stop_at_its_eos(model):
    prompts = random_prompts(2, 5, 9, seed=2)
    greedy = [hf_greedy(model, p, 12) for p in prompts]
    eos = greedy[0][3]  # the tokenizer's EOS: the 4th greedy token of the first prompt
    tokenizer = word_tokenizer(eos)
    assert tokenizer.eos_token_id == eos
    with make_engine(model, tokenizer=tokenizer, **SMALL) as engine:
        batch = engine.generate([" ".join(map(word, p)) for p in prompts], temps=0.0, max_new_tokens=12)
    for row, g in enumerate(greedy):
        want = g[: g.index(eos) + 1] if eos in g else g
        assert rows(batch)[row] == want
        assert batch.finish_reasons[row] == ("stop" if eos in g else "length")
        assert batch.prompt_ids[row][batch.prompt_mask[row].bool()].tolist() == prompts[row]
    assert batch.finish_reasons[0] == "stop"
    assert batch.completions_text[0] == " ".join(map(word, greedy[0][:3]))  # EOS skipped


# ---------------------------------------------------------------------------- 2. logprobs parity


def reference_logprobs(logits: torch.Tensor, tokens: list[int], temp: float, top_k, top_p) -> list[float]:
    """log p(token) under temperature, then top-k, then top-p over the top-k-renormalised probabilities
    (the smallest set whose mass >= top_p, never empty), renormalised; raw log_softmax when greedy."""
    out = []
    for step, tok in enumerate(tokens):
        x = logits[step].double()
        if temp == 0:
            out.append(float(torch.log_softmax(x, -1)[tok]))
            continue
        x = x / temp
        order = torch.argsort(x, descending=True).tolist()
        if top_k:
            order = order[:top_k]
        if top_p is not None and top_p < 1:
            probs = torch.softmax(x[order], -1)
            mass, keep = 0.0, 0
            while keep < len(order) and (keep == 0 or mass < top_p):
                mass += float(probs[keep])
                keep += 1
            order = order[:keep]
        kept = torch.log_softmax(x[order], -1)
        out.append(float(kept[order.index(tok)]) if tok in order else float("-inf"))
    return out


@pytest.mark.parametrize("top_k, top_p", [(None, None), (10, None), (None, 0.8), (20, 0.7)])
def test_processed_logprobs_match_a_teacher_forced_forward(model, top_k, top_p):
    prompts = random_prompts(3, 4, 10, seed=3)
    temps = [0.7, 1.0, 1.3]
    with make_engine(model) as engine:
        batch = engine.generate(prompts, temps=temps, group_size=2, max_new_tokens=8, top_k=top_k, top_p=top_p,
                                seed=11)
    worst = 0.0
    for row, completion in enumerate(rows(batch)):
        prompt, temp = prompts[row // 2], temps[row // 2]
        logits = teacher_forced_logits(model, prompt, completion)
        ref = torch.tensor(reference_logprobs(logits, completion, temp, top_k, top_p), dtype=torch.float64)
        if top_k is None and top_p is None:  # the plain formula, stated directly
            plain = torch.log_softmax(logits / temp, -1).gather(1, torch.tensor(completion)[:, None])[:, 0]
            torch.testing.assert_close(ref.float(), plain, rtol=0, atol=1e-5)
        assert torch.isfinite(ref).all(), "a sampled token lies outside the kept set"
        got = batch.logprobs[row, : len(completion)].double()
        worst = max(worst, float((got - ref).abs().max()))
    assert worst < 1e-4, worst


def test_greedy_rows_report_raw_logprobs(model):
    prompts = random_prompts(2, 4, 10, seed=4)
    with make_engine(model) as engine:
        batch = engine.generate(prompts, temps=[0.0, 1.0], group_size=2, max_new_tokens=8, top_k=5, seed=3)
    for row, completion in enumerate(rows(batch)):
        prompt = prompts[row // 2]
        logits = teacher_forced_logits(model, prompt, completion)
        temp = [0.0, 1.0][row // 2]
        ref = torch.tensor(reference_logprobs(logits, completion, temp, 5 if temp else None, None),
                           dtype=torch.float64)
        torch.testing.assert_close(batch.logprobs[row, : len(completion)].double(), ref, rtol=0, atol=1e-4)
        if temp == 0:
            assert completion == hf_greedy(model, prompt, 8)


# ------------------------------------------------------------------------------------- 3. seeds


def test_seed_reproducible_and_distinct(model):
    prompts = random_prompts(2, 4, 10, seed=5)
    with make_engine(model) as engine:
        a = engine.generate(prompts, temps=1.3, group_size=4, max_new_tokens=12, seed=123)
        b = engine.generate(prompts, temps=1.3, group_size=4, max_new_tokens=12, seed=123)
        c = engine.generate(prompts, temps=1.3, group_size=4, max_new_tokens=12, seed=124)
    assert torch.equal(a.completion_ids, b.completion_ids)
    torch.testing.assert_close(a.logprobs, b.logprobs, rtol=0, atol=1e-6)
    assert len(set(map(tuple, rows(a)))) == len(a)  # the samples of a group are distinct
    # a different seed draws fresh samples: no row of `c` repeats any row of `a`
    assert not set(map(tuple, rows(a))) & set(map(tuple, rows(c)))


# ------------------------------------------------------------------------------ 4. group forking


@pytest.mark.parametrize("page_size", [256, 16])
def test_group_prompt_prefilled_once(model, page_size):
    prompt = random_prompts(1, 90, 90, seed=6)[0]
    with make_engine(model, page_size=page_size) as engine:
        before = engine.cache_stats()["computed_prompt_tokens"]
        batch = engine.generate([prompt], temps=0.0, group_size=8, max_new_tokens=6)
        computed = engine.cache_stats()["computed_prompt_tokens"] - before
    assert len(prompt) <= computed <= 2 * len(prompt), computed
    want = hf_greedy(model, prompt, 6)
    assert rows(batch) == [want] * 8
    assert batch.group_ids.tolist() == [0] * 8


# ----------------------------------------------------------------------------- 5. weight updates


def source_of(kind: str, new):
    if kind == "state_dict":
        return new.state_dict()
    if kind == "iterable":
        return ((n, p.detach()) for n, p in new.named_parameters())
    if kind == "ddp_names":
        return {f"module.{n}": t for n, t in new.state_dict().items()}
    if kind == "tied_no_head":  # a tied checkpoint as saved to disk: no lm_head.weight
        return {n: t for n, t in new.state_dict().items() if n != "lm_head.weight"}
    raise AssertionError(kind)


@pytest.mark.parametrize("kind", ["state_dict", "iterable", "ddp_names", "tied", "tied_no_head"])
def test_update_weights_flushes_stale_prefix_cache(kind):
    tied = kind.startswith("tied")
    old = tied_qwen3(0) if tied else make_model("qwen3", seed=0)
    new = tied_qwen3(1) if tied else make_model("qwen3", seed=1)
    engine_model = copy.deepcopy(old)
    if tied:
        assert engine_model.lm_head.weight is engine_model.model.embed_tokens.weight
    prompts = random_prompts(3, 20, 40, seed=8)  # longer than a page of 16
    with make_engine(engine_model, page_size=16, num_blocks=256) as engine:
        old_greedy = [hf_greedy(old, p, 6) for p in prompts]
        assert rows(engine.generate(prompts, temps=0.0, max_new_tokens=6)) == old_greedy
        stats = engine.cache_stats()
        assert rows(engine.generate(prompts, temps=0.0, max_new_tokens=6)) == old_greedy
        assert engine.cache_stats()["cached_prompt_tokens"] > stats["cached_prompt_tokens"]  # warm

        v0 = engine.policy_version
        version = engine.update_weights(new.state_dict() if kind == "tied" else source_of(kind, new))
        assert version == v0 + 1 == engine.policy_version
        stats = engine.cache_stats()
        batch = engine.generate(prompts, temps=0.0, max_new_tokens=6)
        assert batch.policy_version == version
        assert rows(batch) == [hf_greedy(new, p, 6) for p in prompts]
        assert engine.cache_stats()["cached_prompt_tokens"] == stats["cached_prompt_tokens"]  # no stale KV
    for (name, p), q in zip(engine_model.named_parameters(), new.parameters(), strict=True):
        assert torch.equal(p, q), name
    if tied:
        assert engine_model.lm_head.weight is engine_model.model.embed_tokens.weight


def test_rejected_update_changes_nothing(model, new_model):
    engine_model = copy.deepcopy(model)
    prompts = random_prompts(2, 20, 30, seed=18)
    want = [hf_greedy(model, p, 6) for p in prompts]
    with make_engine(engine_model) as engine:
        assert rows(engine.generate(prompts, temps=0.0, max_new_tokens=6)) == want
        bad_name = {**new_model.state_dict(), "not.a.param": torch.zeros(1)}
        with pytest.raises(ValueError, match="unknown parameter names.*not.a.param"):
            engine.update_weights(bad_name)
        name, t = next(iter(new_model.state_dict().items()))
        bad_shape = {**new_model.state_dict(), name: t[:1]}
        with pytest.raises(ValueError, match="shape"):
            engine.update_weights(bad_shape)
        with pytest.raises(ValueError, match="in_flight"):
            engine.update_weights(new_model, in_flight="later")
        # a rejected state dict copied nothing: same weights, same version, same outputs
        assert engine.policy_version == 0
        for (n, p), q in zip(engine_model.named_parameters(), model.parameters(), strict=True):
            assert torch.equal(p, q), n
        assert rows(engine.generate(prompts, temps=0.0, max_new_tokens=6)) == want


# ------------------------------------------------------------------ 6. the trainer's own model


def test_zero_copy_update_on_the_trainers_model(model, caplog):
    trainer = copy.deepcopy(model).train()
    ptrs = {n: p.data_ptr() for n, p in trainer.named_parameters()}
    prompts = random_prompts(2, 20, 30, seed=9)
    opt = torch.optim.SGD(trainer.parameters(), lr=0.5)
    with make_engine(trainer, page_size=16, num_blocks=128) as engine:
        assert rows(engine.generate(prompts, temps=0.0, max_new_tokens=6)) == [hf_greedy(model, p, 6) for p in prompts]

        # an optimizer-like in-place change
        with torch.no_grad():
            for p in trainer.parameters():
                p.data.add_(torch.randn_like(p) * 0.1)
        with caplog.at_level(logging.INFO, logger="rollout"):
            assert engine.update_weights(trainer) == 1
        assert "0 tensors copied" in caplog.text
        ref = copy.deepcopy(trainer).eval()
        assert rows(engine.generate(prompts, temps=0.0, max_new_tokens=6)) == [hf_greedy(ref, p, 6) for p in prompts]

        # a real optimizer step
        ids = torch.tensor([prompts[0] + prompts[1]])
        trainer(ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()

        class Wrapper(torch.nn.Module):  # DDP-style: the engine unwraps `.module`
            def __init__(self, module):
                super().__init__()
                self.module = module

        assert engine.update_weights(Wrapper(trainer)) == 2
        ref = copy.deepcopy(trainer).eval()
        batch = engine.generate(prompts, temps=0.0, max_new_tokens=6)
        assert rows(batch) == [hf_greedy(ref, p, 6) for p in prompts]
        assert batch.policy_version == 2
    assert {n: p.data_ptr() for n, p in trainer.named_parameters()} == ptrs


def test_update_from_the_trainers_model_after_it_replaced_its_parameters(model, new_model):
    # `load_state_dict(assign=True)` gives the trainer new Parameter objects: the engine's tensors are no
    # longer the trainer's, so `update_weights(model)` must copy (it used to copy nothing: stale weights)
    trainer = copy.deepcopy(model)
    prompts = random_prompts(2, 20, 30, seed=17)
    with make_engine(trainer) as engine:
        assert rows(engine.generate(prompts, temps=0.0, max_new_tokens=6)) == [hf_greedy(model, p, 6) for p in prompts]
        trainer.load_state_dict(copy.deepcopy(new_model.state_dict()), assign=True)
        assert engine.update_weights(trainer) == 1
        assert rows(engine.generate(prompts, temps=0.0, max_new_tokens=6)) == [
            hf_greedy(new_model, p, 6) for p in prompts
        ]


def test_trainers_model_in_train_mode_is_left_untouched(model):
    # dropout on: the engine must not apply it (its greedy output equals an eval copy's)
    torch.manual_seed(0)
    config = _qwen3()
    config.attention_dropout = 0.5
    trainer = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    trainer.load_state_dict(model.state_dict())
    trainer.train()
    trainer.model.embed_tokens.weight.requires_grad_(False)  # a mixed requires_grad pattern
    grads = {n: p.requires_grad for n, p in trainer.named_parameters()}
    modes = {n: m.training for n, m in trainer.named_modules()}
    fresh = copy.deepcopy(trainer)
    attn = trainer.config._attn_implementation
    ids = torch.tensor([random_prompts(1, 24, 24, seed=10)[0]])

    def trainer_forward_matches_fresh():
        # train mode with attention dropout: compare under a fixed RNG state
        torch.manual_seed(1)
        logits = trainer(ids).logits
        torch.manual_seed(1)
        with torch.no_grad():
            want = fresh(ids).logits
        torch.testing.assert_close(logits, want, rtol=0, atol=0)
        assert logits.requires_grad
        logits.float().logsumexp(-1).mean().backward()
        assert trainer.lm_head.weight.grad is not None
        trainer.zero_grad()
        assert trainer.config._attn_implementation == attn

    prompts = random_prompts(2, 5, 12, seed=12)
    with make_engine(trainer) as engine:
        trainer_forward_matches_fresh()
        batch = engine.generate(prompts, temps=0.0, max_new_tokens=8)
        assert rows(batch) == [hf_greedy(model, p, 8) for p in prompts]  # no dropout in the engine
        assert {n: p.requires_grad for n, p in trainer.named_parameters()} == grads
        assert {n: m.training for n, m in trainer.named_modules()} == modes

        # while the engine is generating in another thread
        result = {}
        worker = threading.Thread(target=lambda: result.setdefault(
            "batch", engine.generate(prompts, temps=1.0, group_size=2, max_new_tokens=120, seed=0)))
        start = engine.cache_stats()["generated_tokens"]
        worker.start()
        while engine.cache_stats()["generated_tokens"] == start and worker.is_alive():
            time.sleep(0.001)
        overlapped = 0
        while worker.is_alive() and overlapped < 3:
            trainer_forward_matches_fresh()
            overlapped += worker.is_alive()
        worker.join()
        assert overlapped >= 1, "the engine finished before a trainer forward could overlap it"
        assert len(result["batch"]) == 4
    trainer_forward_matches_fresh()
    assert {n: p.requires_grad for n, p in trainer.named_parameters()} == grads
    assert {n: m.training for n, m in trainer.named_modules()} == modes


# -------------------------------------------------------------------------------------- 7. bf16


def test_bf16_engine_updated_from_fp32_trainer(model, new_model):
    trainer = copy.deepcopy(new_model)  # fp32 policy
    engine_model = copy.deepcopy(model).to(torch.bfloat16)
    prompts = random_prompts(4, 8, 16, seed=13)
    with make_engine(engine_model) as engine:
        assert engine.update_weights(trainer) == 1
        for (name, p), q in zip(engine_model.named_parameters(), trainer.parameters(), strict=True):
            assert p.dtype == torch.bfloat16
            assert torch.equal(p, q.to(torch.bfloat16)), name
        batch = engine.generate(prompts, temps=1.0, group_size=3, max_new_tokens=12, seed=0)
    # the parity probe: rollout (bf16) logprobs against the fp32 trainer's recomputation of the same tokens
    gaps = []
    for row, completion in enumerate(rows(batch)):
        ref = teacher_forced_logprobs(trainer, prompts[row // 3], completion)
        gaps += (batch.logprobs[row, : len(completion)] - ref).abs().tolist()
    print(f"\nfp32 trainer vs bf16 engine logprob gap over {len(gaps)} tokens: "
          f"max {max(gaps):.4f}, mean {statistics.fmean(gaps):.4f}")
    assert 0 < max(gaps) < 1.0 and statistics.fmean(gaps) < 0.2


# ------------------------------------------------------------------------------- 8. sleep / wake


@pytest.mark.parametrize("decode", ["paged_kernel", "gather"])
def test_sleep_releases_and_wake_regains_the_cache(model, monkeypatch, decode):
    """Default CPU decode (the paged kernel) and the gather + SDPA path (no compiler)."""
    monkeypatch.setenv("ROLLOUT_CPU_KERNELS", "1" if decode == "paged_kernel" else "0")
    prompts = random_prompts(2, 20, 30, seed=14)
    want = [hf_greedy(model, p, 8) for p in prompts]
    with make_engine(model, page_size=16, num_blocks=256) as engine:
        assert rows(engine.generate(prompts, temps=0.0, max_new_tokens=8)) == want
        held = engine.cache_stats()["kv_bytes"]
        assert held > 0
        freed = engine.sleep()
        print(f"\nsleep() freed {freed} bytes of KV cache ({freed / 2**20:.2f} MiB)")
        assert freed == held
        assert engine.cache_stats()["kv_bytes"] == 0
        assert engine.wake() == held == engine.cache_stats()["kv_bytes"]
        assert rows(engine.generate(prompts, temps=0.0, max_new_tokens=8)) == want
        assert rows(engine.generate(prompts, temps=0.0, max_new_tokens=8)) == want  # prefix hits after wake
        # generate() while asleep wakes the engine
        assert engine.sleep() == held
        batch = engine.generate(prompts, temps=0.0, max_new_tokens=8)
        assert rows(batch) == want
        assert engine.cache_stats()["kv_bytes"] == held
        assert engine.cache_stats()["free_blocks"] == engine.cache_stats()["num_blocks"]


def test_sleep_frees_the_default_cache(model):
    with make_engine(model, page_size=256) as engine:
        engine.generate([[1, 2, 3]], temps=0.0, max_new_tokens=2)
        held = engine.cache_stats()["kv_bytes"]
        freed = engine.sleep()
        print(f"\ndefault config: sleep() freed {freed} bytes ({freed / 2**20:.0f} MiB)")
        assert freed == held and held > 0
        assert engine.cache_stats()["kv_bytes"] == 0
        engine.wake()
        assert engine.cache_stats()["kv_bytes"] == held


# ------------------------------------------------------------------ 9. in flight and bad input


def start_generate(engine, prompts, **kwargs):
    result: dict = {}

    def work():
        try:
            result["batch"] = engine.generate(prompts, **kwargs)
        except Exception as e:  # pragma: no cover - reported by the test
            result["error"] = e

    start = engine.cache_stats()["generated_tokens"]
    worker = threading.Thread(target=work)
    worker.start()
    while engine.cache_stats()["generated_tokens"] < start + 2 * len(prompts) and worker.is_alive():
        time.sleep(0.001)
    return worker, result


def test_update_in_flight_abort_cancels_partial_outputs(model, new_model):
    prompts = random_prompts(4, 5, 12, seed=15)
    with make_engine(copy.deepcopy(model)) as engine:
        worker, result = start_generate(engine, prompts, temps=1.0, max_new_tokens=400, seed=0)
        version = engine.update_weights(new_model.state_dict(), in_flight="abort")
        worker.join(30)
        assert not worker.is_alive()
        assert "error" not in result, result.get("error")
        batch = result["batch"]
        assert batch.finish_reasons == ["cancelled"] * 4
        lengths = batch.completion_mask.sum(1)
        assert lengths.sum() > 0 and (lengths < 400).all()
        check_layout(batch, prompts, [1.0] * 4, 1, 400)
        assert batch.policy_version == version - 1
        # the engine keeps working, on the new weights
        assert engine.cache_stats()["free_blocks"] == engine.cache_stats()["num_blocks"]
        after = engine.generate(prompts, temps=0.0, max_new_tokens=6)
        assert rows(after) == [hf_greedy(new_model, p, 6) for p in prompts]
        assert after.policy_version == version


def test_update_in_flight_wait_by_default_waits_for_the_running_generate(model, new_model):
    prompts = random_prompts(3, 5, 12, seed=16)
    with make_engine(copy.deepcopy(model)) as engine:
        start = engine.cache_stats()["generated_tokens"]
        worker, result = start_generate(engine, prompts, temps=0.0, max_new_tokens=40)
        version = engine.update_weights(new_model.state_dict())
        assert engine.cache_stats()["generated_tokens"] - start == 3 * 40  # it finished first
        worker.join(30)
        batch = result["batch"]
        assert batch.finish_reasons == ["length"] * 3
        assert batch.policy_version == version - 1
        assert rows(batch) == [hf_greedy(model, p, 40) for p in prompts]  # entirely the old weights


def test_bad_inputs_raise_value_error(model):
    with make_engine(model) as engine:
        free = engine.cache_stats()["free_blocks"]
        with pytest.raises(ValueError, match="temps"):
            engine.generate([[1, 2], [3, 4]], temps=[1.0, 1.0, 1.0])
        with pytest.raises(ValueError, match="temp"):
            engine.generate([[1, 2]], temps=-0.5)
        with pytest.raises(ValueError, match="temp"):
            engine.generate([[1, 2]], temps=[float("nan")])
        with pytest.raises(ValueError, match="temps must be a non-negative number"):  # the server's rule too
            engine.generate([[1, 2]], temps=float("inf"))
        with pytest.raises(ValueError, match="group_size"):
            engine.generate([[1, 2]], group_size=0)
        with pytest.raises(ValueError, match="tokenizer"):
            engine.generate(["hello"])
        with pytest.raises(ValueError, match="top_p"):
            engine.generate([[1, 2]], top_p=0.0)
        # a bad prompt after good ones: nothing is left running
        with pytest.raises(ValueError, match="vocabulary"):
            engine.generate([[1, 2, 3], [1, 10_000]], group_size=2, max_new_tokens=4)
        assert engine.cache_stats()["free_blocks"] == free
        batch = engine.generate([[1, 2, 3]], temps=0.0, max_new_tokens=4)
        assert rows(batch) == [hf_greedy(model, [1, 2, 3], 4)]
    with pytest.raises(RuntimeError, match="closed"):
        engine.generate([[1, 2]])
