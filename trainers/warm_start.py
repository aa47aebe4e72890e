"""The embedded task's supervised warm start: ``bos a+b= -> answer eos`` until greedy exact match lands in a band.

    model = build_tiny_model(tokenizer)
    sft_warm_start(model, tokenizer, AdditionTask(num_digits=3, seed=0))   # exact ~0.30 +- 0.05 on held-out problems

The task is learnt through a sudden transition whose step varies with the seed and the transformers version, so
a fixed step count lands anywhere (one fresh install stopped at 0.463 for a 0.3 target): the stop is measured.
"""

from __future__ import annotations

import random
import time

import torch
from transformers import PreTrainedTokenizerFast

from trainers.tasks import AdditionTask, greedy_accuracy

# NOTE: the stop evaluates on problems of its own, apart from greedy_accuracy's default seed (the held-out
# problems the recipes report), so the accuracy reported afterwards is not the one the stop was chosen on.
_STOP_EVAL_SEED = 54321
_CONFIRM_SEED = 24680
CONFIRM_PROBLEMS = 2048  # NOTE: sd ~0.01 at 0.3; the every-step check's 512 (sd 0.02) picks its own high draws


def _sft_batch(
    tokenizer: PreTrainedTokenizerFast, rows: list[dict[str, str]]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded ``bos prompt answer eos`` with labels only on ``answer eos``.

    Returns ``input_ids [B, L]``, ``attention_mask [B, L]``, ``labels [B, L]`` (-100 elsewhere).
    """
    seqs, label_seqs = [], []
    for row in rows:
        prompt_ids = tokenizer(row["prompt"]).input_ids  # starts with bos
        target_ids = tokenizer(row["answer"], add_special_tokens=False).input_ids + [tokenizer.eos_token_id]
        seqs.append(prompt_ids + target_ids)
        label_seqs.append([-100] * len(prompt_ids) + target_ids)
    return pad_right(seqs, label_seqs, tokenizer.pad_token_id)


def pad_right(seqs: list[list[int]], label_seqs: list[list[int]], pad_id: int
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``input_ids [B, L]`` (right-padded with `pad_id`), ``attention_mask [B, L]``, ``labels [B, L]`` (-100
    past each row's labels)."""
    width = max(len(s) for s in seqs)
    input_ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)  # [B, L]
    attention_mask = torch.zeros((len(seqs), width), dtype=torch.long)  # [B, L]
    labels = torch.full((len(seqs), width), -100, dtype=torch.long)  # [B, L]
    for i, (s, lab) in enumerate(zip(seqs, label_seqs, strict=True)):
        input_ids[i, : len(s)] = torch.tensor(s)
        attention_mask[i, : len(s)] = 1
        labels[i, : len(lab)] = torch.tensor(lab)
    return input_ids, attention_mask, labels


