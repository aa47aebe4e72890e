"""Recipes never overwrite another run's output directory unless asked (issue 62): the `rollout_run.json` record,
`--overwrite`, resumes, the summary's first / last window, and the warm-start cache's key."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import pytest

RECIPES = Path(__file__).resolve().parents[2] / "recipes"
sys.path.insert(0, str(RECIPES))  # NOTE: recipes import their sibling `_common`, as they do when launched

import _common  # noqa: E402
from accelerate import Accelerator  # noqa: E402


def args(**flags) -> argparse.Namespace:
    return argparse.Namespace(output_dir="x", overwrite=False, steps=200, seed=0, **flags)


def test_a_recipe_refuses_another_recipes_directory_in_one_line(tmp_path):
    acc = Accelerator(cpu=True)
    out = tmp_path / "runs" / "grpo"
    demo = _common.run_record("recipes/grpo.py", args())
    _common.fresh_output_dir(acc, str(out), record=demo)
    assert json.loads((out / _common.RUN_FILE).read_text()) == demo
    (out / "final").mkdir()
    (out / "final" / "config.json").write_text("{}")
    with pytest.raises(SystemExit) as refused:
        _common.fresh_output_dir(acc, str(out), record=_common.run_record("recipes/ppo.py", args()))
    message = str(refused.value)
    assert "\n" not in message and "holds the results of recipes/grpo.py" in message and "--overwrite" in message
    assert (out / "final" / "config.json").exists()  # NOTE: nothing touched


def test_the_same_recipe_with_other_flags_is_refused_naming_them_and_a_rerun_is_not(tmp_path):
    acc = Accelerator(cpu=True)
    out = str(tmp_path / "grpo")
    _common.fresh_output_dir(acc, out, record=_common.run_record("recipes/grpo.py", args()))
    fleet = _common.run_record("recipes/grpo.py", args(rollout_engines=1, async_rollout=True))
    with pytest.raises(SystemExit, match=r"other flags \(--async_rollout None there, True here, --rollout_engines"):
        _common.fresh_output_dir(acc, out, record=fleet)
    _common.fresh_output_dir(acc, out, record=_common.run_record("recipes/grpo.py", args()))  # the same command
    # NOTE: a resume may change flags (more --steps), never the recipe
    _common.fresh_output_dir(acc, out, resume_step=1, record=_common.run_record("recipes/grpo.py", args(lr=1.0)))
    with pytest.raises(SystemExit, match="recipes/ppo.py: refusing"):
        _common.fresh_output_dir(acc, out, resume_step=1, record=_common.run_record("recipes/ppo.py", args()))


def test_overwrite_replaces_the_other_runs_final_and_record(tmp_path):
    acc = Accelerator(cpu=True)
    out = tmp_path / "grpo"
    _common.fresh_output_dir(acc, str(out), record=_common.run_record("recipes/grpo.py", args(lora_rank=8)))
    (out / "final").mkdir()
    (out / "final" / "adapter_config.json").write_text("{}")
    (out / "metrics.jsonl").write_text('{"step": 1}\n')
    full = _common.run_record("recipes/grpo.py", args(lora_rank=None))
    _common.fresh_output_dir(acc, str(out), record=full, overwrite=True)
    assert not (out / "final").exists() and not (out / "metrics.jsonl").exists()
    assert json.loads((out / _common.RUN_FILE).read_text()) == full


def test_results_no_recipe_recorded_are_refused_and_an_empty_directory_is_taken(tmp_path):
    acc = Accelerator(cpu=True)
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / "summary.json").write_text("{}")
    with pytest.raises(SystemExit, match="summary.json of an earlier run that did not record its recipe"):
        _common.claim_output_dir(acc, str(tmp_path / "old"), _common.run_record("recipes/grpo.py", args()))
    (tmp_path / "empty").mkdir()
    _common.claim_output_dir(acc, str(tmp_path / "empty"), _common.run_record("recipes/grpo.py", args()))
    # NOTE: the sweep records its recipe alone: a widened grid adds cells to its own sweep.csv
    sweep = _common.run_record("recipes/eval_sweep.py")
    _common.claim_output_dir(acc, str(tmp_path / "sweep"), sweep)
    _common.claim_output_dir(acc, str(tmp_path / "sweep"), sweep)
    with pytest.raises(SystemExit, match="holds the results of recipes/eval_sweep.py"):
        _common.claim_output_dir(acc, str(tmp_path / "sweep"), _common.run_record("recipes/grpo.py", args()))


def test_the_grpo_recipe_refuses_before_any_work(tmp_path, keep_rng, monkeypatch):
    """The fleet command of docs/fleets.md into the demo's directory: refused before a warm start or a Ray cluster."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("recipe_grpo_dirs", RECIPES / "grpo.py")
    grpo = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(grpo)
    out = tmp_path / "grpo"
    demo = grpo.parse_args(["--output_dir", str(out)])
    _common.fresh_output_dir(Accelerator(cpu=True), str(out), record=_common.run_record("recipes/grpo.py", demo))
    monkeypatch.setattr(grpo, "load_policy_and_prompts", lambda *a, **k: pytest.fail("refused too late"))
    with pytest.raises(SystemExit, match="--async_rollout False there, True here"):
        grpo.main(["--rollout_engines", "1", "--async_rollout", "--output_dir", str(out)])


