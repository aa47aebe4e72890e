"""`collect`: the caller-driven way to run requests, stepping the manager's rounds on the calling thread.

`RolloutEngine.generate` and `generate_batch` use it: the thread that waits for its results computes them,
so a trainer's process keeps running torch work on one thread (its own OpenMP team) while the manager's
background thread parks (`ContinuousBatchingManager.driving`).
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from tqdm.auto import tqdm

from rollout.engine.manager import ContinuousBatchingManager
from rollout.requests import GenerationOutput


def collect(manager: ContinuousBatchingManager, request_ids: Sequence[str], progress: bool = False,
            desc: str = "rollout") -> list[GenerationOutput]:
    """Step the engine on this thread until every request of `request_ids` has delivered its final
    result; returns the results in that order. Enters `driving()` itself (enter it before submitting
    to be sure the background thread never takes one of their steps)."""
    outputs: dict[str, GenerationOutput] = {}
    pending = set(request_ids)
    start, generated = time.perf_counter(), manager.core.stats["generated_tokens"]
    with manager.driving(), tqdm(total=len(pending), desc=desc, unit="seq", disable=not progress, leave=False) as bar:
        while pending:
            out = manager.get_result(timeout=0)
            if out is None:
                if not manager.is_running():
                    tp = manager.core.tp  # NOTE: a broken tensor-parallel group ended the thread (rollout.engine.tp)
                    raise RuntimeError(tp.broken if tp is not None and tp.broken else "the manager stopped with "
                                                                                      "requests pending")
                if not manager.run_once():  # NOTE: nothing to step: another thread holds our results
                    out = manager.get_result(timeout=0.05)
                if out is None:
                    continue
            if out.request_id in pending:
                pending.discard(out.request_id)
                outputs[out.request_id] = out
                rate = (manager.core.stats["generated_tokens"] - generated) / max(time.perf_counter() - start, 1e-9)
                bar.set_postfix(tok_s=f"{rate:.0f}", refresh=False)
                bar.update(1)
    return [outputs[r] for r in request_ids]
