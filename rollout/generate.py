"""`generate_batch`: run a list of prompts to completion on the calling thread."""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch
from tqdm.auto import tqdm
from transformers import GenerationConfig

from .config import ContinuousBatchingConfig
from .core import EngineCore
from .requests import GenerationOutput


def generate_batch(
    model: torch.nn.Module,
    inputs: Sequence[Sequence[int]],
    generation_config: GenerationConfig | None = None,
    continuous_batching_config: ContinuousBatchingConfig | None = None,
    progress_bar: bool = False,
    **request_kwargs,
) -> dict[str, GenerationOutput]:
    """Generate for every prompt in `inputs`; returns `{request_id: GenerationOutput}` in submission order.

    `request_kwargs` (max_new_tokens, temperature, top_k, top_p, seed) apply to every request.
    Bad input raises ValueError before anything runs. With `progress_bar=True` a tqdm bar shows
    finished requests and generated tokens/s.
    """
    core = EngineCore(model, generation_config, continuous_batching_config)
    reqs = [core.make_request(ids, request_id=f"req_{i}", **request_kwargs) for i, ids in enumerate(inputs)]
    for req in reqs:
        core.add(req)
    bar = tqdm(total=len(reqs), desc="generate_batch", unit="req", disable=not progress_bar)
    start = time.perf_counter()
    with bar:
        while core.has_work():
            done = [r for r in core.step() if r.status.is_final]
            if done:
                rate = core.stats["generated_tokens"] / max(time.perf_counter() - start, 1e-9)
                bar.set_postfix(tok_s=f"{rate:.0f}")
                bar.update(len(done))
    return {r.request_id: r.to_output() for r in reqs}
