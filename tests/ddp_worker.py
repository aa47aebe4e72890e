"""Two-rank GRPO run for tests/test_ddp.py, started with

    accelerate launch --multi_gpu --num_processes 2 --num_machines 1 --mixed_precision no \\
        --dynamo_backend no tests/ddp_worker.py --out DIR

Each rank builds its model from a different seed (DDP's initial broadcast must make them equal),
runs 3 GRPO steps on its own prompt shard with its own engine, and writes DIR/rank{r}.json: per
step the prompts it rolled out, a hash of its parameters and the reduced metrics.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
from accelerate import Accelerator  # noqa: E402

from rollout import ContinuousBatchingConfig  # noqa: E402
from trainers import GRPOConfig, GRPOTrainer  # noqa: E402
from trainers.tasks import AdditionTask, addition_reward, build_tiny_model, make_addition_tokenizer  # noqa: E402


def digit_share(prompts, completions, **columns):
    return [sum(ch.isdigit() for ch in c) / max(len(c), 1) for c in completions]


def parameter_hash(model: torch.nn.Module) -> str:
    digest = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        digest.update(name.encode())
        digest.update(tensor.detach().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()

    accelerator = Accelerator(cpu=True)  # NOTE: without cpu=True each process believes it is alone
    rank = accelerator.process_index
    tokenizer = make_addition_tokenizer()
    model = build_tiny_model(tokenizer, hidden_size=64, num_layers=2, seed=rank)
    config = GRPOConfig(
        output_dir=os.path.join(args.out, "run"),
        max_steps=args.steps,
        prompts_per_step=4,
        group_size=4,
        max_new_tokens=6,
        learning_rate=2e-3,
        num_minibatches=2,
        gradient_accumulation_steps=2,
        beta=0.05,
        log_stdout=rank == 0,
        progress=False,
        engine_config=ContinuousBatchingConfig(page_size=4, num_blocks=128, max_batch_tokens=256),
    )
    dataset = AdditionTask(num_digits=3, seed=0).to_dataset(64)
    trainer = GRPOTrainer(
        model, tokenizer, [addition_reward, digit_share], dataset, config, accelerator=accelerator
    )
    records = [{"step": 0, "hash": parameter_hash(trainer.policy)}]
    for _ in range(args.steps):
        prompts = [row["prompt"] for row in trainer.prompts.rows(trainer.step_count)]
        metrics = trainer.step()
        records.append(
            {
                "step": metrics["step"],
                "prompts": prompts,
                "hash": parameter_hash(trainer.policy),
                "metrics": metrics,
            }
        )
    trainer.close()
    with open(os.path.join(args.out, f"rank{rank}.json"), "w") as f:
        json.dump({"world": accelerator.num_processes, "records": records}, f)
    accelerator.wait_for_everyone()
    accelerator.end_training()


if __name__ == "__main__":
    main()