class SupervisedSteps:
    """The warm starts' optimisation: AdamW (betas 0.9 / 0.98, no weight decay) at constant `lr` after a short
    linear warmup, grad-norm clip 1.0, one step per call on a right-padded batch; `mean_loss` is the mean of
    the last 10 steps' losses."""

    def __init__(self, model: torch.nn.Module, lr: float, steps: int) -> None:
        self.model, self.device = model, next(model.parameters()).device
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.98), weight_decay=0.0)
        warmup = max(1, min(20, steps // 10))
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda s: min(1.0, (s + 1) / warmup))
        self.recent: list[float] = []

    def __call__(self, input_ids: torch.Tensor, labels: torch.Tensor) -> float:  # [B, L] each
        self.model.train()
        # NOTE: padding is on the right and attention is causal, so no real token ever sees a pad:
        # the mask can be left out, which lets sdpa take its faster causal path.
        loss = self.model(input_ids=input_ids.to(self.device), labels=labels.to(self.device)).loss
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.optimizer.step()
        self.scheduler.step()
        self.recent = (self.recent + [loss.item()])[-10:]
        return self.mean_loss

    def scale_lr(self, factor: float) -> None:
        """Multiply the learning rate of every later step by `factor`."""
        self.scheduler.base_lrs = [lr * factor for lr in self.scheduler.base_lrs]

    @property
    def mean_loss(self) -> float:
        return sum(self.recent) / len(self.recent)


def sft_warm_start(
    model: torch.nn.Module,
    tokenizer: PreTrainedTokenizerFast,
    task: AdditionTask,
    steps: int = 1000,
    batch_size: int = 64,
    lr: float = 3e-3,
    seed: int = 0,
    progress: bool = True,
    target_exact: float | None = 0.3,
    eval_every: int = 25,
    band: float = 0.05,
) -> float:
    """Supervised warm start on ``bos a+b= -> answer eos`` (loss on answer and eos only).

    AdamW at constant ``lr`` after a short linear warmup, grad-norm clip 1.0, a fresh batch of
    problems each step drawn from ``random.Random(seed)``. Trains ``model`` in place on its
    current device and leaves it in eval mode. Returns the mean loss of the last 10 steps.

    Stops once greedy exact match is within ``target_exact +- band / 2`` (None: always run ``steps``), so
    that other problems measure it within ``+- band``: evaluated on 256 problems every ``eval_every`` steps
    until exact reaches a quarter of the target (the transition has begun), then on 512 every step; a
    check within ``band / 2`` below the target or above it is measured again on ``CONFIRM_PROBLEMS``
    fresh problems, and that figure decides: within ``+- band / 2`` stops; above goes back to the last
    check's weights and retraces from there (at half the learning rate when it was already checking
    every step); below goes on. The confirmation removes the every-step check's selection of its own
    high draws (stopping on a 512-problem check alone landed 0.06 low on held-out problems).

    Measured (hidden 128, 3 layers, batch 64, lr 3e-3, 3-digit zero-padded problems): loss plateaus near
    1.2 until a transition at step ~400 for seeds 0 and 2; seed 1 sits on a second plateau and runs all
    1000 steps. ~65 ms a step on 2 idle cores.
    """
    if steps < 1 or eval_every < 1:
        raise ValueError(f"steps and eval_every must be >= 1, got {steps} and {eval_every}")
    rng = random.Random(seed)
    sft = SupervisedSteps(model, lr, steps)
    low, high = (None, None) if target_exact is None else (target_exact - band / 2, target_exact + band / 2)
    start, fine, before = time.perf_counter(), False, None  # NOTE: before: (exact, weights, fine) at the last check
    for step in range(1, steps + 1):
        input_ids, _, labels = _sft_batch(tokenizer, task.sample(batch_size, rng))
        mean = sft(input_ids, labels)
        exact, done = None, step == steps
        if target_exact is not None and (fine or step % eval_every == 0):
            exact = greedy_accuracy(model, tokenizer, task, n=512 if fine else 256, seed=_STOP_EVAL_SEED)["exact"]
            if not fine and exact >= target_exact / 4:
                fine, exact = True, greedy_accuracy(model, tokenizer, task, n=512, seed=_STOP_EVAL_SEED)["exact"]
            if exact >= low:
                exact = greedy_accuracy(model, tokenizer, task, n=CONFIRM_PROBLEMS, seed=_CONFIRM_SEED)["exact"]
                done = done or low <= exact <= high
            if exact > high and before is not None:
                model.load_state_dict(before[1])
                if before[2]:
                    sft.scale_lr(0.5)
                if progress:
                    print(f"sft step {step}: exact {exact:.3f} jumped past {target_exact}+-{band / 2}; back to the "
                          f"last check ({before[0]:.3f}){', half the learning rate' if before[2] else ''}")
                exact = before[0]
            before = (exact, {k: v.detach().clone() for k, v in model.state_dict().items()}, fine)
        if progress and (step % 50 == 0 or done):
            shown = "" if exact is None else f" exact {exact:.3f}"
            print(f"sft step {step}/{steps} loss {mean:.4f}{shown} ({time.perf_counter() - start:.1f}s)")
        if done:
            break
    model.eval()
    return sft.mean_loss
