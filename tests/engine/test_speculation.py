"""Lossless n-gram speculative decoding (issue 44, `rollout.engine.speculation`): greedy tokens identical to HF
`generate` and to the engine without speculation on the 7 architectures, logprobs the teacher-forced ones, drafts
accepted (random tiny models loop), pages given back; the drafts' sources (own context, group siblings, the
prompt's earlier rollouts); the per-request prompt-lookup fields; and the distribution of sampled rows (the
exact joint law of a tiny-vocabulary model, chi-square over thousands of seeded rows, a wrong acceptance rule
shown to fail it)."""

from __future__ import annotations

import itertools

import pytest
import torch
from support.distributions import chi_square_pvalue
from support.greedy import ARCHS
from support.sampling import repeating_prompt
from support.tiny_models import hf_greedy, make_model, random_prompts, teacher_forced_logprobs
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

from rollout.config import ContinuousBatchingConfig
from rollout.engine.core import EngineCore
from rollout.engine.speculation import StepCost
from rollout.sampling.speculative import ACCEPTANCE

pytestmark = pytest.mark.timeout(900)
MAX_NEW = 64
SPEC = dict(speculative_method="ngram", num_speculative_tokens=4)
GREEDY = GenerationConfig(do_sample=False, eos_token_id=None, max_new_tokens=MAX_NEW)


def run(model, prompts, config: ContinuousBatchingConfig, gc=GREEDY, core=None, gate: int | None = 64, **kw):
    """Drive a core over `prompts` to completion; returns (requests, core). `gate`: every drafted row of a step of
    at most that many rows is verified (the verification under test, whatever the timing-fed cost model would
    choose on a loaded box); None: the cost model chooses."""
    if core is None:
        core = EngineCore(model, gc, config)
        if core.speculator is not None:
            core.speculator.max_rows = gate
    reqs = [core.make_request(p, **{k: (v[i] if isinstance(v, list) else v) for k, v in kw.items()})
            for i, p in enumerate(prompts)]
    for r in reqs:
        core.add(r)
    for _ in range(10_000):
        if not core.has_work():
            return reqs, core
        core.step()
    raise AssertionError("engine made no progress")


def config(**kw) -> ContinuousBatchingConfig:
    return ContinuousBatchingConfig(page_size=16, num_blocks=96, return_logprobs=True, **kw)


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_tokens_and_logprobs_equal_without_speculation(arch):
    model = make_model(arch)
    prompts = [repeating_prompt(model, seed=s) for s in range(2)] + random_prompts(2, 5, 40, seed=3)
    base, _ = run(model, prompts, config())
    spec, core = run(model, prompts, config(**SPEC))
    # NOTE: the same prompts again (a later epoch): the first rollouts draft for them, so drafts are accepted
    # even where this random model does not loop
    again, core = run(model, prompts, config(**SPEC), core=core)
    stats = core.cache_stats()
    for p, a, b, c in zip(prompts, base, spec, again, strict=True):
        assert b.generated == c.generated == hf_greedy(model, p, MAX_NEW) == a.generated
        tf = teacher_forced_logprobs(model, p, b.generated)
        for x in (b, c):
            assert (torch.tensor(x.logprobs) - tf).abs().max() < 1e-4  # NOTE: the suite's fp32 logprob bound
            assert (torch.tensor(x.logprobs) - torch.tensor(a.logprobs)).abs().max() < 5e-5
            assert x.versions == a.versions and x.finish_reason == a.finish_reason == "length"
    assert stats["spec_accepted_tokens"] > len(prompts) * MAX_NEW // 2, stats
    assert stats["spec_draft_tokens"] >= stats["spec_accepted_tokens"]
    assert stats["generated_tokens"] == 2 * len(prompts) * MAX_NEW
    assert stats["free_blocks"] == stats["num_blocks"]  # NOTE: rejected drafts' pages came back


