"""Batch-invariant mode (`ContinuousBatchingConfig(batch_invariant=True)`, `RLConfig.batch_invariant`).

Oracles: the same request run alone (bitwise), the engine's own logprobs (the trainer's pass must give the
same bits), autograd of the ordinary forward (gradients, within fp tolerance), and the default mode as a
control (it must differ somewhere, or the bitwise checks prove nothing).
"""

from __future__ import annotations

import importlib.util
import json
import random
import sys
from pathlib import Path

import pytest
import torch
from support.tiny_models import CONFIGS, VOCAB, make_model, random_prompts
from transformers import GenerationConfig

from rollout import ContinuousBatchingConfig, RolloutEngine
from rollout.engine.core import EngineCore
from rollout.invariant.forward import InvariantForward
from rollout.invariant.ops import tiled_linear
from trainers.common import completion_forward, disable_dropout, scored_logprobs

GC = GenerationConfig(do_sample=True, eos_token_id=None, max_new_tokens=8)
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
# NOTE: pages of the mixed run, small enough that it preempts (sliding-window models recycle pages)
MIXED_PAGES = {"gemma2": 16, "mistral": 10}


def _run(model, specs, **config) -> tuple[list, dict]:
    """Each spec (prompt, temperature, seed, max_new_tokens) as one request; (outputs, cache stats)."""
    core = EngineCore(model, GC, ContinuousBatchingConfig(page_size=8, return_logprobs=True, **config))
    reqs = []
    for i, (prompt, temperature, seed, n) in enumerate(specs):
        reqs.append(
            core.make_request(
                prompt, request_id=f"r{i}", temperature=temperature, seed=seed, max_new_tokens=n
            )
        )
        core.add(reqs[-1])
    while core.has_work():
        core.step()
    return [r.to_output() for r in reqs], core.cache_stats()


def _alone_and_mixed(model, invariant: bool, offload: bool, pages: int = 12, seed: int = 0):
    """The target request alone, then inside a random mixed batch: small token budget (other chunk
    boundaries), a warm prefix cache (its first 3 pages were computed by earlier requests), a small cache
    (preemption: recomputed, or offloaded when `offload`), greedy and sampled neighbours."""
    rng = random.Random(seed)
    prefix = [rng.randrange(1, VOCAB) for _ in range(27)]
    target = (prefix + [5, 6, 7], 1.0, 1234, 10)
    alone, _ = _run(model, [target], num_blocks=64, max_batch_tokens=256, batch_invariant=invariant)
    others = [
        (
            [rng.randrange(1, VOCAB) for _ in range(rng.randrange(3, 50))],
            rng.choice([0.0, 0.7, 1.0]),
            rng.randrange(1000),
            rng.randrange(4, 16),
        )
        for _ in range(7)
    ]
    sharers = [
        (prefix + [rng.randrange(1, VOCAB) for _ in range(rng.randrange(1, 6))], 1.0, 7 + i, 6)
        for i in range(3)
    ]
    specs = sharers + others[:3] + [target] + others[3:]
    mixed, stats = _run(
        model,
        specs,
        num_blocks=pages,
        max_batch_tokens=24,
        batch_invariant=invariant,
        cpu_offload_space=0.01 if offload else 0.0,
    )
    return alone[0], mixed[len(sharers) + 3], stats


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("arch", sorted(CONFIGS))
def test_a_request_is_bitwise_the_same_alone_and_in_a_mixed_batch(arch, dtype):
    model = make_model(arch, dtype=DTYPES[dtype])
    alone, mixed, stats = _alone_and_mixed(
        model, invariant=True, offload=arch < "l", pages=MIXED_PAGES.get(arch, 12)
    )
    assert stats["cached_prompt_tokens"] > 0 and stats["preemptions"] > 0  # NOTE: the paths were exercised
    assert len(alone.generated_tokens) == 10
    assert mixed.generated_tokens == alone.generated_tokens
    assert mixed.logprobs == alone.logprobs  # NOTE: float ==, bit for bit


def test_control_the_default_mode_is_not_batch_invariant():
    """Without the mode the same comparison differs (fp32: logprobs in the last bits), so the test above
    can fail."""
    differs = []
    for arch in ("llama", "qwen3", "gpt2"):
        alone, mixed, _ = _alone_and_mixed(make_model(arch), invariant=False, offload=False)
        differs.append(alone.generated_tokens != mixed.generated_tokens or alone.logprobs != mixed.logprobs)
    assert any(differs), differs


