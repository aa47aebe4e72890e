"""On-policy distillation: the student samples with its engine, a teacher scores the student's tokens with
`RolloutEngine.score`, and the student minimises the per-token reverse KL to the teacher.

The algorithm (as Thinking Machines' on-policy distillation): per step, `prompts_per_step` prompts x
`group_size` student samples at temperature 1; the teacher's logprob of each sampled token minus the
student's is that token's advantage (-(reverse KL) per token: no reward, no baseline) in the same clipped
surrogate GRPO uses (clip 0.2, token mean), 2 passes in 2 minibatches per batch. The reward (the addition
verifier) is only logged. `--advantages normalized|clipped` centre/scale or clamp those advantages; `--loss
full_kl` trains on the exact per-position reverse KL over the vocabulary instead (the teacher runs a forward in
the trainer). Measured (benchmarks/RESULTS.md, "On-policy distillation"): with a teacher supervised to 0.87,
`--lr 2.5e-4 --loss full_kl` reaches 90% of it in ~510 steps where GRPO flattens near 0.5; the defaults (the GRPO
demo's result as teacher, lr 5e-4) do not beat GRPO.

With no arguments this is the embedded CPU demo, offline:
  1. the teacher is the GRPO demo's result (`recipes/grpo.py`, OUTPUT runs/grpo/final), trained on the fly
     (its default 200 steps) if absent; the student is the same warm start the GRPO demo began from
     (runs/grpo/init);
  2. distillation for STEPS steps, held-out greedy exact match (512 problems) every EVAL_EVERY steps;
  3. GRPO (recipes/grpo.py's settings) for the same steps from the same warm start, evaluated alike;
  4. OUTPUT_DIR/exact_match.png (both curves against steps, the teacher's and 90% of it as lines),
     OUTPUT_DIR/summary.json (curves, wall time of each run, first step at >= 90% of the teacher).

Launch:
    accelerate launch --config_file recipes/accelerate/local.yaml recipes/distill.py
    accelerate launch --config_file recipes/accelerate/local.yaml recipes/distill.py --teacher runs/grpo/final \\
        --student runs/grpo/init --steps 40
"""

# ruff: noqa: E402
from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # NOTE: see recipes/grpo.py

import argparse
import time

import torch
from _common import (
    GRPO_EMBEDDED_ENGINE,
    add_overwrite_arg,
    fresh_output_dir,
    get_reward,
    make_accelerator,
    run_record,
    write_json,
)
from accelerate.utils import set_seed
from transformers import AutoModelForCausalLM, AutoTokenizer

from rollout import RolloutEngine
from trainers import GRPOConfig, GRPOTrainer
from trainers.common import completion_forward, safe_temperatures
from trainers.losses import masked_mean
from trainers.rollouts import batch_tensors
from trainers.tasks import AdditionTask, greedy_accuracy

# ----------------------------------------------------------------------------------- config
STEPS = 60
EVAL_EVERY = 10
PROMPTS_PER_STEP = 32
GROUP_SIZE = 4  # distillation needs no group baseline: fewer samples per prompt, more prompts
TEMPERATURE = 1.0  # the student's own distribution: the reverse KL is taken under it
LR = 5e-4
HELDOUT = 512
# -(reverse KL) per token as it is; centred and scaled to unit std over the batch; or clamped to +-ADVANTAGE_CLIP
# (a confident teacher puts -10 to -17 nats on a wrong digit: a few such tokens set the whole batch's gradient)
ADVANTAGES = ("raw", "normalized", "clipped")
ADVANTAGE_CLIP = 3.0
LOSSES = ("sampled", "full_kl")  # the policy-gradient surrogate on sampled tokens, or the exact per-position KL
GRPO_SETTINGS = dict(group_size=8, temperature=1.2, learning_rate=5e-4)  # recipes/grpo.py's defaults


class HeldoutEval:
    """Adds `heldout_exact` (greedy exact match on HELDOUT problems) to the metrics every EVAL_EVERY steps."""

    def collect(self):
        data, metrics = super().collect()
        if self.step_count % EVAL_EVERY == 0:
            metrics["heldout_exact"] = greedy_accuracy(self.policy, self.tokenizer, AdditionTask(3), n=HELDOUT)["exact"]
        return data, metrics


class GRPOBaseline(HeldoutEval, GRPOTrainer):
    pass