def test_greedy_top_logprobs_equal_without_speculation():
    """Top-k logprobs of greedy rows (the verification's one sampler call over the kept positions) are the plain
    step's, token for token, where drafts are kept."""
    model = make_model("llama")
    prompts = [repeating_prompt(model, seed=s) for s in range(2)]
    base, _ = run(model, prompts, config(), top_logprobs=3)
    _, core = run(model, prompts, config(**SPEC), top_logprobs=3)
    spec, core = run(model, prompts, config(**SPEC), core=core, top_logprobs=3)  # NOTE: history drafts: kept
    assert core.cache_stats()["spec_accepted_tokens"] > 0
    for a, b in zip(base, spec, strict=True):
        x, y = a.to_output(), b.to_output()
        assert b.generated == a.generated and len(y.top_ids) == len(x.top_ids) == MAX_NEW
        assert y.top_ids == x.top_ids
        assert (torch.tensor(y.top_logprobs) - torch.tensor(x.top_logprobs)).abs().max() < 5e-5


def test_a_kept_draft_that_is_eos_ends_the_row_there():
    """A drafted token kept by verification that is the row's EOS ends the row at it, as a plain step would: no
    kept draft after it is appended."""
    model = make_model("llama")
    prompts = [repeating_prompt(model, seed=s) for s in range(2)]
    full, core = run(model, prompts, config(**SPEC))  # NOTE: the history the second run drafts from
    eos = [next(t for j, t in enumerate(r.generated) if j >= 6 and t not in r.generated[:j]) for r in full]
    base, _ = run(model, prompts, config(), eos_token_ids=[[e] for e in eos])
    spec, core = run(model, prompts, config(**SPEC), core=core, eos_token_ids=[[e] for e in eos])
    assert core.cache_stats()["spec_accepted_tokens"] > 0
    for a, b, e in zip(base, spec, eos, strict=True):
        assert b.generated == a.generated and b.generated[-1] == e and len(b.generated) < MAX_NEW
        assert b.finish_reason == a.finish_reason == "stop" and len(b.logprobs) == len(b.generated)


def test_float64_logprobs_within_1e5():
    """With rounding out of the way (fp64), the speculative logprobs are the plain step's to 1e-5."""
    model = make_model("llama", dtype=torch.float64)
    prompts = [repeating_prompt(model, seed=s) for s in range(2)]
    base, _ = run(model, prompts, config(attn_backend="sdpa"))
    _, core = run(model, prompts, config(attn_backend="sdpa", **SPEC))
    spec, core = run(model, prompts, config(attn_backend="sdpa", **SPEC), core=core)  # NOTE: history drafts
    for a, b in zip(base, spec, strict=True):
        assert a.generated == b.generated
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs, strict=True)) < 1e-5
    assert core.cache_stats()["spec_accepted_tokens"] > 0


def test_history_drafts():
    """A prompt sampled again (a later epoch) drafts from its earlier rollouts: nearly every token is accepted.
    Tokens stay the greedy ones."""
    model = make_model("qwen3")
    prompt = random_prompts(1, 20, 20, seed=7)[0]
    want = hf_greedy(model, prompt, MAX_NEW)
    first, core = run(model, [prompt], config(**SPEC))
    before = dict(core.cache_stats())
    again, core = run(model, [prompt], config(**SPEC), core=core)
    stats = core.cache_stats()
    assert first[0].generated == again[0].generated == want
    accepted = stats["spec_accepted_tokens"] - before["spec_accepted_tokens"]
    # NOTE: after the prefill's token, each step emits at most 4 kept drafts and 1 token of its own
    assert accepted >= 0.9 * (MAX_NEW - 1) * 4 / 5, (accepted, before, stats)


def test_group_sibling_drafts():
    """A row of a group that starts late drafts from its sibling's live completion (only it speculates here)."""
    model = make_model("qwen3")
    prompt = random_prompts(1, 20, 20, seed=8)[0]
    want = hf_greedy(model, prompt, MAX_NEW)
    core = EngineCore(model, GREEDY, config())
    core.speculator.max_rows = 64
    ahead = core.make_request(prompt)
    core.add(ahead)
    for _ in range(40):
        core.step()
    (late,), core = run(model, [prompt], config(), core=core, prompt_lookup_num_tokens=4)
    assert ahead.generated == late.generated == want
    stats = core.cache_stats()
    assert stats["spec_accepted_tokens"] >= 30, stats  # NOTE: its first 40 tokens are the sibling's