@pytest.mark.parametrize(("rewards", "window", "text"), [
    ([0.1] * 5 + [0.9] * 5, 5, "reward first5 0.100 -> last5 0.900 (rise +0.800)"),
    ([0.1, 0.2, 0.8, 0.9, 0.5], 2, "reward first2 0.150 -> last2 0.700 (rise +0.550)"),
    ([0.4], 1, "reward 0.400 (one step: no first and last steps to compare)"),
])
def test_a_short_run_compares_halves_that_share_no_step(rewards, window, text):
    summary = _common.summarize([{"step": i + 1, "reward_mean": r} for i, r in enumerate(rewards)], 1.0)
    assert summary["reward_window"] == window and _common.reward_span(summary) == text


def test_the_warm_start_cache_is_keyed_by_settings_model_and_library_versions(tmp_path, monkeypatch):
    import torch
    import transformers

    monkeypatch.setenv("ROLLOUT_WARM_START_CACHE", str(tmp_path))
    settings = dict(seed=0, target_exact=0.3, max_sft_steps=1000)
    path = Path(_common.warm_start_cache_dir(**settings))
    assert path.parent == tmp_path and transformers.__version__ in path.name and "_h128_l3_" in path.name
    assert path != Path(_common.warm_start_cache_dir(**settings, hidden_size=64))
    key = _common.warm_start_key(**settings)
    assert key["torch"] == torch.__version__ and key["transformers"] == transformers.__version__
    path.mkdir()
    (path / _common.WARM_START_FILE).write_text(json.dumps({**key, "exact": 0.3}))
    assert _common.saved_settings_match(str(path), key)
    # NOTE: another process's warm start, built with another transformers, is not this run's
    (path / _common.WARM_START_FILE).write_text(json.dumps({**key, "transformers": "5.23.0", "exact": 0.3}))
    assert not _common.saved_settings_match(str(path), key)
    # NOTE: nor one another machine's CPU built (a cache on a shared home: its float rounding moves the warm start)
    assert key["cpu"] == _common.cpu_name() and key["cpu"] and "_cpu" in path.name
    (path / _common.WARM_START_FILE).write_text(json.dumps({**key, "cpu": "AMD EPYC 7B13", "exact": 0.3}))
    assert not _common.saved_settings_match(str(path), key)
    assert not _common.saved_settings_match(str(tmp_path / "missing"), key)


def test_the_summary_says_what_each_logprob_mismatch_compares():
    import _mode

    history = [{"step": 1, "staleness_mean": 0.0, "staleness_max": 0, "logprob_mismatch_max": 6e-5,
                "fresh_logprob_mismatch_max": 6e-5},
               {"step": 2, "staleness_mean": 1.0, "staleness_max": 1, "logprob_mismatch_max": 14.3}]
    line = _mode.mode_line(argparse.Namespace(async_rollout=True, max_staleness=1), history)
    assert "behaviour vs current policy (stale tokens included: the policy moved since) max 14.3" in line
    assert "engine vs behaviour policy (tokens the current version sampled) max 6e-05" in line
    line = _mode.mode_line(argparse.Namespace(async_rollout=True, max_staleness=1), history[1:])
    assert "engine vs behaviour policy (tokens the current version sampled) not measured: no such tokens" in line
    sync = _mode.mode_line(argparse.Namespace(), [{"step": 1, "logprob_mismatch_max": 6e-5}])
    assert sync == "mode: sync: logprob mismatch engine vs trainer (parity probe) max 6e-05"
