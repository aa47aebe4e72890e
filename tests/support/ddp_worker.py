"""Two-rank checks for tests/trainers/test_ddp.py, started with

    accelerate launch --multi_gpu --num_processes 2 --num_machines 1 --mixed_precision no \\
        --dynamo_backend no tests/support/ddp_worker.py --out DIR

1. Equivalence: for GRPO, DAPO and PPO, DIR/{algorithm}.pt holds a fixed rollout batch and the
   initial weights (written by the test in one process); each rank takes its half of the rows,
   runs `optimize` (SGD at lr 1) and rank 0 saves the weights after it to DIR/{algorithm}_ddp.pt.
2. Real runs: 2 GRPO steps and 2 PPO steps, each rank rolling out its own prompt shard; per step
   the prompts, the rewards this rank's reward function returned and a hash of every trained
   parameter (the value head included) go to DIR/rank{r}.json.
3. `recipes/eval_sweep.py` on the two ranks (last: it ends the process group).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "recipes"))
sys.path.insert(0, os.path.join(ROOT, "tests"))  # NOTE: `support`, when run as a script

import torch  # noqa: E402
from accelerate import Accelerator  # noqa: E402

from rollout import ContinuousBatchingConfig  # noqa: E402
from support.training import digit_share, trained_state  # noqa: E402
from trainers import GRPOConfig, GRPOTrainer, PolicyWithValue, PPOConfig, PPOTrainer  # noqa: E402
from trainers.ppo import whiten  # noqa: E402
from trainers.tasks import build_tiny_model, make_addition_tokenizer  # noqa: E402

ALGORITHMS = ("grpo", "dapo", "ppo")
ENGINE = ContinuousBatchingConfig(page_size=4, num_blocks=128, max_batch_tokens=256)


SCORED: list[float] = []  # NOTE: every reward this process returned since the last clear


def half_constant(completions, varies, log_metric=None, **kwargs):
    """Rows whose "varies" column is False score a constant 1: DAPO drops their groups. A batch with varying
    rows logs `varying_rows` (their count): on two ranks only rank 0 logs it (the metric gather must cope)."""
    if log_metric is not None and any(varies):
        log_metric("varying_rows", sum(varies))
    scores = [s if v else 1.0 for s, v in zip(digit_share(None, completions), varies, strict=True)]
    SCORED.extend(scores)
    return scores


# NOTE: in order, without shuffling: prompts 0-1 vary, 2-3 are constant. On two ranks (2 prompts
# each) rank 1 holds only constant groups, so under DAPO it has no tokens in its loss at all.
ROWS = [{"prompt": f"00{i}+00{i}=", "varies": i % 4 < 2} for i in range(8)]


def build(algorithm: str, accelerator: Accelerator, output_dir: str, prompts_per_step: int, sgd: bool = True):
    """A small trainer for `algorithm`: the same initial weights on every process (seed 0)."""
    tokenizer = make_addition_tokenizer()
    model = build_tiny_model(tokenizer, hidden_size=32, num_layers=1, num_heads=2, seed=0)
    settings = dict(
        output_dir=output_dir,
        max_steps=2,
        prompts_per_step=prompts_per_step,
        group_size=4,
        max_new_tokens=6,
        learning_rate=1e-3,
        gradient_accumulation_steps=2,
        shuffle=False,
        log_stdout=False,
        progress=False,
        engine_config=ENGINE,
    )
    if sgd:
        settings.update(max_grad_norm=None)
    if algorithm == "ppo":
        model = PolicyWithValue(model)
        config, cls = PPOConfig(**settings), PPOTrainer
    else:
        config, cls = GRPOConfig(algorithm=algorithm, **settings), GRPOTrainer
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0) if sgd else None
    return cls(model, tokenizer, half_constant, ROWS, config, accelerator=accelerator, optimizer=optimizer)


def whiten_inputs() -> tuple[torch.Tensor, torch.Tensor]:
    """Advantages `[8, 5]` and a mask whose two halves have different means, spreads and token counts."""
    x = torch.arange(40, dtype=torch.float32).view(8, 5).square() / 50
    mask = torch.ones(8, 5, dtype=torch.bool)
    mask[4:, 2:] = False
    return x, mask


def parameter_hash(trainer) -> str:
    digest = hashlib.sha256()
    for name, tensor in sorted(trained_state(trainer).items()):
        digest.update(name.encode())
        digest.update(tensor.cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()


def equivalence(accelerator: Accelerator, out: str) -> None:
    rank, world = accelerator.process_index, accelerator.num_processes
    for algorithm in ALGORITHMS:
        saved = torch.load(os.path.join(out, f"{algorithm}.pt"))
        trainer = build(algorithm, accelerator, os.path.join(out, "eq"), prompts_per_step=2)
        trainer.accelerator.unwrap_model(trainer.model).load_state_dict(saved["init"])
        n = saved["data"]["completion_ids"].shape[0] // world
        trainer.optimize({k: v[rank * n : (rank + 1) * n] for k, v in saved["data"].items()})
        if accelerator.is_main_process:
            torch.save(trained_state(trainer), os.path.join(out, f"{algorithm}_ddp.pt"))
        trainer.close()


def real_runs(accelerator: Accelerator, out: str) -> list[dict]:
    records = []
    for algorithm in ("grpo", "ppo"):
        trainer = build(algorithm, accelerator, os.path.join(out, algorithm), prompts_per_step=2, sgd=False)
        records.append({"algorithm": algorithm, "step": 0, "hash": parameter_hash(trainer)})
        for _ in range(2):
            prompts = [row["prompt"] for row in trainer.prompts.rows(trainer.step_count)]
            SCORED.clear()
            metrics = trainer.step()
            records.append(
                {"algorithm": algorithm, "step": metrics["step"], "prompts": prompts, "hash": parameter_hash(trainer),
                 "mismatch": metrics["logprob_mismatch_max"], "varying_rows": metrics.get("varying_rows"),
                 "rewards": list(SCORED)}
            )
        if algorithm == "ppo":  # NOTE: whitening statistics over both ranks' halves of WHITEN_X
            x, mask = whiten_inputs()
            n = x.shape[0] // accelerator.num_processes
            rows = slice(accelerator.process_index * n, (accelerator.process_index + 1) * n)
            records.append(
                {"algorithm": "whiten", "values": whiten(x[rows], mask[rows], all_sum=trainer.all_sum).tolist()}
            )
        trainer.close()
    return records


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--sweep", nargs=argparse.REMAINDER, default=None, help="eval_sweep arguments")
    args = parser.parse_args()

    accelerator = Accelerator(cpu=True)  # NOTE: without cpu=True each process believes it is alone
    equivalence(accelerator, args.out)
    records = real_runs(accelerator, args.out)
    with open(os.path.join(args.out, f"rank{accelerator.process_index}.json"), "w") as f:
        json.dump({"world": accelerator.num_processes, "records": records}, f)
    accelerator.wait_for_everyone()
    if args.sweep:
        import eval_sweep

        eval_sweep.main(args.sweep)  # NOTE: ends the process group
    else:
        accelerator.end_training()


if __name__ == "__main__":
    main()