def test_rejected_drafts_give_their_pages_back_at_once():
    """After every step each running row holds exactly the pages of its computed tokens (as a plain step
    leaves it): a rejected draft's pages go back to the pool in the step that rejected it."""
    model = make_model("llama")  # NOTE: its drafts are mostly rejected
    prompts = [repeating_prompt(model, seed=s) for s in range(2)] + random_prompts(2, 5, 40, seed=3)
    core = EngineCore(model, GREEDY, ContinuousBatchingConfig(page_size=4, num_blocks=256, **SPEC))
    core.speculator.max_rows = 64
    for p in prompts:  # NOTE: 1-token suffixes: a draft at most steps, most of them rejected
        core.add(core.make_request(p, max_matching_ngram_size=1))
    while core.has_work():
        core.step()
        held = sum(len(r.page_ids) for r in core.scheduler.running)
        for r in core.scheduler.running:
            assert len(r.page_ids) == core.page_pool.pages_needed(r.num_computed_tokens), r.request_id
        assert core.page_pool.num_free_pages >= core.page_pool.num_pages - held
    stats = core.cache_stats()
    assert stats["spec_draft_tokens"] - stats["spec_accepted_tokens"] >= 20, stats


def test_budget_and_eos_stop_inside_a_draft():
    """A draft running past `max_new_tokens` or through an EOS stops exactly where plain decoding stops."""
    model = make_model("gemma2")  # NOTE: its random model loops at once: whole drafts are accepted
    prompts = random_prompts(3, 5, 20, seed=2)
    base, _ = run(model, prompts, config(), max_new_tokens=[7, 30, 61])
    eos = base[1].generated[12]
    gc = GenerationConfig(do_sample=False, eos_token_id=eos, max_new_tokens=MAX_NEW)
    for cfg in (config(), config(**SPEC)):
        reqs, core = run(model, prompts, cfg, gc=gc, max_new_tokens=[7, 30, 61])
        if cfg.speculative_method:
            spec = reqs
        else:
            plain = reqs
    for a, b in zip(plain, spec, strict=True):
        assert a.generated == b.generated and a.finish_reason == b.finish_reason
        assert a.logprobs == pytest.approx(b.logprobs, abs=5e-5)
    assert core.cache_stats()["spec_accepted_tokens"] > 0
    assert core.cache_stats()["free_blocks"] == core.cache_stats()["num_blocks"]


def test_per_request_prompt_lookup_fields():
    """transformers' `prompt_lookup_num_tokens` / `max_matching_ngram_size` turn speculation on for a request
    of an engine without it (same tokens); bad values and bad configs are errors naming the field."""
    model = make_model("gemma2")
    prompts = random_prompts(2, 5, 20, seed=4)
    plain, core = run(model, prompts, config())
    assert core.cache_stats()["spec_draft_tokens"] == 0
    asked, core = run(model, prompts, config(), prompt_lookup_num_tokens=[3, 0], max_matching_ngram_size=2)
    assert [r.generated for r in asked] == [r.generated for r in plain]
    assert core.cache_stats()["spec_accepted_tokens"] > 0
    gc = GenerationConfig(do_sample=False, eos_token_id=None, max_new_tokens=20, prompt_lookup_num_tokens=2)
    from_gc, core = run(model, prompts, config(), gc=gc)
    assert [r.generated for r in from_gc] == [r.generated[:20] for r in plain]
    assert core.cache_stats()["spec_draft_tokens"] > 0
    with pytest.raises(ValueError, match="prompt_lookup_num_tokens"):
        core.make_request(prompts[0], prompt_lookup_num_tokens=-1)
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        ContinuousBatchingConfig(speculative_method="ngram")
    with pytest.raises(ValueError, match="speculative_method"):
        ContinuousBatchingConfig(speculative_method="medusa", num_speculative_tokens=2)


