"""The rank side of `tests/recipes/test_grpo_tp_recipe.py`: `recipes/grpo.py` under `torchrun --nproc-per-node 2`
with the recipe's own arguments, each rank recording what it saw before any cross-rank reduction (its rollouts'
token ids, its rewards, its local optimizer metrics) to `--record_dir/rank{r}.json`.

    torchrun --nproc-per-node 2 tests/support/tp_recipe_worker.py --record_dir OUT -- --tp_size 2 --steps 3 ...
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
from pathlib import Path

import torch

RECIPES = Path(__file__).resolve().parents[2] / "recipes"
sys.path.insert(0, str(RECIPES))  # NOTE: recipes import their sibling `_common`, as they do when launched


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--record_dir", type=Path, required=True)
    parser.add_argument("recipe_args", nargs=argparse.REMAINDER)
    args = parser.parse_args()
    torch.set_num_threads(1)
    spec = importlib.util.spec_from_file_location("recipe_grpo", RECIPES / "grpo.py")
    grpo = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(grpo)
    steps: list[dict] = []
    cls = grpo.GRPOTrainer
    generate, score, optimize = cls.generate, cls.score, cls.optimize

    def recorded_generate(self, rows):
        batch, metrics = generate(self, rows)
        steps.append({"prompts": [r["prompt"] for r in rows], "completion_ids": batch.completion_ids.tolist()})
        return batch, metrics

    def recorded_score(self, rows, batch):
        rewards, metrics = score(self, rows, batch)
        steps[-1]["rewards"] = rewards.tolist()
        return rewards, metrics

    def recorded_optimize(self, data):
        metrics = optimize(self, data)
        steps[-1]["local"] = {k: float(v) for k, v in metrics.items()}
        steps[-1]["data"] = [self.data_rank, self.data_world]
        return metrics

    cls.generate, cls.score, cls.optimize = recorded_generate, recorded_score, recorded_optimize
    recipe_args = [a for a in args.recipe_args if a != "--"]
    summary = grpo.main(recipe_args)
    rank = int(os.environ.get("RANK", "0"))
    args.record_dir.mkdir(parents=True, exist_ok=True)
    (args.record_dir / f"rank{rank}.json").write_text(json.dumps({"steps": steps, "summary": summary}))


if __name__ == "__main__":
    main()
