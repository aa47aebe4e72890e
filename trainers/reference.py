"""Reference-model logprobs through a rollout engine: `RolloutEngine.score` over the frozen reference's
weights instead of a padded forward (a group's shared prompt is computed once, padding costs nothing, only
the completion positions reach the LM head). A LoRA policy's reference is its base with the adapter disabled
(`AdapterDisabledReference`, a padded forward).

`EngineReference(model, engine_config)(data, chunks, top_k, top_p)` returns `[N, T]` fp32 logprobs of the
completions, processed at each row's temperature exactly as `trainers.common.scored_logprobs` computes them
(greedy rows at temperature 1). With the engine's top-k / top-p truncation on, the trainer's rule (the
sampled token always kept) differs from the engine's processed logprobs, so that case keeps the padded
forward (`reference_logprobs`).
"""

from __future__ import annotations

import time

import torch
from torch import Tensor

from rollout import ContinuousBatchingConfig, RolloutEngine
from trainers.common import reference_logprobs


class EngineReference:
    """Scores completions under a frozen `model` through its own engine, built on first use.

    Args:
        model: the frozen reference (its parameters are shared with the engine, never copied).
        engine_config: the engine configuration (logprobs_mode is forced to "processed").
        use_engine: False keeps the padded forward everywhere.
    """

    def __init__(self, model: torch.nn.Module, engine_config: ContinuousBatchingConfig | None = None,
                 use_engine: bool = True) -> None:
        self.model = model
        self.config = (engine_config or ContinuousBatchingConfig()).replace(logprobs_mode="processed")
        self.use_engine = use_engine
        self.engine: RolloutEngine | None = None
        self.seconds = 0.0  # NOTE: time of the last call, reported as the step's `time_reference`

    @torch.no_grad()
    def __call__(self, data: dict[str, Tensor], chunks: int, top_k: int | None = None,
                 top_p: float | None = None) -> Tensor:
        start = time.perf_counter()
        if not self.use_engine or (top_k or 0) > 0 or (top_p is not None and top_p < 1.0):
            out = reference_logprobs(self.model, data, chunks, top_k=top_k, top_p=top_p)
        else:
            out = self._score(data)
        self.seconds = time.perf_counter() - start
        return out

    def _score(self, data: dict[str, Tensor]) -> Tensor:
        if self.engine is None:
            self.engine = RolloutEngine(self.model, config=self.config)
        ids, mask = data["completion_ids"], data["completion_mask"]  # [N, T]
        p_len = data["input_ids"].shape[1] - ids.shape[1]
        prompts = [row[m.bool()].tolist() for row, m in zip(data["input_ids"][:, :p_len],
                                                            data["attention_mask"][:, :p_len], strict=True)]
        completions = [row[m.bool()].tolist() for row, m in zip(ids, mask, strict=True)]
        scored = self.engine.score(prompts, completions, temps=data["temperatures"].tolist())
        out = torch.zeros(ids.shape, dtype=torch.float32)
        out[:, : scored.logprobs.shape[1]] = scored.logprobs.cpu()
        return out.to(ids.device)

    def close(self) -> None:
        if self.engine is not None:
            self.engine.close()
            self.engine = None


class AdapterDisabledReference:
    """The KL reference of a LoRA policy (`trainers.lora`): the policy's own base weights, its adapter disabled for
    the pass (`with policy.disable_adapter():`), in eval mode; no copy of any weight. Called as `EngineReference`.

    Args:
        policy: the trainer's `PeftModel`.
    """

    def __init__(self, policy: torch.nn.Module) -> None:
        self.policy = policy
        self.seconds = 0.0

    @torch.no_grad()
    def __call__(self, data: dict[str, Tensor], chunks: int, top_k: int | None = None,
                 top_p: float | None = None) -> Tensor:
        start, training = time.perf_counter(), self.policy.training
        self.policy.eval()
        try:
            with self.policy.disable_adapter():
                out = reference_logprobs(self.policy, data, chunks, top_k=top_k, top_p=top_p)  # [N, T]
        finally:
            self.policy.train(training)
        self.seconds = time.perf_counter() - start
        return out

    def close(self) -> None:
        pass