def test_cost_model_in_charge():
    """No fixed gate: the cost model (`StepCost`, fed by the steps' measured times) verifies the drafts of rows whose
    text loops, tokens unchanged, and times both kinds of step; told that a drafted token costs as much as a row's
    whole step (compute-bound), it drafts nothing."""
    model = make_model("gemma2")  # NOTE: its random model loops at once: likely drafts
    prompts = random_prompts(3, 5, 20, seed=2)
    base, _ = run(model, prompts, config())
    spec, core = run(model, prompts, config(**SPEC), gate=None)
    assert [r.generated for r in spec] == [r.generated for r in base]
    stats = core.cache_stats()
    assert stats["spec_accepted_tokens"] > 0, stats
    assert core.speculator.cost.plain, "no plain step was timed"
    core = EngineCore(model, GREEDY, config(**SPEC))
    core.speculator.cost = StepCost(0.0, 1.0)
    dear, core = run(model, prompts, config(**SPEC), core=core)
    assert [r.generated for r in dear] == [r.generated for r in base]
    assert core.cache_stats()["spec_draft_tokens"] == 0


def test_a_verifying_step_runs_no_more_tokens_than_its_room():
    """A verifying step runs at most `Speculator.room` tokens, rows and drafts (on a CPU the small-M kernel's rows:
    past them the step leaves the C++ decoder layers), the likeliest drafts kept; a step of that many rows or more
    runs plain. Tokens unchanged."""
    model = make_model("gemma2")  # NOTE: its random model loops at once: every row drafts
    prompts = random_prompts(6, 5, 20, seed=3)
    lens = [16, 24, 32, 40, 48, MAX_NEW]  # NOTE: the batch narrows as its rows end
    base, _ = run(model, prompts, config(), max_new_tokens=lens)
    runs = {}
    for room in (None, 10, 4):
        core = EngineCore(model, GREEDY, config(**SPEC))
        core.speculator.cost = StepCost(1.0, 0.0)  # NOTE: drafted tokens priced at nothing: all kept but for room
        core.speculator.room = room
        sizes, execute = [], core.runner.execute

        def counted(out, drafts=None, _execute=execute, _sizes=sizes):
            if drafts is not None:
                _sizes.append((len(drafts), len(drafts) + sum(map(len, drafts))))
            return _execute(out, drafts)

        core.runner.execute = counted
        spec, core = run(model, prompts, config(**SPEC), core=core, max_new_tokens=lens)
        assert [r.generated for r in spec] == [r.generated for r in base], room
        runs[room] = sizes
    assert max(t for _, t in runs[None]) > 10, runs[None]  # NOTE: unbounded, 6 rows x (1 + 4) run
    assert runs[10] and max(t for _, t in runs[10]) <= 10 and max(t for _, t in runs[10]) == 10
    assert runs[4] and all(b < 4 for b, _ in runs[4]) and max(t for _, t in runs[4]) <= 4
    assert EngineCore(model, GREEDY, config(**SPEC)).speculator.room is None  # NOTE: tiny linears: torch's
    from rollout.kernels import cpu_kernels, linear

    if cpu_kernels.small_linear() is None:
        pytest.skip("rollout's small-M kernel is unavailable here (no AVX-512 or no build)")
    cfg = Qwen3Config(hidden_size=256, intermediate_size=512, num_hidden_layers=1, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=64, vocab_size=512)
    wide = Qwen3ForCausalLM(cfg).eval()  # NOTE: 256 x 256 fp32 linears: the small-M kernel's
    assert EngineCore(wide, GREEDY, config(**SPEC)).speculator.room == linear.SMALL_ROWS