class DistillTrainer(GRPOTrainer):
    """GRPO's machinery with per-token advantages: teacher logprob - student logprob of each sampled token."""

    def __init__(self, *args, teacher: torch.nn.Module, advantages: str = "raw", loss: str = "sampled",
                 **kwargs) -> None:
        if advantages not in ADVANTAGES or loss not in LOSSES:
            raise ValueError(f"advantages must be one of {ADVANTAGES} and loss one of {LOSSES}, got "
                             f"{advantages!r}, {loss!r}")
        super().__init__(*args, **kwargs)
        self.advantages, self.loss_form = advantages, loss
        self.teacher_model = teacher
        self.teacher = RolloutEngine(teacher, config=GRPO_EMBEDDED_ENGINE.replace(logprobs_mode="processed"))

    def collect(self):
        rows = self.prompts.rows(self.step_count)
        batch, metrics = self.generate(rows)
        rewards, reward_metrics = self.score(rows, batch)  # logged only
        metrics.update(reward_metrics)
        metrics.update(self.reward_stats(rewards))
        start = time.perf_counter()
        data = batch_tensors(batch)
        mask = data["completion_mask"]  # [N, T]
        data["loss_mask"] = mask
        own = self.recompute_old(data, metrics)  # student logprobs [N, T]
        t0 = time.perf_counter()
        teacher = self.teacher.score(batch).logprobs.to(mask.device)  # [N, T], at the sampling temperature
        metrics["time_teacher"] = time.perf_counter() - t0
        advantages = teacher - own["logprobs"]  # [N, T]
        if self.advantages == "normalized":  # NOTE: a baseline and a scale, over the batch's completion tokens
            mean = masked_mean(advantages, mask)
            std = masked_mean((advantages - mean) ** 2, mask).sqrt()
            advantages = (advantages - mean) / (std + 1e-6)
        elif self.advantages == "clipped":
            advantages = advantages.clamp(-ADVANTAGE_CLIP, ADVANTAGE_CLIP)
        data["advantages"] = torch.where(mask, advantages, 0.0)  # [N, T]
        metrics["reverse_kl"] = masked_mean(own["logprobs"] - teacher, mask).item()
        metrics["time_train"] = time.perf_counter() - start
        if self.step_count % EVAL_EVERY == 0:
            metrics["heldout_exact"] = greedy_accuracy(self.policy, self.tokenizer, AdditionTask(3), n=HELDOUT)["exact"]
        return data, metrics

    def loss(self, micro: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """`sampled`: GRPO's clipped surrogate with the per-token advantages above. `full_kl`: the exact reverse
        KL over the vocabulary at every completion position, sum_v p_s(v) (log p_s(v) - log p_t(v)), both under the
        sampling temperature, token mean (on-policy GKD): the student's visited states, no sampled estimate."""
        if self.loss_form == "sampled":
            return super().loss(micro)
        logits, _ = self.forward(self.model, micro)  # [n, T+1, V]
        with torch.no_grad():
            teacher = completion_forward(self.teacher_model, micro).logits  # [n, T+1, V]
        temps = safe_temperatures(micro["temperatures"])[:, None, None]  # [n, 1, 1]
        student = torch.log_softmax(logits[:, :-1].float() / temps, -1)  # [n, T, V]
        teacher = torch.log_softmax(teacher[:, :-1].float() / temps, -1)  # [n, T, V]
        kl = (student.exp() * (student - teacher)).sum(-1)  # [n, T]
        loss = masked_mean(kl, micro["loss_mask"])
        return loss, {"full_reverse_kl": loss.detach()}

    def close(self) -> None:
        super().close()
        self.teacher.close()


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--teacher", default=None, help="teacher checkpoint (default: the GRPO demo's, trained if absent)")
    p.add_argument("--student", default=None, help="student checkpoint (default: the GRPO demo's warm start)")
    p.add_argument("--grpo_dir", default="runs/grpo", help="where the GRPO demo's outputs are (or go)")
    p.add_argument("--steps", type=int, default=STEPS)
    p.add_argument("--prompts_per_step", type=int, default=PROMPTS_PER_STEP)
    p.add_argument("--group_size", type=int, default=GROUP_SIZE)
    p.add_argument("--lr", type=float, default=LR)
    p.add_argument("--advantages", default="raw", choices=ADVANTAGES,
                   help="raw: teacher - student logprob per token; normalized: centred, unit std over the batch; "
                        "clipped: clamped to +-ADVANTAGE_CLIP")
    p.add_argument("--loss", default="sampled", choices=LOSSES,
                   help="sampled: the clipped surrogate with per-token advantages; full_kl: the exact reverse KL "
                        "over the vocabulary at each position (the teacher runs a forward in the trainer)")
    p.add_argument("--no_grpo_baseline", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output_dir", default="runs/distill")
    add_overwrite_arg(p)
    return p.parse_args(argv)


def run(trainer_cls, accelerator, args, model_path, tokenizer, dataset, out, **kw) -> tuple[list[dict], float]:
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    settings = {"group_size": args.group_size, "temperature": TEMPERATURE, "learning_rate": args.lr,
                **kw.pop("settings", {})}
    config = GRPOConfig(output_dir=out, max_steps=args.steps, prompts_per_step=args.prompts_per_step,
                        max_new_tokens=5, num_iterations=2, num_minibatches=2,
                        engine_config=GRPO_EMBEDDED_ENGINE, seed=args.seed, log_stdout=False, **settings)
    start = time.perf_counter()
    trainer = trainer_cls(model, tokenizer, get_reward("addition"), dataset, config, accelerator=accelerator, **kw)
    with trainer:
        history = trainer.train()
        final = greedy_accuracy(trainer.policy, tokenizer, AdditionTask(3), n=HELDOUT)["exact"]
    # NOTE: a step's metrics are collected before its update: `heldout_exact` of step s is after s - 1 updates
    curve = [(h["step"] - 1, h["heldout_exact"]) for h in history if "heldout_exact" in h] + [(args.steps, final)]
    return curve, time.perf_counter() - start


def main(argv=None) -> dict:
    args = parse_args(argv)
    accelerator = make_accelerator()
    set_seed(args.seed)
    fresh_output_dir(accelerator, args.output_dir, record=run_record("recipes/distill.py", args),
                     overwrite=args.overwrite)
    teacher_path = args.teacher or os.path.join(args.grpo_dir, "final")
    if not os.path.isdir(teacher_path):  # NOTE: train the GRPO demo's teacher on the fly
        import grpo

        grpo.main(["--output_dir", args.grpo_dir])
    student_path = args.student or os.path.join(args.grpo_dir, "init")
    tokenizer = AutoTokenizer.from_pretrained(student_path)
    teacher = AutoModelForCausalLM.from_pretrained(teacher_path, dtype=torch.float32).eval()
    task = AdditionTask(num_digits=3)
    dataset = task.to_dataset(8192, seed=1000 + args.seed)
    teacher_exact = greedy_accuracy(teacher, tokenizer, task, n=HELDOUT)["exact"]
    student_exact = greedy_accuracy(AutoModelForCausalLM.from_pretrained(student_path), tokenizer, task, n=HELDOUT)[
        "exact"
    ]
    print(f"teacher {teacher_path}: held-out exact {teacher_exact:.3f}; student {student_path}: {student_exact:.3f}")
    curves, walls = {}, {}
    curves["distill"], walls["distill"] = run(DistillTrainer, accelerator, args, student_path, tokenizer, dataset,
                                              os.path.join(args.output_dir, "distill"), teacher=teacher,
                                              advantages=args.advantages, loss=args.loss)
    if not args.no_grpo_baseline:
        curves["grpo"], walls["grpo"] = run(GRPOBaseline, accelerator, args, student_path, tokenizer, dataset,
                                            os.path.join(args.output_dir, "grpo"), settings=GRPO_SETTINGS)
    target = 0.9 * teacher_exact
    reach = {k: next((s for s, e in c if e >= target), None) for k, c in curves.items()}
    summary = dict(teacher=teacher_path, teacher_exact=teacher_exact, student_exact=student_exact, curves=curves,
                   wall_seconds=walls, first_step_at_90pct_teacher=reach, steps=args.steps)
    if accelerator.is_main_process:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 4))
        for name, c in curves.items():
            ax.plot([s for s, _ in c], [e for _, e in c], marker="o", label=f"{name} ({walls[name]:.0f} s)")
        ax.axhline(teacher_exact, color="k", ls="--", label=f"teacher {teacher_exact:.3f}")
        ax.axhline(target, color="gray", ls=":", label="90% of teacher")
        ax.set(xlabel="step", ylabel=f"held-out greedy exact match ({HELDOUT})",
               title="on-policy distillation vs GRPO from the same warm start")
        ax.legend()
        fig.savefig(os.path.join(args.output_dir, "exact_match.png"), dpi=120, bbox_inches="tight")
        write_json(summary, os.path.join(args.output_dir, "summary.json"))
        for name, c in curves.items():
            print(f"{name}: exact match {' '.join(f'{s}:{e:.3f}' for s, e in c)}; {walls[name]:.0f} s; "
                  f"first step at >= 90% of the teacher: {reach[name]}")
    accelerator.end_training()
    return summary


if __name__ == "__main__":
    main()
