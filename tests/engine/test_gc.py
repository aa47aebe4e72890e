"""An engine or manager dropped without `close()` / `destroy()` is freed by the garbage collector: its
thread ends and its KV cache is released (issue 13, item 8)."""

from __future__ import annotations

import gc
import weakref

import torch
from support.tiny_models import make_model
from transformers import GenerationConfig

from rollout import (
    ContinuousBatchingConfig,
    RolloutEngine,
    continuous_batching_context_manager,
    init_continuous_batching,
)

GC = GenerationConfig(do_sample=False, eos_token_id=None, max_new_tokens=3)
CBC = ContinuousBatchingConfig(page_size=16, num_blocks=32)


def assert_freed(owner_ref: weakref.ref, thread, core_ref: weakref.ref, kv_ref: weakref.ref) -> None:
    gc.collect()
    assert owner_ref() is None, gc.get_referrers(owner_ref())
    thread.join(timeout=10)
    assert not thread.is_alive()
    gc.collect()
    assert core_ref() is None
    assert kv_ref() is None  # the KV tensors are gone with the core


def refs_of(manager) -> tuple:
    kv = next(iter(manager.core.cache.keys.values()))  # allocated by the first forward
    assert isinstance(kv, torch.Tensor)
    return manager.thread, weakref.ref(manager.core), weakref.ref(kv)


def test_a_dropped_rollout_engine_is_freed():
    engine = RolloutEngine(make_model("qwen3"), config=CBC, generation_config=GC)
    engine.generate([[1, 2, 3]], temps=0.0)
    thread, core_ref, kv_ref = refs_of(engine.manager)
    engine_ref = weakref.ref(engine)
    del engine
    assert_freed(engine_ref, thread, core_ref, kv_ref)


def test_a_dropped_manager_is_freed():
    manager = init_continuous_batching(make_model("qwen3"), generation_config=GC, continuous_batching_config=CBC)
    manager.start()
    manager.add_request([1, 2, 3])
    assert len(list(manager)) == 1
    thread, core_ref, kv_ref = refs_of(manager)
    manager_ref = weakref.ref(manager)
    del manager
    assert_freed(manager_ref, thread, core_ref, kv_ref)


def test_a_persistent_manager_lives_with_its_model():
    model = make_model("qwen3")
    with continuous_batching_context_manager(model, GC, CBC, persistent_manager=True) as manager:
        manager.add_request([1, 2, 3])
        assert len(list(manager)) == 1
    _, core_ref, kv_ref = refs_of(manager)
    manager_ref = weakref.ref(manager)
    del manager
    gc.collect()
    assert manager_ref() is not None  # kept for the next `with` on the same model
    model_ref = weakref.ref(model)
    del model
    gc.collect()
    assert model_ref() is None and manager_ref() is None and core_ref() is None and kv_ref() is None