def test_a_step_is_timed_alone_not_with_what_runs_between_steps():
    """The cost model's times are each step's own, from its start (planning included) to its end: a caller that
    spends 50 ms between steps (another engine in the same process, a trainer's own work) moves neither the plain
    steps' times nor the verifying steps' -- timed up to the next step's start instead, every one of them took
    those 50 ms too, and a drafted token's price, relative to a plain step, shrank with them. (Medians, so that one
    slow step on a loaded box does not fail it; a step of this tiny model takes a few ms.)"""
    import statistics
    import time

    between = 0.05

    model = make_model("gemma2")  # NOTE: its random model loops at once: verifying steps and plain ones
    prompts = random_prompts(3, 5, 20, seed=2)
    core = EngineCore(model, GREEDY, config(**SPEC))
    cost, timed = core.speculator.cost, {"plain": [], "spec": []}
    plain, spec = cost.observe_plain, cost.observe_spec

    def observe_plain(rows, seconds):
        timed["plain"].append(seconds)
        plain(rows, seconds)

    def observe_spec(rows, extra, seconds):
        timed["spec"].append(seconds)
        spec(rows, extra, seconds)

    cost.observe_plain, cost.observe_spec = observe_plain, observe_spec
    reqs = [core.make_request(p, max_new_tokens=24) for p in prompts]
    for r in reqs:
        core.add(r)
    while core.has_work():
        core.step()
        time.sleep(between)
    assert timed["plain"] and timed["spec"], timed
    assert statistics.median(timed["plain"]) < between / 2 and statistics.median(timed["spec"]) < between / 2, timed
    assert max(cost.plain.values()) < between, cost.plain
    assert all(r.status.is_final for r in reqs)


# ------------------------------------------------------------------------------------ the distribution test
V = 5  # NOTE: a vocabulary small enough to enumerate the joint law of the generated tokens exactly
PROMPT = [1, 2, 3, 1, 2, 4, 0, 1, 2]
NEW = 4  # the first token from the prefill step, the next three from one speculative step (2 drafts + bonus)
SAMPLING = dict(temperature=0.9, top_k=4, repetition_penalty=1.3)
ROWS = 4000


def tiny_vocab_model() -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=64, initializer_range=0.1)
    return LlamaForCausalLM(cfg).eval()


def processed(logits: torch.Tensor, history: list[int]) -> torch.Tensor:
    """The reference of the sampled law at one position: repetition penalty over prompt + generated, then
    temperature, then top-k (fp64 probabilities [V])."""
    x = logits.double().clone()
    seen = torch.tensor(sorted(set(history)))
    pen = SAMPLING["repetition_penalty"]
    x[seen] = torch.where(x[seen] < 0, x[seen] * pen, x[seen] / pen)
    x = x / SAMPLING["temperature"]
    kth = x.topk(SAMPLING["top_k"]).values[-1]
    x = x.masked_fill(x < kth, float("-inf"))
    return x.softmax(-1)


@torch.no_grad()
def joint_law(model) -> torch.Tensor:
    """P(t1..t4) [V**4] under the sampler's processed law, by teacher forcing every prefix."""
    probs = torch.ones(1, dtype=torch.float64)
    seqs: list[tuple[int, ...]] = [()]
    for _ in range(NEW):
        ids = torch.tensor([PROMPT + list(s) for s in seqs])
        last = model(ids).logits[:, -1].float()  # [S, V]
        step = torch.stack([processed(last[i], PROMPT + list(s)) for i, s in enumerate(seqs)])  # [S, V]
        probs = (probs[:, None] * step).flatten()
        seqs = [s + (t,) for s in seqs for t in range(V)]
    return probs


def sample_rows(model, spec: bool, rule: str = "exact", seed_stream: str = "auto"):
    cfg = ContinuousBatchingConfig(
        page_size=16,
        num_blocks=ROWS + 64,
        max_batch_tokens=4 * ROWS,
        seed_stream=seed_stream,
        **(dict(speculative_method="ngram", num_speculative_tokens=2) if spec else {}),
    )
    core = EngineCore(model, GenerationConfig(do_sample=True, eos_token_id=None, max_new_tokens=NEW), cfg)
    if spec:
        core.speculator.max_rows = ROWS  # NOTE: past the cost model, so every row of this batch speculates
        core.speculator.rule = ACCEPTANCE[rule]
    # NOTE: drafts from 1-grams too (`max_matching_ngram_size=1`): a draft at nearly every position
    reqs, core = run(model, [PROMPT] * ROWS, cfg, gc=core.generation_config, core=core, seed=list(range(ROWS)),
                     max_matching_ngram_size=1, **SAMPLING)
    return [tuple(r.generated) for r in reqs], core.cache_stats()


