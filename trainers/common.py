"""Shared pieces of the RL trainers: the base config, prompt sharding, the teacher-forced logprob pass,
the parity probe, minibatch plans, learning-rate schedules and cross-rank metric reduction.

Everything here is a plain function or a small value object; the trainers compose them.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from rollout.config import ContinuousBatchingConfig
from rollout.sampling.seeding import derive_seed
from rollout.sampling_params import check_temperature
from trainers.lora import LoraFields
from trainers.losses import entropy_from_logits, masked_mean, token_logprobs

# ------------------------------------------------------------------------------------------ config


@dataclass
class RLConfig(LoraFields):
    """Fields shared by `GRPOConfig` and `PPOConfig` (all per process unless said otherwise).

    Args:
        output_dir: where `metrics.jsonl` and checkpoints go.
        max_steps: RL steps `train()` runs (rollout -> update -> weight sync).
        prompts_per_step: prompts each process rolls out per step (global = this x world size).
        group_size: completions per prompt (a group never crosses processes).
        max_new_tokens: completion budget.
        temperature: one sampling temperature, or one per prompt slot of a step (length
            `prompts_per_step`); a dataset column "temperature" overrides both per row.
        top_k, top_p: engine sampling filters; the trainer scores tokens under the same truncated,
            renormalised distribution the engine sampled from (parity probe and ratio alike).
        num_iterations: epochs over each rollout batch (PPO-style reuse; 1 = on-policy).
        num_minibatches: optimizer steps per epoch.
        gradient_accumulation_steps: micro-batches (forward/backward passes) per optimizer step.
        learning_rate, weight_decay, adam_betas: AdamW (used when no optimizer is passed); learning_rate None:
            1e-5, x10 with LoRA (`trainers.lora`). lora_rank, lora_alpha, lora_target_modules: `LoraFields`.
        max_grad_norm: clip the global grad norm (None disables).
        lr_schedule: key of `LR_SCHEDULES` ("constant", "linear", "cosine"); `warmup_steps` of
            linear warmup first; counted in RL steps over `max_steps`.
        clip_low, clip_high: override the algorithm's ratio clip.
        tis_cap: truncated-importance-sampling cap for rollout/trainer mismatch (None disables).
        reward_weights: one weight per reward function (default all 1).
        engine_config: a `rollout.ContinuousBatchingConfig` (default: the engine's own defaults).
        reference_engine: score the frozen reference (KL) with `RolloutEngine.score` on its own engine
            (`trainers.reference`) rather than a padded forward (kept when top_k / top_p truncate).
        engine_dtype: run the engine on a cast copy of the policy ("bfloat16", ...); None shares
            the trainer's own model (zero-copy weight sync).
        engine_memory_fraction: the share of free accelerator memory the engine's KV cache may take
            when it is built (overrides `engine_config.max_memory_percent` on an accelerator; None keeps
            it). The default leaves room for training on the same GPU; on a CPU it is not applied (the
            engine's own CPU default, or an explicit `engine_config.max_memory_percent`, sizes the cache).
        sleep_engine: release the KV cache after each rollout and take it back before the weight
            sync, so the update has the memory; None = when the engine shares a CUDA device.
        disable_dropout: set every dropout probability of the policy and reference to 0 (as TRL),
            so the trainer's recomputation matches the rollout; False keeps them.
        chat_template: apply the tokenizer's chat template to plain-text prompts too (as one user
            message); conversational prompts (lists of messages) always go through it.
        seed: seeds prompt order, rollout sampling and minibatch shuffling.
        shuffle: shuffle the dataset each epoch.
        save_steps: checkpoint every this many steps into `output_dir/checkpoint-{step}` (0 = never).
        save_total_limit: keep only the newest this many checkpoints (None = all).
        log_stdout, progress: a compact line per step / a tqdm bar (main process only).
        batch_invariant: the engine's batch-invariant mode, and the trainer's logprob passes through the same
            ops on the engine's dtype (`trainers.invariant`): `logprob_mismatch_max` is exactly 0.0.
        routing_replay: MoE policies: the trainer's passes take the experts the engine chose (R3,
            `trainers.routing_replay`); logs `routing_mismatch_fraction`.
        score_on_sampling_mask: the engine returns each token's sampling mask (`SamplingParams(
            return_sampling_mask=True)`) and the trainer scores the old and new policy on exactly that support, not
            on its own top-k / top-p cut of its logits; logs `sampling_mask_kept` (ids kept per token).
        fsdp: shard the policy with FSDP2 (`trainers.sharding`): True, False, or "auto" (when the accelerate
            launch config is FSDP, e.g. `recipes/accelerate/2cpu_fsdp.yaml`).
    """

    output_dir: str = "outputs"
    max_steps: int = 100
    prompts_per_step: int = 8
    group_size: int = 8
    max_new_tokens: int = 64
    temperature: float | Sequence[float] = 1.0
    top_k: int | None = None
    top_p: float | None = None
    num_iterations: int = 1
    num_minibatches: int = 1
    gradient_accumulation_steps: int = 1
    learning_rate: float | None = None
    weight_decay: float = 0.0
    adam_betas: tuple[float, float] = (0.9, 0.999)
    max_grad_norm: float | None = 1.0
    lr_schedule: str = "constant"
    warmup_steps: int = 0
    clip_low: float | None = None
    clip_high: float | None = None
    tis_cap: float | None = None
    reward_weights: Sequence[float] | None = None
    engine_config: ContinuousBatchingConfig | None = None
    reference_engine: bool = True
    engine_dtype: str | None = None
    engine_memory_fraction: float | None = 0.3
    sleep_engine: bool | None = None
    disable_dropout: bool = True
    chat_template: bool = False
    seed: int = 0
    shuffle: bool = True
    save_steps: int = 0
    save_total_limit: int | None = None
    log_stdout: bool = True
    progress: bool = True
    batch_invariant: bool = False
    routing_replay: bool = False
    score_on_sampling_mask: bool = False
    fsdp: bool | str = "auto"

    def __post_init__(self) -> None:
        self.check_lora()
        if self.batch_invariant:  # NOTE: the engine must run the same invariant ops
            self.engine_config = (self.engine_config or ContinuousBatchingConfig()).replace(batch_invariant=True)
        for name in ("max_steps", "prompts_per_step", "group_size", "max_new_tokens", "num_iterations",
                     "num_minibatches", "gradient_accumulation_steps"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        for name in ("warmup_steps", "save_steps"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        rows = self.prompts_per_step * self.group_size
        micro = self.num_minibatches * self.gradient_accumulation_steps
        if rows % micro:
            raise ValueError(
                f"prompts_per_step x group_size = {rows} rows do not split into num_minibatches x "
                f"gradient_accumulation_steps = {micro} equal micro-batches"
            )
        if self.fsdp not in (True, False, "auto"):
            raise ValueError(f"fsdp must be True, False or 'auto', got {self.fsdp!r}")
        if self.lr_schedule not in LR_SCHEDULES:
            raise ValueError(f"lr_schedule must be one of {sorted(LR_SCHEDULES)}, got {self.lr_schedule!r}")
        if not isinstance(self.temperature, (int, float)):
            self.temperature = tuple(float(t) for t in self.temperature)
            if len(self.temperature) != self.prompts_per_step:
                raise ValueError(
                    f"temperature has {len(self.temperature)} values for "
                    f"prompts_per_step={self.prompts_per_step}"
                )
        temps = (self.temperature,) if isinstance(self.temperature, (int, float)) else self.temperature
        for t in temps:
            check_temperature(t, "temperature")
        if self.engine_memory_fraction is not None and not 0 < self.engine_memory_fraction <= 1:
            raise ValueError(f"engine_memory_fraction must be in (0, 1], got {self.engine_memory_fraction}")
        if self.save_total_limit is not None and self.save_total_limit < 1:
            raise ValueError(f"save_total_limit must be >= 1 or None, got {self.save_total_limit}")
        if self.top_k is not None and self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if self.top_p is not None and not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.tis_cap is not None and self.tis_cap <= 0:
            raise ValueError(f"tis_cap must be positive, got {self.tis_cap}")
        if self.engine_dtype is not None and not isinstance(
            getattr(torch, self.engine_dtype, None), torch.dtype
        ):
            raise ValueError(f"engine_dtype must name a torch dtype, got {self.engine_dtype!r}")

    def temperatures(self, rows: Sequence[Mapping[str, Any]]) -> list[float]:
        """Per-prompt temperatures for one step's rows (a "temperature" column wins)."""
        base = self.temperature
        out = []
        for i, row in enumerate(rows):
            default = base if isinstance(base, (int, float)) else base[i % len(base)]
            out.append(float(row.get("temperature", default)))
        return out


# ----------------------------------------------------------------------------------------- prompts


class PromptSource:
    """Deterministic per-rank prompt shards: step `s` on rank `r` always gets the same rows.

    The dataset (a `datasets.Dataset` or a list of dicts with a "prompt" column) is read as an
    endless stream of epochs, each a seeded permutation; step `s` takes the next
    `per_rank x world` positions, rank `r` the `r`-th contiguous slice. Because the rows depend
    only on the step, resuming from a checkpoint needs no data-loader state.
    """

    def __init__(
        self, dataset, per_rank: int, rank: int = 0, world: int = 1, seed: int = 0, shuffle: bool = True
    ) -> None:
        if len(dataset) == 0:
            raise ValueError("the training dataset is empty")
        first = dataset[0]
        if not isinstance(first, Mapping) or "prompt" not in first:
            raise ValueError("dataset rows must be dicts with a 'prompt' column")
        self.dataset, self.per_rank, self.rank, self.world = dataset, per_rank, rank, world
        self.seed, self.shuffle = seed, shuffle
        self._epoch, self._order = -1, list(range(len(dataset)))

    def rows(self, step: int) -> list[dict[str, Any]]:
        start = (step * self.world + self.rank) * self.per_rank
        return [self._row(pos) for pos in range(start, start + self.per_rank)]

    def extra_rows(self, step: int, round_: int) -> list[dict[str, Any]]:
        """Rows for refill round `round_` (1, 2, ...) of step `step`: a seeded draw of its own,
        so dynamic sampling stays reproducible and resumable."""
        rng = random.Random(f"{self.seed}/{step}/{round_}/{self.rank}")
        return [dict(self.dataset[rng.randrange(len(self.dataset))]) for _ in range(self.per_rank)]

    def _row(self, position: int) -> dict[str, Any]:
        epoch, index = divmod(position, len(self.dataset))
        if epoch != self._epoch:
            self._epoch, self._order = epoch, list(range(len(self.dataset)))
            if self.shuffle:
                random.Random(self.seed * 1_000_003 + epoch).shuffle(self._order)
        return dict(self.dataset[self._order[index]])


def rollout_seed(seed: int, step: int, rank: int) -> int:
    """The seed of one rank's rollout call at `step`, distinct for every (seed, step, rank); the engine, the
    server and the pool derive each group's and sample's stream from it (`rollout.sampling.seeding`)."""
    return derive_seed(derive_seed(seed, step), rank)


# ----------------------------------------------------------------------------- teacher forcing


def safe_temperatures(temps: Tensor) -> Tensor:
    """[N] sampling temperatures with 0 (greedy) replaced by 1: the engine reports the raw
    logprob for greedy rows, so the trainer scores them at temperature 1."""
    return torch.where(temps > 0, temps, torch.ones_like(temps)).float()


def completion_forward(model: torch.nn.Module, data: Mapping[str, Tensor], **kwargs) -> Any:
    """Teacher-forced forward on `input_ids [N, P+T]` asking only for the logits of the T
    positions that predict completion tokens (`logits_to_keep=T+1`, last one dropped by callers).

    Positions follow the attention mask (left padding), as in the engine."""
    mask = data["attention_mask"]  # [N, P+T]
    position_ids = (mask.long().cumsum(-1) - 1).clamp_min(0)  # [N, P+T]
    t = data["completion_ids"].shape[1]
    return model(
        input_ids=data["input_ids"],
        attention_mask=mask,
        position_ids=position_ids,
        logits_to_keep=t + 1,
        use_cache=False,
        **kwargs,
    )


def truncate_logits(scaled: Tensor, tokens: Tensor, top_k: int | None, top_p: float | None) -> Tensor:
    """The engine's top-k then top-p filter (`rollout.sampling.sampler`) on temperature-scaled logits:
    `[N, T, V]` with -inf outside the kept set, the sampled `tokens [N, T]` always kept."""
    if not top_k and (top_p is None or top_p >= 1.0):
        return scaled
    with torch.no_grad():
        drop = torch.zeros_like(scaled, dtype=torch.bool)  # [N, T, V]
        if top_k:
            kth = scaled.topk(min(top_k, scaled.shape[-1]), dim=-1).values[..., -1:]  # [N, T, 1]
            drop |= scaled < kth
        if top_p is not None and top_p < 1.0:
            sorted_logits, order = scaled.masked_fill(drop, float("-inf")).sort(dim=-1, descending=True)
            probs = sorted_logits.softmax(dim=-1)  # [N, T, V]
            drop_sorted = (probs.cumsum(dim=-1) - probs) >= top_p
            drop_sorted[..., 0] = False  # NOTE: the most likely token is always kept
            drop |= torch.zeros_like(drop).scatter(-1, order, drop_sorted)
        # NOTE: a sampled token is inside the engine's kept set; a last-bit tie must not drop it.
        drop.scatter_(-1, tokens.long().unsqueeze(-1), False)
    return scaled.masked_fill(drop, float("-inf"))


def support_mask(ids: Tensor, vocab: int) -> Tensor:
    """`[N, T, K]` support ids (-1 padding; `rollout_support_ids`) as a `[N, T, V]` bool mask; a position without
    ids (padding past a completion) keeps every token, so its (unused) logprobs stay finite."""
    mask = torch.zeros((*ids.shape[:2], vocab), dtype=torch.bool, device=ids.device)  # [N, T, V]
    valid = ids >= 0
    mask.scatter_(-1, ids.clamp(min=0), valid)
    return mask | ~valid.any(-1, keepdim=True)


def scored_logprobs(
    logits: Tensor,
    data: Mapping[str, Tensor],
    with_entropy: bool = False,
    top_k: int | None = None,
    top_p: float | None = None,
) -> tuple[Tensor, Tensor | None]:
    """`log_softmax` of the sampling distribution (logits / T, then the engine's top-k / top-p
    truncation, renormalised) at the completion tokens, and optionally the per-token entropy of
    the untruncated `softmax(logits / T)`.

    Args:
        logits: `[N, T+1, V]` from `completion_forward` (the last position predicts nothing).
        data: holds `completion_ids [N, T]` and `temperatures [N]`.
    Returns:
        `(logprobs [N, T] fp32, entropy [N, T] fp32 or None)`.
    """
    # NOTE: the engine's processed logprobs are under the distribution it sampled from, so the
    # trainer's policy is that one as well: the ratio and the parity probe compare like with like.
    temps = safe_temperatures(data["temperatures"])  # [N]
    scaled = logits[:, :-1].float() / temps[:, None, None]  # [N, T, V]
    if "sampling_support" in data:  # NOTE: the engine's own support of each token (score_on_sampling_mask)
        truncated = scaled.masked_fill(~support_mask(data["sampling_support"], scaled.shape[-1]), float("-inf"))
    else:
        truncated = truncate_logits(scaled, data["completion_ids"], top_k, top_p)  # [N, T, V]
    logprobs = token_logprobs(truncated, data["completion_ids"])  # [N, T]
    entropy = entropy_from_logits(scaled.detach()) if with_entropy else None  # [N, T]
    return logprobs, entropy


@torch.no_grad()
def reference_logprobs(
    model: torch.nn.Module, data: Mapping[str, Tensor], chunks: int, **truncation
) -> Tensor:
    """No-grad `[N, T]` logprobs of the completions under `model` (e.g. a frozen reference);
    `truncation` (top_k, top_p) as in `scored_logprobs`."""
    parts = []
    for idx in torch.arange(data["completion_ids"].shape[0]).tensor_split(chunks):
        micro = {k: v[idx] for k, v in data.items()}
        logprobs, _ = scored_logprobs(completion_forward(model, micro).logits, micro, **truncation)
        parts.append(logprobs)
    return torch.cat(parts)


def disable_dropout(model: torch.nn.Module) -> None:
    """Dropout off everywhere in `model`: every `nn.Dropout` gets p = 0, and so does the float
    `attention_dropout` / `attn_dropout` some attention modules pass to their kernel (as TRL)."""
    for module in model.modules():
        if isinstance(module, torch.nn.modules.dropout._DropoutNd):
            module.p = 0.0
        for name in ("attention_dropout", "attn_dropout", "dropout"):
            if isinstance(getattr(module, name, None), float):
                setattr(module, name, 0.0)


def logprob_mismatch(rollout: Tensor, trainer: Tensor, mask: Tensor) -> dict[str, float]:
    """Parity probe: `|rollout - trainer|` logprobs over the generated tokens ([N, T] each)."""
    diff = (rollout.float() - trainer.float()).abs()  # [N, T]
    valid = mask.bool()
    worst = diff[valid].max().item() if valid.any() else 0.0
    return {"logprob_mismatch_max": worst, "logprob_mismatch_mean": masked_mean(diff, valid).item()}


# ---------------------------------------------------------------------------------- minibatches


# NOTE: the denominator each aggregation divides by, so micro-batch losses can be re-weighted
# into exactly the loss of their whole minibatch.
AGG_DENOMINATORS: dict[str, Callable[[Tensor], Tensor]] = {
    "token_mean": lambda mask: mask.sum(),
    "seq_mean_token_mean": lambda mask: mask.any(dim=-1).sum(),
    "seq_mean_token_sum_norm": lambda mask: torch.tensor(mask.shape[0]),
}


def minibatch_plan(
    n: int, num_minibatches: int, accumulation: int, generator: torch.Generator
) -> list[list[Tensor]]:
    """A shuffled split of `n` rows into `num_minibatches` lists of `accumulation` index tensors.

    The counts never depend on the data, so every rank runs the same number of backward passes."""
    order = torch.randperm(n, generator=generator)
    return [list(mb.tensor_split(accumulation)) for mb in order.tensor_split(num_minibatches)]


# ------------------------------------------------------------------------------------ schedules


LR_SCHEDULES: dict[str, Callable[[float], float]] = {
    "constant": lambda progress: 1.0,
    "linear": lambda progress: max(0.0, 1.0 - progress),
    "cosine": lambda progress: 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress))),
}


def lr_factor(step: int, schedule: str, warmup_steps: int, total_steps: int) -> float:
    """Multiplier of the base learning rate at RL step `step` (0-based): linear warmup, then decay."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
    return LR_SCHEDULES[schedule](progress)


# -------------------------------------------------------------------------------------- metrics


def reduction_of(name: str) -> str:
    """How a metric combines across ranks: worst case for maxima and wall times, total throughput."""
    if name.endswith("_max") or name.startswith("time_"):
        return "max"
    if name.endswith("_per_s"):
        return "sum"
    return "mean"


def reduce_metrics(accelerator, metrics: dict[str, float]) -> dict[str, float]:
    """Combine per-rank scalar metrics through one `gather`. A key only some ranks log (a reward function's
    `log_metric` on some ranks), or log as NaN, is combined over the ranks that have a value."""
    if accelerator.num_processes == 1:
        return dict(metrics)
    from accelerate.utils import gather_object

    keys = sorted(set().union(*gather_object([sorted(metrics)])))  # NOTE: every rank's keys
    local = torch.tensor(
        [[float(metrics.get(k, math.nan)) for k in keys]], dtype=torch.float64, device=accelerator.device
    )
    gathered = accelerator.gather(local).cpu()  # [W, K]
    ops = {"max": lambda c: c.max(), "sum": lambda c: c.sum(), "mean": lambda c: c.mean()}
    out = {}
    for i, k in enumerate(keys):
        column = gathered[:, i][~gathered[:, i].isnan()]  # [<= W]
        out[k] = ops[reduction_of(k)](column).item() if column.numel() else math.nan
    return out
