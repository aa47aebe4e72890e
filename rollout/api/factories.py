"""The transformers-compatible entry points: `init_continuous_batching` and
`continuous_batching_context_manager` (with `persistent_manager=True`, one manager per model, kept with
its cache for the next `with`)."""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator

import torch
from transformers import GenerationConfig

from rollout.config import ContinuousBatchingConfig
from rollout.engine.manager import ContinuousBatchingManager

_PERSISTENT: weakref.WeakKeyDictionary[torch.nn.Module, ContinuousBatchingManager] = weakref.WeakKeyDictionary()


def init_continuous_batching(
    model: torch.nn.Module,
    generation_config: GenerationConfig | None = None,
    continuous_batching_config: ContinuousBatchingConfig | None = None,
) -> ContinuousBatchingManager:
    """A new manager for `model` (not started: call `start()`)."""
    return ContinuousBatchingManager(model, generation_config, continuous_batching_config)


@contextlib.contextmanager
def continuous_batching_context_manager(
    model: torch.nn.Module,
    generation_config: GenerationConfig | None = None,
    continuous_batching_config: ContinuousBatchingConfig | None = None,
    persistent_manager: bool = False,
) -> Iterator[ContinuousBatchingManager]:
    """Start a manager, yield it, then drain and stop it on exit (and destroy it unless persistent).

    With `persistent_manager=True` the manager and its cache are kept for the next `with` on the same
    model; that call's `generation_config` replaces the previous one."""
    manager = _PERSISTENT.get(model) if persistent_manager else None
    if manager is not None and (manager.is_destroyed or (continuous_batching_config is not None
                                                       and continuous_batching_config != manager.config)):
        manager = None
    if manager is None:
        manager = init_continuous_batching(model, generation_config, continuous_batching_config)
        if persistent_manager:
            _PERSISTENT[model] = manager
    elif generation_config is not None:
        manager.set_generation_config(generation_config)
    manager.start()
    try:
        yield manager
    finally:
        manager.stop(hard_stop=False, block=True)
        if not persistent_manager:
            manager.destroy()