@pytest.fixture(scope="module")
def law_and_model():
    model = tiny_vocab_model()
    return model, joint_law(model)


def counts(samples) -> torch.Tensor:
    index = {s: i for i, s in enumerate(itertools.product(range(V), repeat=NEW))}
    c = torch.zeros(V**NEW, dtype=torch.float64)
    for s in samples:
        c[index[s]] += 1
    return c


def test_sampled_rows_follow_the_target_joint_law(law_and_model):
    model, law = law_and_model
    spec, stats = sample_rows(model, spec=True)
    assert stats["spec_draft_tokens"] >= ROWS and stats["spec_accepted_tokens"] > ROWS // 4, stats
    assert law[counts(spec) > 0].min() > 0, "a sampled sequence has probability 0"
    _, p = chi_square_pvalue(counts(spec), law)
    assert p > 1e-6, p
    # NOTE: one draw of a row's seeded stream per emitted token, as plain decoding: the same samples
    plain, _ = sample_rows(model, spec=False)
    assert spec == plain


@pytest.mark.slow  # NOTE: ~55 s on 2 loaded cores; the sampler's own chi-square tests cover the counter stream fast
def test_the_counter_stream_follows_the_joint_law_too(law_and_model):
    """`seed_stream="counter"` (rollout.sampling.seeding): the same law, and with speculation the same samples as
    without (the counter's position is the emitted token's)."""
    model, law = law_and_model
    spec, stats = sample_rows(model, spec=True, seed_stream="counter")
    assert stats["spec_accepted_tokens"] > ROWS // 4, stats
    _, p = chi_square_pvalue(counts(spec), law)
    assert p > 1e-6, p
    plain, _ = sample_rows(model, spec=False, seed_stream="counter")
    assert spec == plain


def test_a_wrong_acceptance_rule_fails_the_law(law_and_model):
    """Resampling from the whole target on a rejection over-samples the draft token: the test catches it."""
    model, law = law_and_model
    wrong, stats = sample_rows(model, spec=True, rule="resample_target")
    assert stats["spec_draft_tokens"] >= ROWS
    _, p = chi_square_pvalue(counts(wrong), law)
    assert p < 1e-6, p


def _lookups(rows: int) -> dict[str, list[int]]:
    """The steps at which each of `rows` greedy rows was looked up, a drafter that finds nothing but for r1's 5th to
    7th lookups (a one-token draft)."""
    model = make_model("qwen3")
    core = EngineCore(model, GREEDY, config(**SPEC))
    spec = core.speculator
    spec.max_rows = 64
    looked: dict[str, list[int]] = {}

    def draft(req):
        steps = looked.setdefault(req.request_id, [])
        steps.append(spec.steps)
        if req.request_id == "r1" and len(steps) in (5, 6, 7):  # NOTE: r1's 5th-7th lookups find a draft
            return [1], [1.0]
        return [], []

    spec.native_plan = False  # NOTE: planned in Python, through `Drafter.draft_many`
    spec.drafter.draft_many = lambda reqs, ks, ns, mins: [draft(r) for r in reqs]
    reqs = [core.make_request(p, request_id=f"r{i}") for i, p in enumerate(random_prompts(rows, 5, 20, seed=1))]
    for r in reqs:
        core.add(r)
    while core.has_work():
        core.step()
    return looked


def test_rows_whose_text_does_not_repeat_are_looked_up_in_doubling_idle_spells():
    """Past `LOOKUP_ROWS` rows a row whose lookup found nothing waits 1, 2, 4, ... steps (at most `IDLE_MAX` x width
    / `IDLE_ROWS`) before the next lookup, so text that never repeats costs a lookup every few steps, not every
    step; a row that drafts again is looked up at the next step."""
    from rollout.engine import speculation

    looked = _lookups(speculation.LOOKUP_ROWS + 2)
    assert looked["r0"][:5] == [looked["r0"][0] + d for d in (0, 1, 3, 7, 15)]  # NOTE: spells of 1, 2, 4, 8
    gaps = [b - a for a, b in itertools.pairwise(looked["r0"])]
    assert max(gaps) == speculation.IDLE_MAX and len(looked["r0"]) < MAX_NEW // 4
    r1 = looked["r1"]
    assert r1[:5] == looked["r0"][:5] and r1[5:8] == [r1[4] + 1, r1[4] + 2, r1[4] + 3] and r1[8] == r1[7] + 1
    assert r1[9] == r1[8] + 2  # NOTE: found nothing again: a new spell, from 1


