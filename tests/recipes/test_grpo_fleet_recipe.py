"""`recipes/grpo.py --rollout_engines 1` (issue 47): the embedded demo's GRPO with its rollouts from a one-engine Ray
fleet (a local cluster on 127.0.0.1, started and stopped by the recipe's fleet), async at staleness 1."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

RECIPES = Path(__file__).resolve().parents[2] / "recipes"
sys.path.insert(0, str(RECIPES))  # NOTE: recipes import their sibling `_common`, as they do when launched

pytestmark = pytest.mark.timeout(600)


def test_grpo_recipe_on_a_ray_fleet(tmp_path, keep_rng):
    ray = pytest.importorskip("ray", reason="the fleet recipe needs ray (pip install -e '.[ray]')")
    if ray.is_initialized():
        pytest.skip("a Ray cluster is already connected in this process; the recipe starts and stops its own")
    spec = importlib.util.spec_from_file_location("recipe_grpo_fleet", RECIPES / "grpo.py")
    grpo = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(grpo)
    out = tmp_path / "grpo_fleet"
    args = ["--steps", "3", "--sft_steps", "3", "--prompts_per_step", "4", "--group_size", "4",
            "--rollout_engines", "1", "--async_rollout", "--max_staleness", "1", "--output_dir", str(out)]
    summary = grpo.main(args)
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3]
    assert all(r["staleness_max"] <= 1 for r in records)
    assert records[0]["logprob_mismatch_max"] < 1e-3  # step 1 is fresh: the fleet's logprobs are the learner's
    assert summary["mode"] == "async (max_staleness 1)" and summary["steps"] == 3
    assert not ray.is_initialized()  # the trainer closed the fleet, which stopped the cluster it started
