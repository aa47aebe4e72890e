"""`generate_batch`: run a list of prompts to completion, stepping the engine on the calling thread."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers import GenerationConfig

from rollout.config import ContinuousBatchingConfig
from rollout.engine.collect import collect
from rollout.engine.manager import ContinuousBatchingManager
from rollout.requests import GenerationOutput


def generate_batch(
    model: torch.nn.Module,
    inputs: Sequence[Sequence[int]],
    generation_config: GenerationConfig | None = None,
    continuous_batching_config: ContinuousBatchingConfig | None = None,
    progress_bar: bool = False,
    **request_kwargs,
) -> dict[str, GenerationOutput]:
    """Generate for every prompt in `inputs`; returns `{request_id: GenerationOutput}` in submission order.

    `request_kwargs` (max_new_tokens, temperature, top_k, top_p, seed, and the sampling fields of
    `rollout.SamplingParams` by name, or `sampling=SamplingParams(...)`: min_p, repetition_penalty, logit_bias, ...)
    apply to every request, over the `generation_config`'s; a field of `generation_config` the engine does not implement
    (num_beams > 1, ...) is a ValueError naming it.
    Bad input raises ValueError before anything runs. With `progress_bar=True` a tqdm bar shows
    finished requests and generated tokens/s. A manager of its own runs the requests (the same rounds
    as `RolloutEngine.generate`: `rollout.engine.collect`) and is destroyed at the end.
    """
    manager = ContinuousBatchingManager(model, generation_config, continuous_batching_config)
    try:
        reqs = [manager.make_request(ids, request_id=f"req_{i}", **request_kwargs) for i, ids in enumerate(inputs)]
        manager.start()
        with manager.driving():  # NOTE: before submitting, so the background thread never takes a step
            manager.submit(reqs)
            outputs = collect(manager, [r.request_id for r in reqs], progress=progress_bar, desc="generate_batch")
    finally:
        manager.destroy()
    return {out.request_id: out for out in outputs}