def test_a_tail_of_few_rows_looks_every_row_up_every_step():
    """At most `LOOKUP_ROWS` rows (a batch's tail), no spells: each row is looked up at every decode step."""
    from rollout.engine import speculation

    looked = _lookups(speculation.LOOKUP_ROWS)
    assert len(looked) == speculation.LOOKUP_ROWS
    for steps in looked.values():
        assert len(steps) > MAX_NEW // 2 and steps == list(range(steps[0], steps[0] + len(steps)))


@pytest.mark.parametrize("gate", [None, 64])
def test_planning_in_cpp_proposes_what_the_python_planning_does(gate):
    """`Speculator._plan_native` (one C++ call a step: `plan_drafts`, each row's k, calibration and idle spell kept on
    its index) against the Python planning it replaces (`_drafts`, the idle dict, `Calibration`, `StepCost.plan`):
    two engines, the cost model's fit frozen, the same rows -- 4 groups of 4 over repeating and random prompts,
    per-request k and suffix length, a step's room for drafts binding, budgets from 3 tokens (rows finish and join
    their prompt's history, rows reach their last token), the prompts sampled again -- propose the same drafts at
    every step; idle spells, calibrations and verified drafts all occur."""
    model = make_model("qwen3")
    prompts = [repeating_prompt(model, seed=s) for s in range(2)] + random_prompts(2, 5, 30, seed=11)
    cores, logs = [], []
    for native in (True, False):
        core = EngineCore(model, GREEDY, config(**SPEC))
        spec = core.speculator
        spec.max_rows, spec.native_plan = gate, native
        spec.room = 20  # NOTE: at most 20 tokens (rows + drafted) a verifying step: the budget of the likeliest binds
        spec.cost.observe_plain = spec.cost.observe_spec = lambda *a: None  # NOTE: decisions from the drafts alone
        log, inner = [], spec.plan

        def plan(rows, spec=spec, inner=inner, log=log):
            drafts = inner(rows)
            own = spec.drafter.own
            if spec.planned_native:
                state = sorted((r.request_id, own[r.request_id].native.spell, own[r.request_id].native.scale)
                               for r in rows if r.request_id in own)
                spells = sum(s > 0 for _, s, _ in state)
                scaled = sum(c != 1.0 for _, _, c in state)
            else:
                spells = len(spec.idle)
                scaled = sum(spec.calibration.scale(r.request_id) != 1.0 for r in rows)
            log.append(([r.request_id for r in rows], drafts, spells, scaled))
            return drafts

        spec.plan = plan
        for epoch in range(2):
            reqs = [core.make_request(p, request_id=f"e{epoch}p{i}g{g}", max_new_tokens=3 + 13 * g + 7 * i,
                                      prompt_lookup_num_tokens=2 if g == 1 else None,
                                      max_matching_ngram_size=2 if g == 2 else None)
                    for i, p in enumerate(prompts) for g in range(4)]
            for r in reqs:
                core.add(r)
            while core.has_work():
                core.step()
        cores.append(core)
        logs.append(log)
    native, python = logs
    assert len(native) == len(python) > 50
    for step, (a, b) in enumerate(zip(native, python, strict=True)):
        assert a[:2] == b[:2], f"step {step}: rows or drafts differ"
    assert sum(len(d) for _, ds, _, _ in native if ds for d in ds) > 100
    assert max(s for _, _, s, _ in native) > 0 and max(s for _, _, s, _ in python) > 0  # NOTE: idle spells
    assert max(c for *_, c in native) > 0 and max(c for *_, c in python) > 0  # NOTE: calibrated estimates
    assert cores[0].cache_stats()["spec_accepted_tokens"] == cores[1].cache_stats()["spec_accepted_tokens"] > 0
