"""LoRA policies in the trainers: `RLConfig(lora_rank=r, lora_alpha=a, lora_target_modules="all-linear")`.

With `lora_rank` set, the trainer wraps the policy with PEFT (`get_peft_model`, a `LoraConfig` with dropout 0 and no
bias): the base weights are frozen and shared, the optimizer sees the adapter only. The rollout engine is built on the
PeftModel itself (`RolloutEngine(peft_model)`: the base linears plus the adapter unmerged, one base copy), and each
weight sync copies the adapter's tensors only (`sync_bytes` in `metrics.jsonl`). The KL reference is the same model
with the adapter disabled (`with model.disable_adapter():`, `trainers.reference.AdapterDisabledReference`): no
second copy of the weights. Checkpoints hold the adapter as PEFT's `save_pretrained` writes it (`checkpoint-N/adapter`),
a directory `RolloutEngine.add_lora` and `PeftModel.from_pretrained` load.

Learning rate: "LoRA Without Regret" (Thinking Machines, 2025) finds the best LoRA learning rate about 10x the
best full fine-tuning one, nearly independent of the rank, with the 1/r scaling and alpha 32 (the defaults here).
So `learning_rate=None` means 1e-5 for full fine-tuning and `LORA_LR_FACTOR` x 1e-5 with LoRA; the recipes scale
their own default `--lr` the same way. An explicit learning rate is used as given.

Not supported with LoRA yet, each refused by name: FSDP (the engine's full copy would be a second copy of the base,
and the sync streams every tensor), a given rollout (`rollout=`: a `RolloutPool`'s requests carry no adapter name and
its `update_weights` broadcasts every weight; a `RolloutFleet`'s actors load full state dicts; a `RolloutEngine` built
before the trainer wraps the policy serves no adapter), `batch_invariant` and a compiled engine forward (the
engine's adapters run neither).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

import torch

FULL_FT_LR = 1e-5  # `learning_rate=None` without LoRA
LORA_LR_FACTOR = 10.0  # LoRA Without Regret: the best LoRA lr is ~10x the best full fine-tuning lr
ADAPTER_DIR = "adapter"  # inside a checkpoint directory


def default_learning_rate(full_ft_lr: float, lora_rank: int | None) -> float:
    """The learning rate to use when none is given: `full_ft_lr`, times `LORA_LR_FACTOR` with LoRA on."""
    return full_ft_lr * (LORA_LR_FACTOR if lora_rank is not None else 1.0)


@dataclass
class LoraFields:
    """The LoRA fields of `RLConfig` (so GRPO, PPO and the agent trainer all take them).

    Args:
        lora_rank: train a LoRA adapter of this rank instead of every weight (None = full fine-tuning).
        lora_alpha: PEFT's `lora_alpha`; the adapter's scale is `lora_alpha / lora_rank`.
        lora_target_modules: PEFT's `target_modules`: "all-linear" (every linear but the LM head), or module
            names (suffixes such as "q_proj") the policy must have.
    """

    lora_rank: int | None = None
    lora_alpha: float = 32.0
    lora_target_modules: str | Sequence[str] = "all-linear"

    def check_lora(self) -> None:
        """ValueError naming a bad LoRA field; resolves `learning_rate=None` (see the module docstring)."""
        if self.learning_rate is None:
            self.learning_rate = default_learning_rate(FULL_FT_LR, self.lora_rank)
        if self.lora_rank is None:
            return
        if isinstance(self.lora_rank, bool) or not isinstance(self.lora_rank, int) or self.lora_rank < 1:
            raise ValueError(
                f"lora_rank must be a positive int (None = full fine-tuning), got {self.lora_rank!r}"
            )
        if not self.lora_alpha > 0:
            raise ValueError(f"lora_alpha must be positive, got {self.lora_alpha!r}")
        targets = self.lora_target_modules
        if isinstance(targets, str):
            if targets != "all-linear":
                targets = self.lora_target_modules = (targets,)
        elif not targets or not all(isinstance(t, str) and t for t in targets):
            raise ValueError(f"lora_target_modules must be 'all-linear' or module names, got {targets!r}")
        else:
            self.lora_target_modules = tuple(targets)
        if self.batch_invariant:
            raise ValueError(
                "lora_rank does not run with batch_invariant=True yet (the engine's adapters are not "
                "batch-invariant)"
            )
        from rollout.api.lora import compiles

        if self.engine_config is not None and compiles(self.engine_config):
            raise ValueError(
                "lora_rank does not run with a compiled engine forward yet (engine_config: "
                "default_compile_level >= 1, varlen_compile_config, decode_compile_config, use_cuda_graph)"
            )


def lora_policy(model: torch.nn.Module, config: LoraFields) -> torch.nn.Module:
    """`model` wrapped with a fresh LoRA adapter (PEFT's `get_peft_model`) when `config.lora_rank` is set, else
    `model`. ValueError naming target modules the model lacks, or a model that is no causal LM."""
    if config.lora_rank is None:
        return model
    from peft import LoraConfig, PeftModel, get_peft_model
    from transformers import PreTrainedModel

    if isinstance(model, PeftModel) or not isinstance(model, PreTrainedModel):
        raise ValueError(
            f"lora_rank needs the base causal LM (a transformers PreTrainedModel), got "
            f"{type(model).__name__}: pass the model without an adapter or value head"
        )
    targets = config.lora_target_modules
    if targets != "all-linear":
        names = {
            name.rsplit(".", 1)[-1] for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)
        }
        missing = sorted(set(targets) - names)
        if missing:
            raise ValueError(
                f"lora_target_modules: {missing} are not linear modules of {type(model).__name__} "
                f"(it has {sorted(names)})"
            )
    lora_config = LoraConfig(
        r=config.lora_rank,
        lora_alpha=config.lora_alpha,
        lora_dropout=0.0,
        bias="none",
        target_modules=targets if targets == "all-linear" else list(targets),
    )  # NOTE: no task_type: PeftModelForCausalLM adds forward arguments the engine refuses
    return get_peft_model(model, lora_config)


def adapter_nbytes(policy: torch.nn.Module) -> int:
    """Bytes of the active adapter's LoRA tensors: what one adapter-only weight sync copies."""
    return sum(p.numel() * p.element_size() for name, p in policy.named_parameters() if ".lora_" in name)


class FullWeights:
    """The adapter part of a trainer without LoRA (`lora_rank=None`): every weight trains, each step does nothing
    more. `LoraAdapter` is the other choice."""

    enabled = False

    def wrap(self, model: torch.nn.Module) -> torch.nn.Module:
        """The module to train: `model` itself."""
        return model

    def check_engine(self, engine) -> None:
        """Nothing to check of the rollout engine."""

    def sync_metrics(self, policy: torch.nn.Module) -> dict[str, float]:
        """A step's extra sync metrics (none)."""
        return {}

    def save(self, policy: torch.nn.Module, path: str, main_process: bool) -> None:
        """Nothing beside the checkpoint."""


class LoraAdapter(FullWeights):
    """The adapter part of a LoRA trainer (`lora_rank` set; module docstring): the policy wrapped with a fresh
    adapter, the engine serving it unmerged, adapter-only syncs counted, the adapter saved in each checkpoint.

    Args:
        config: the trainer's config (`LoraFields`).
    """

    enabled = True

    def __init__(self, config: LoraFields) -> None:
        self.config = config

    def wrap(self, model: torch.nn.Module) -> torch.nn.Module:
        """`model` wrapped with PEFT (`lora_policy`)."""
        return lora_policy(model, self.config)

    def check_engine(self, engine) -> None:
        """The engine must serve the policy's adapter unmerged (else each sync would copy the whole model)."""
        if not engine.list_loras():
            engine.close()
            raise ValueError(
                "lora_rank: the rollout engine could not run the adapter unmerged (see the warning "
                "above), so every sync would copy the whole model"
            )

    def sync_metrics(self, policy: torch.nn.Module) -> dict[str, float]:
        """`sync_bytes`: the bytes the step's adapter-only sync copied."""
        return {"sync_bytes": float(adapter_nbytes(policy))}

    def save(self, policy: torch.nn.Module, path: str, main_process: bool) -> None:
        """The adapter in `path/adapter` (PEFT's `save_pretrained`), loadable by `RolloutEngine.add_lora`."""
        if main_process:
            policy.save_pretrained(os.path.join(path, ADAPTER_DIR))
