"""Two-rank FSDP2 checks for tests/trainers/test_fsdp.py, started with

    accelerate launch --config_file recipes/accelerate/2cpu_fsdp.yaml --main_process_port P \\
        tests/support/fsdp_worker.py --out DIR

The launch config asks for FSDP; on a CPU accelerate starts plain gloo ranks and the trainers shard
themselves (`RLConfig.fsdp="auto"`). In the one process group, for GRPO (with a KL reference) and PPO (value
head): a DDP run (`fsdp=False`) and an FSDP run of 3 steps from the same initial weights and seeds; after
each step the full parameters (gathered), the loss, the parity probe, `trainer_param_fraction`,
`sync_seconds` and the sync's bucket statistics go to DIR/rank{r}.pt, and at the end the policy
`gather_policy()` returns. Then the FSDP GRPO run is resumed
from its step-2 checkpoint (sharded DCP) on a fresh trainer and its step 3 recorded as "resumed".
"""

from __future__ import annotations

import argparse
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests"))  # NOTE: `support`, when run as a script

import torch  # noqa: E402
from accelerate import Accelerator  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402

from rollout import ContinuousBatchingConfig  # noqa: E402
from support.training import digit_share  # noqa: E402
from trainers import GRPOConfig, GRPOTrainer, PPOConfig, PPOTrainer  # noqa: E402
from trainers.tasks import build_tiny_model, make_addition_tokenizer  # noqa: E402

STEPS = 3
ENGINE = ContinuousBatchingConfig(page_size=4, num_blocks=128, max_batch_tokens=256)
ROWS = [{"prompt": f"{i:03d}+{2 * i:03d}="} for i in range(16)]


def build(algorithm: str, output_dir: str, fsdp: bool | str):
    """A 2-layer trainer (AdamW, 2 accumulated micro-batches, KL for GRPO); same weights on every rank and run.
    Each its own `Accelerator` (one process state): its checkpoints hold only its own model."""
    accelerator = Accelerator(cpu=True)
    tokenizer = make_addition_tokenizer()
    model = build_tiny_model(tokenizer, hidden_size=32, num_layers=2, num_heads=2, seed=0)
    settings = dict(output_dir=output_dir, max_steps=STEPS, prompts_per_step=2, group_size=4, max_new_tokens=6,
                    learning_rate=1e-3, gradient_accumulation_steps=2, log_stdout=False, progress=False,
                    engine_config=ENGINE, fsdp=fsdp, seed=3)
    torch.manual_seed(0)  # NOTE: the value head's initialisation
    if algorithm == "ppo":
        return PPOTrainer(model, tokenizer, digit_share, ROWS, PPOConfig(**settings), accelerator=accelerator)
    config = GRPOConfig(beta=0.04, **settings)
    return GRPOTrainer(model, tokenizer, digit_share, ROWS, config, accelerator=accelerator)


def full_parameters(trainer) -> dict[str, torch.Tensor]:
    """Every trained parameter as a full tensor (a gather under FSDP: every rank calls it)."""
    model = trainer.accelerator.unwrap_model(trainer.model)
    return {name: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
            for name, p in model.named_parameters()}


def record(trainer, metrics: dict[str, float]) -> dict:
    stats = trainer.sync_stats
    return {"step": metrics["step"], "loss": metrics["loss"], "mismatch": metrics["logprob_mismatch_max"],
            "fraction": metrics["trainer_param_fraction"], "sync_seconds": metrics["sync_seconds"],
            "buckets": stats.buckets, "tensors": stats.tensors, "peak_bucket_bytes": stats.peak_bucket_bytes,
            "kl": metrics.get("kl"), "params": full_parameters(trainer)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    accelerator = Accelerator(cpu=True)  # NOTE: without cpu=True each process believes it is alone
    runs: dict[str, list[dict]] = {}
    for algorithm in ("grpo", "ppo"):
        for mode, fsdp in (("ddp", False), ("fsdp", "auto")):
            trainer = build(algorithm, os.path.join(args.out, algorithm, mode), fsdp)
            records = [{"step": 0, "fraction": trainer.param_fraction, "params": full_parameters(trainer),
                        "sharded": trainer.fsdp is not None}]
            for _ in range(STEPS):
                records.append(record(trainer, trainer.step()))
                if algorithm == "grpo" and mode == "fsdp" and trainer.step_count == 2:
                    trainer.save_checkpoint()
            gathered = trainer.gather_policy()  # NOTE: collective under FSDP; the policy itself under DDP
            records[-1]["gathered"] = {k: v.detach().clone() for k, v in gathered.named_parameters()}
            runs[f"{algorithm}_{mode}"] = records
            trainer.close()
    trainer = build("grpo", os.path.join(args.out, "grpo", "resumed"), "auto")
    trainer.load_checkpoint(os.path.join(args.out, "grpo", "fsdp", "checkpoint-2"))
    runs["grpo_resumed"] = [record(trainer, trainer.step())]
    trainer.close()
    torch.save({"world": accelerator.num_processes, "runs": runs},
               os.path.join(args.out, f"rank{accelerator.process_index}.pt"))
    accelerator.wait_for_everyone()
    accelerator.end_training()


if __name__ == "__main__":
    main()