def _engine_batch_and_trainer_pass(arch: str, dtype: torch.dtype):
    """A tiny fp32 "trainer" model, an engine on it (or on its cast copy), one rollout, and the trainer's
    invariant pass over the same tokens: (batch, data, logprobs [N, T] with grad, master model)."""
    model = make_model(arch)
    disable_dropout(model)
    engine_model = model if dtype == torch.float32 else make_model(arch).to(dtype)
    cbc = ContinuousBatchingConfig(
        page_size=8, num_blocks=96, max_batch_tokens=32, return_logprobs=True, batch_invariant=True
    )
    with RolloutEngine(engine_model, config=cbc) as engine:
        batch = engine.generate(
            random_prompts(3, 4, 30, seed=1), temps=[1.0, 0.0, 0.7], group_size=2, max_new_tokens=8, seed=3
        )
    data = {
        "input_ids": batch.input_ids.masked_fill(
            batch.attention_mask == 0, 0
        ),  # NOTE: GPT-2's pad id is past VOCAB
        "attention_mask": batch.attention_mask,
        "completion_ids": batch.completion_ids.masked_fill(batch.completion_mask == 0, 0),
        "temperatures": batch.temperatures,
    }
    model.train()
    invariant = InvariantForward(model, page_size=8, dtype=None if dtype == torch.float32 else dtype)
    logprobs, _ = scored_logprobs(completion_forward(invariant, data).logits, data)
    return batch, data, logprobs, model


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("arch", sorted(CONFIGS))
def test_trainer_logprobs_are_the_engine_logprobs_bit_for_bit(arch, dtype):
    batch, data, logprobs, model = _engine_batch_and_trainer_pass(arch, DTYPES[dtype])
    mask = batch.completion_mask.bool()
    assert mask.sum() > 10
    assert torch.equal(logprobs[mask], batch.logprobs[mask])
    with torch.no_grad():  # NOTE: the control: the model's own forward is close, not equal
        plain, _ = scored_logprobs(completion_forward(model, data).logits, data)
    assert not torch.equal(plain[mask], batch.logprobs[mask])


@pytest.mark.parametrize("arch", ["llama", "gemma2", "gpt2"])
def test_gradients_match_autograd_of_the_ordinary_forward(arch):
    """gemma2: softcap and sliding windows in the attention's backward; gpt2: Conv1D linears."""
    _, data, logprobs, model = _engine_batch_and_trainer_pass(arch, torch.float32)
    mask = data["completion_ids"].new_ones(data["completion_ids"].shape).bool()
    weights = torch.randn(logprobs.shape, generator=torch.Generator().manual_seed(0))
    (logprobs * weights).sum().backward()
    ours = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    plain, _ = scored_logprobs(completion_forward(model, data).logits, data)
    (plain.masked_fill(~mask, 0) * weights).sum().backward()
    for (name, p), g in zip(model.named_parameters(), ours, strict=True):
        assert g.abs().sum() > 0 or p.grad.abs().sum() == 0, name
        torch.testing.assert_close(
            g, p.grad, rtol=1e-4, atol=1e-5 * float(p.grad.abs().max()) + 1e-7, msg=name
        )


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_tiled_linear_rows_do_not_depend_on_the_other_rows(dtype):
    """The assumption under the mode's linears, checked on this machine: a row's bits are the same at any row
    count and position (the plain GEMM's are not, in fp32: the control)."""
    g = torch.Generator().manual_seed(0)
    plain_differs = False
    for k, n in ((64, 128), (256, 768), (768, 256)):
        w = torch.randn(n, k, generator=g).to(DTYPES[dtype])
        row = torch.randn(1, k, generator=g).to(DTYPES[dtype])
        cache: dict = {}  # NOTE: with a cache fp32 takes oneDNN's packed path, without one the bmm of tiles
        refs = tiled_linear(row, w)[0], tiled_linear(row, w, cache=cache)[0]
        for m in (2, 3, 17, 100, 600):
            x = torch.randn(m, k, generator=g).to(DTYPES[dtype])
            at = m // 2
            x[at] = row[0]
            assert torch.equal(tiled_linear(x, w)[at], refs[0]), (k, n, m)
            assert torch.equal(tiled_linear(x, w, cache=cache)[at], refs[1]), (k, n, m)
            plain_differs |= not torch.equal(
                torch.nn.functional.linear(x, w)[at], torch.nn.functional.linear(row, w)[0]
            )
    if dtype == "fp32":
        assert plain_differs


