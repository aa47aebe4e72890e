"""rollout as the generation backend of TRL's `GRPOTrainer` (its `rollout_func` hook).

```python
from rollout.integrations.trl import make_rollout_func
trainer = trl.GRPOTrainer(model=model, reward_funcs=..., args=trl.GRPOConfig(...),
                          train_dataset=ds, processing_class=tok, rollout_func=make_rollout_func())
```

TRL calls `rollout_func(prompts, trainer)` with the prompts of this process, each dataset row repeated
`num_generations` times (eval: `num_generations_eval`), repeats adjacent, and wants one completion per
row back, in that order. This module needs no `import trl`: it reads the trainer's public settings
(`temperature`, `top_p`, `top_k`, `max_completion_length`, `num_generations`, `eos_token_ids`, ...).
"""

from __future__ import annotations

import hashlib
import logging
import math
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from transformers import GenerationConfig

from rollout.api.batch import RolloutBatch
from rollout.api.chat import chat_template_ids, is_conversational
from rollout.api.engine import RolloutEngine
from rollout.config import ContinuousBatchingConfig
from rollout.sampling_params import SamplingParams

logger = logging.getLogger("rollout")

# the logits processors (`SamplingParams` fields, vLLM's names)
PROCESSOR_KEYS = ("min_p", "repetition_penalty", "presence_penalty", "frequency_penalty", "min_tokens", "logit_bias",
                  "bad_words_ids", "stop_token_ids")
# keyword -> the `SamplingParams` field it sets (`progress`: generate's bar); these override the trainer's settings
GENERATE_KEYS = {
    "temperature": "temperature",
    "top_k": "top_k",
    "top_p": "top_p",
    "max_new_tokens": "max_tokens",
    "seed": "seed",
    "progress": "progress",
    **{k: k for k in PROCESSOR_KEYS},
}
# `GRPOConfig.generation_kwargs` keys this backend honours (the others change sampling in ways it cannot):
# vLLM's names, and transformers' where they differ (min_new_tokens, eos_token_id)
GENERATION_KWARGS = {"temperature": "temperature", "top_k": "top_k", "top_p": "top_p",
                     "max_new_tokens": "max_new_tokens", "max_tokens": "max_new_tokens", "do_sample": None,
                     "min_new_tokens": "min_tokens", **{k: k for k in PROCESSOR_KEYS}}
# TRL's own metric names for the sampler-vs-trainer logprob gap (it logs them only for vLLM)
GAP_MEAN = "sampling/sampling_logp_difference/mean"
GAP_MAX = "sampling/sampling_logp_difference/max"


def make_rollout_func(
    config: ContinuousBatchingConfig | None = None, *, logprob_probe: bool = False, **generate_defaults
) -> TRLRolloutFunc:
    """TRL's `rollout_func(prompts, trainer) -> dict`, generating with a `RolloutEngine`.

    Args:
        config: the engine's `ContinuousBatchingConfig` (default: `ContinuousBatchingConfig()`).
        logprob_probe: also recompute every rollout's logprobs with the trainer's own model, the way
            TRL's loss does, and log the gap under TRL's names `sampling/sampling_logp_difference/mean`
            and `.../max` (one extra forward pass per generation batch).
        **generate_defaults: `temperature`, `top_k`, `top_p`, `max_new_tokens` and the processors
            (`min_p`, `repetition_penalty`, `presence_penalty`, `frequency_penalty`, `min_tokens`,
            `logit_bias`, `bad_words_ids`, `stop_token_ids`) override the trainer's settings; `seed` replaces
            `trainer.args.seed` as the base of the sampling seeds; `progress` shows a bar. Anything else is a ValueError
            naming it.
    Returns:
        a callable object; `close()` frees its engine (the garbage collector does too).
    """
    unknown = sorted(set(generate_defaults) - set(GENERATE_KEYS))
    if unknown:
        raise ValueError(f"make_rollout_func: unknown keyword {unknown[0]!r}; valid: {sorted(GENERATE_KEYS)}")
    if config is not None and not isinstance(config, ContinuousBatchingConfig):
        raise ValueError(f"config must be a ContinuousBatchingConfig, got {type(config).__name__}")
    return TRLRolloutFunc(config, logprob_probe, generate_defaults)


