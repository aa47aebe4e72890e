"""Two-rank run of the batch-invariant trainers for tests/invariant/test_batch_invariant.py, started with

    accelerate launch --multi_gpu --num_processes 2 --num_machines 1 --mixed_precision no \\
        --dynamo_backend no tests/support/ddp_invariant_worker.py --out DIR

2 GRPO steps and 2 PPO steps with `batch_invariant=True`, each rank rolling out its own prompts; per step a
hash of every trained parameter and `logprob_mismatch_max` go to DIR/rank{r}.json. The mode's passes bypass
DDP's forward, so equal hashes on both ranks show that the trainer all-reduced the gradients itself.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]

from accelerate import Accelerator  # noqa: E402

from support import ddp_worker  # noqa: E402
from trainers import GRPOConfig, GRPOTrainer, PolicyWithValue, PPOConfig, PPOTrainer  # noqa: E402
from trainers.tasks import build_tiny_model, make_addition_tokenizer  # noqa: E402


def build(algorithm: str, accelerator: Accelerator, output_dir: str):
    tokenizer = make_addition_tokenizer()
    model = build_tiny_model(tokenizer, hidden_size=32, num_layers=1, num_heads=2, seed=0)
    settings = dict(
        output_dir=output_dir,
        max_steps=2,
        prompts_per_step=2,
        group_size=4,
        max_new_tokens=6,
        learning_rate=1e-3,
        gradient_accumulation_steps=2,
        shuffle=False,
        log_stdout=False,
        progress=False,
        engine_config=ddp_worker.ENGINE,
        batch_invariant=True,
    )
    if algorithm == "ppo":
        model, config, cls = PolicyWithValue(model), PPOConfig(**settings), PPOTrainer
    else:
        config, cls = GRPOConfig(**settings), GRPOTrainer
    return cls(model, tokenizer, ddp_worker.half_constant, ddp_worker.ROWS, config, accelerator=accelerator)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    accelerator = Accelerator(cpu=True)  # NOTE: without cpu=True each process believes it is alone
    records = []
    for algorithm in ("grpo", "ppo"):
        trainer = build(algorithm, accelerator, os.path.join(args.out, algorithm))
        records.append({"algorithm": algorithm, "step": 0, "hash": ddp_worker.parameter_hash(trainer)})
        for _ in range(2):
            metrics = trainer.step()
            records.append(
                {
                    "algorithm": algorithm,
                    "step": metrics["step"],
                    "hash": ddp_worker.parameter_hash(trainer),
                    "mismatch": metrics["logprob_mismatch_max"],
                }
            )
        trainer.close()
    with open(os.path.join(args.out, f"rank{accelerator.process_index}.json"), "w") as f:
        json.dump({"world": accelerator.num_processes, "records": records}, f)
    accelerator.end_training()


if __name__ == "__main__":
    main()