def test_refusals_name_the_field():
    with pytest.raises(ValueError, match="batch_invariant.*attn_backend"):
        ContinuousBatchingConfig(batch_invariant=True, attn_backend="flex")
    with pytest.raises(ValueError, match="batch_invariant.*default_compile_level"):
        ContinuousBatchingConfig(batch_invariant=True, default_compile_level=1)
    with pytest.raises(ValueError, match="batch_invariant"):
        ContinuousBatchingConfig(batch_invariant=1)
    with pytest.raises(ValueError, match="batch_invariant.*float16"):
        EngineCore(
            make_model("llama", dtype=torch.float16),
            GC,
            ContinuousBatchingConfig(page_size=8, num_blocks=8, batch_invariant=True),
        )
    sharded = make_model("llama")
    sharded._tp_size = 2  # NOTE: as transformers marks a DistributedConfig(tp_size=2) model; refused before any group
    with pytest.raises(ValueError, match="batch_invariant.*tensor parallelism.*tp_size=2"):
        EngineCore(sharded, GC, ContinuousBatchingConfig(page_size=8, num_blocks=8, batch_invariant=True))


def test_sdpa_and_cpu_backends_give_the_same_bits():
    """Both names run the mode's per-row attention: one result whichever is asked for."""
    model = make_model("qwen3")
    spec = [(random_prompts(1, 20, 20, seed=4)[0], 1.0, 9, 8)]
    runs = [
        _run(model, spec, num_blocks=16, attn_backend=b, batch_invariant=True)[0][0] for b in ("cpu", "sdpa")
    ]
    assert runs[0].generated_tokens == runs[1].generated_tokens and runs[0].logprobs == runs[1].logprobs


def _load_recipe(name: str):
    recipes = Path(__file__).resolve().parents[2] / "recipes"
    if str(recipes) not in sys.path:  # NOTE: recipes import their sibling `_common`, as when launched
        sys.path.insert(0, str(recipes))
    spec = importlib.util.spec_from_file_location(f"recipe_{name}_bi", recipes / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    ("recipe", "bf16"),
    [("grpo", False), ("grpo", True), ("ppo", False)],
    ids=["grpo-fp32", "grpo-bf16", "ppo-fp32"],
)
def test_recipe_batch_invariant_has_zero_logprob_mismatch(tmp_path, recipe, bf16):
    """`recipes/grpo.py --batch_invariant` (with `--bf16`: engine and passes in bf16) and `recipes/ppo.py`."""
    state = torch.get_rng_state(), random.getstate()
    out = tmp_path / recipe
    args = ["--batch_invariant", "--steps", "2", "--sft_steps", "3", "--prompts_per_step", "4"]
    args += ["--group_size", "4" if recipe == "grpo" else "1", "--output_dir", str(out)]
    try:
        # NOTE: bf16 also with activation checkpointing (its recomputation must see the same cast weights)
        bf16_args = ["--bf16", "--gradient_checkpointing", "--gradient_accumulation_steps", "2"]
        _load_recipe(recipe).main(args + (bf16_args if bf16 else []))
    finally:
        torch.set_rng_state(state[0])
        random.setstate(state[1])
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2]
    assert [r["logprob_mismatch_max"] for r in records] == [0.0, 0.0]
    assert all(r["grad_norm"] > 0 for r in records)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_two_ddp_ranks_stay_identical_with_zero_mismatch(tmp_path):
    """2 CPU ranks (gloo), GRPO and PPO: the mode's passes bypass DDP's forward, so the trainer all-reduces
    the gradients itself: both ranks hold the same parameters after every step, and every step's parity probe
    (the max over ranks) is 0.0."""
    import os
    import subprocess

    from support.serving import free_port

    root = Path(__file__).resolve().parents[2]
    command = [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--multi_gpu",
        "--num_processes",
        "2",
        "--num_machines",
        "1",
        "--mixed_precision",
        "no",
        "--dynamo_backend",
        "no",
        "--main_process_port",
        str(free_port()),
        str(root / "tests" / "support" / "ddp_invariant_worker.py"),
        "--out",
        str(tmp_path),
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(root), CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run(command, cwd=root, env=env, capture_output=True, text=True, timeout=560)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert [r["world"] for r in ranks] == [2, 2]
    assert [x["hash"] for x in ranks[0]["records"]] == [x["hash"] for x in ranks[1]["records"]]
    assert len({x["hash"] for x in ranks[0]["records"]}) == len(
        ranks[0]["records"]
    )  # NOTE: every step trained
    assert all(x["mismatch"] == 0.0 for x in ranks[0]["records"] if x["step"])