class TRLRolloutFunc:
    """The object `make_rollout_func` returns: one `RolloutEngine` per process, built on first use on the
    trainer's unwrapped model (sharing its parameters), its policy version bumped whenever
    `trainer.state.global_step` has moved since the last call."""

    def __init__(self, config: ContinuousBatchingConfig | None, logprob_probe: bool, overrides: dict) -> None:
        self.config = config
        self.logprob_probe = logprob_probe
        self.overrides = dict(overrides)
        self.engine: RolloutEngine | None = None
        self._model: torch.nn.Module | None = None
        self._step: int | None = None  # trainer.state.global_step the engine's weights were last synced at
        self._calls = 0

    # ------------------------------------------------------------------------------ the hook
    def __call__(self, prompts: list, trainer: Any) -> dict[str, list]:
        if not prompts:
            raise ValueError("prompts: TRL passed no prompts")
        mode = "train" if trainer.model.training else "eval"
        expected = trainer.num_generations if mode == "train" else trainer.num_generations_eval
        runs = _runs(prompts)
        # NOTE: a process's slice may cut a group at its edges (TRL splits rows, not groups, over processes),
        # so each run of equal prompts gets as many samples as it has rows; the engine's group is the
        # largest size that divides every run (num_generations when the slice holds whole groups).
        group = math.gcd(expected or 0, *(n for _, n in runs))
        unique = [p for p, n in runs for _ in range(n // group)]
        engine = self._engine_for(trainer)
        step = trainer.state.global_step
        if step != self._step:
            engine.update_weights(self._model)  # zero copy: bumps the version, drops stale prefix KV
            self._step = step
        ids = tokenize_prompts(trainer, unique)
        kwargs = self._sampling(trainer)
        self._calls += 1
        start = time.perf_counter()
        batch = engine.generate(ids, group_size=group, **kwargs)
        seconds = time.perf_counter() - start
        out = _to_rows(batch)
        n_tokens = int(batch.completion_mask.sum())
        _record(trainer, mode, "rollout/generate_s", seconds)
        _record(trainer, mode, "rollout/tokens_per_s", n_tokens / seconds if seconds > 0 else 0.0)
        _record(trainer, mode, "rollout/policy_version", float(batch.policy_version))
        if self.logprob_probe:
            start = time.perf_counter()
            self._probe(trainer, mode, batch)
            _record(trainer, mode, "rollout/probe_s", time.perf_counter() - start)
        return out

    # --------------------------------------------------------------------------- internals
    def _engine_for(self, trainer) -> RolloutEngine:
        model = trainer.accelerator.unwrap_model(trainer.model)
        if self.engine is not None and model is self._model:
            return self.engine
        if self.engine is not None:  # another trainer or a replaced model: start over on the new one
            self.close()
        tokenizer = getattr(trainer.processing_class, "tokenizer", trainer.processing_class)
        # NOTE: TRL stops on `trainer.eos_token_ids` (the tokenizer's and the model's eos); the engine adds
        # the tokenizer's own. The sampling fields are only defaults: every call passes the trainer's.
        stops = [t for t in getattr(trainer, "eos_token_ids", None) or [] if t is not None]
        gc = GenerationConfig(do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                              max_new_tokens=trainer.max_completion_length, eos_token_id=stops or None,
                              pad_token_id=getattr(tokenizer, "pad_token_id", None))
        self.engine = RolloutEngine(model, tokenizer, config=self.config, generation_config=gc)
        self._model = model
        self._step = trainer.state.global_step
        logger.info("rollout: engine built for TRL on %s (process %d)", type(model).__name__,
                    trainer.accelerator.process_index)
        return self.engine

    def _sampling(self, trainer) -> dict:
        """The `RolloutEngine.generate` keywords: the trainer's settings, then its `generation_kwargs`,
        then this function's overrides."""
        settings = {
            "temperature": trainer.temperature,
            "top_k": trainer.top_k,
            "top_p": trainer.top_p,
            "max_new_tokens": trainer.max_completion_length,
            "seed": trainer.args.seed,
            "min_p": getattr(trainer, "min_p", None),
            "repetition_penalty": getattr(trainer, "repetition_penalty", None),
        }
        for key, value in (getattr(trainer.args, "generation_kwargs", None) or {}).items():
            if key not in GENERATION_KWARGS:
                raise ValueError(f"generation_kwargs[{key!r}]: not supported by the rollout backend; "
                                 f"supported: {sorted(GENERATION_KWARGS)}")
            if GENERATION_KWARGS[key] is not None:
                settings[GENERATION_KWARGS[key]] = value
        settings.update(self.overrides)
        seed = settings.pop("seed")
        progress = bool(settings.pop("progress", False))
        fields = {GENERATE_KEYS[k]: v for k, v in settings.items()}
        if seed is not None:  # NOTE: a fresh seed per call and process, reproducible from the base seed
            fields["seed"] = _call_seed(seed, trainer.accelerator.process_index, self._calls)
        return {"sampling": SamplingParams.from_fields(fields), "progress": progress}

    def _probe(self, trainer, mode: str, batch: RolloutBatch) -> None:
        """TRL's own recomputation of the rollouts' logprobs (its loss path) against the engine's."""
        t_len = batch.completion_ids.shape[1]  # NOTE: TRL scores the last T positions of prompt + completion
        with torch.no_grad():
            logps, _, _ = trainer._get_per_token_logps_and_entropies(
                trainer.model, batch.input_ids, batch.attention_mask, t_len, batch_size=len(batch)
            )  # [N, T]
        mask = batch.completion_mask.bool()  # [N, T]
        gap = (logps.float() - batch.logprobs).abs()[mask]
        device = trainer.accelerator.device
        # NOTE: every piece on gap's device (torch.stack refuses a CPU scalar next to CUDA ones)
        local = torch.stack([gap.sum(), gap.new_tensor(float(gap.numel())), gap.max() if gap.numel() else
                             gap.new_tensor(0.0)]).to(device)  # [3]
        every = trainer.accelerator.gather(local.unsqueeze(0)).reshape(-1, 3)  # [W, 3]
        total, count = every[:, 0].sum(), every[:, 1].sum()
        _record(trainer, mode, GAP_MEAN, float(total / count) if count > 0 else 0.0)
        _record(trainer, mode, GAP_MAX, float(every[:, 2].max()))

    def close(self) -> None:
        if self.engine is not None:
            self.engine.close()
        self.engine, self._model, self._step = None, None, None


# ----------------------------------------------------------------------------------- helpers


def _runs(prompts: Sequence) -> list[tuple[Any, int]]:
    """Consecutive equal prompts as (prompt, count), in order."""
    runs: list[tuple[Any, int]] = []
    for p in prompts:
        if runs and runs[-1][0] == p:
            runs[-1] = (p, runs[-1][1] + 1)
        else:
            runs.append((p, 1))
    return runs


def tokenize_prompts(trainer, prompts: list) -> list[list[int]]:
    """Prompt ids as TRL's own generation path makes them: the chat template (with the trainer's
    `tools`, `chat_template` and `chat_template_kwargs`) for conversational prompts, else the
    processing class on the text."""
    if getattr(trainer, "environment_factories", None) is not None:
        raise ValueError("environment_factory: per-environment tool schemas are not supported by the rollout backend")
    processing = trainer.processing_class
    if hasattr(processing, "image_processor"):
        raise ValueError("processing_class: multimodal processors are not supported by the rollout backend")
    kinds = {is_conversational(p) for p in prompts}
    if len(kinds) > 1:
        raise ValueError("prompts: a batch mixes conversational and plain-text prompts")
    if kinds == {True}:
        kwargs = dict(
            tools=getattr(trainer, "tools", None) or None,
            chat_template=getattr(trainer, "chat_template", None),
            **(getattr(trainer, "chat_template_kwargs", None) or {}),
        )
        return [chat_template_ids(processing, p, **kwargs) for p in prompts]
    if not all(isinstance(p, str) for p in prompts):
        raise ValueError("prompts: each prompt must be a string or a list of chat messages")
    return [list(ids) for ids in processing(text=prompts)["input_ids"]]


def _to_rows(batch: RolloutBatch) -> dict[str, list]:
    """TRL's rollout_func output: unpadded lists per row, in row order, plus `finish_reasons`."""
    p_lens = batch.prompt_mask.sum(dim=1).tolist()  # [N]
    c_lens = batch.completion_mask.sum(dim=1).tolist()  # [N]
    prompt_ids = batch.prompt_ids.tolist()  # left-padded
    completion_ids = batch.completion_ids.tolist()  # right-padded
    logprobs = batch.logprobs.tolist()
    width = batch.prompt_ids.shape[1]
    return {
        "prompt_ids": [row[width - n:] for row, n in zip(prompt_ids, p_lens, strict=True)],
        "completion_ids": [row[:n] for row, n in zip(completion_ids, c_lens, strict=True)],
        "logprobs": [row[:n] for row, n in zip(logprobs, c_lens, strict=True)],
        "finish_reasons": list(batch.finish_reasons),
    }


def _call_seed(seed: int, rank: int, call: int) -> int:
    digest = hashlib.blake2b(f"{seed}/{rank}/{call}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1  # fits a signed int64


def _record(trainer, mode: str, name: str, value: float) -> None:
    """Append a scalar to the trainer's per-mode metrics (TRL averages them over each logging step)."""
    metrics = getattr(trainer, "_metrics", None)
    if isinstance(metrics, dict) and mode in metrics:
        metrics[mode][name].append(value)


RolloutFunc = Callable[[list, Any], dict]
