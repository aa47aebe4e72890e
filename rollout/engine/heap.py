"""Full garbage collections kept out of engine steps: the heap that exists when a step starts is frozen for it.

CPython's full (generation-2) collection walks every tracked object, and in a trainer's process (modules, the
model's parameters, datasets, tokenizers) that is 10^5-10^6 objects: one collection costs 30-150 ms and comes
whenever an allocation count says, inside an engine step as readily as anywhere (measured: 137-146 ms at a
401k-object heap, one of them inside a 0.45-second run, which it slowed to 0.7x). vLLM freezes its start-up heap
for the life of its process (`gc.freeze()`); rollout's engine lives in the trainer's process, where objects alive
now may become cyclic garbage later, and a frozen object is never collected. So a freeze here lasts one step:

- `gc.freeze()` when a step starts moves every tracked object to the permanent generation (a list splice, O(1));
  collections during the step walk only what the step itself allocated;
- `gc.unfreeze()` when it ends hands them back to the oldest generation (O(1)); cyclic garbage among them is
  freed by the next full collection, outside the step. Objects still die by reference count while frozen.

A full collection that walks the whole heap still comes, about as often as before (CPython starts one when the
objects promoted since the last exceed a quarter of the heap it counted then), but outside the steps: between them
(rarely: little is allocated there) or in the trainer's own code after `generate` returns.

Steps on several threads (engines of a pool, a server's loop beside a caller) share one freeze, counted: the heap
is handed back when the last step ends. A freeze the program holds itself (`gc.get_freeze_count() > 0` when no step
is running) is left alone, neither added to nor undone; with the collector disabled nothing is done.
`ROLLOUT_FREEZE_GC=0` turns this off.
"""

from __future__ import annotations

import gc
import os
import threading

_lock = threading.Lock()
_holders = 0  # NOTE: steps running now under our freeze
_ours = False  # NOTE: whether the permanent generation is ours to hand back


def enabled() -> bool:
    return os.environ.get("ROLLOUT_FREEZE_GC", "1") != "0"


class FrozenHeap:
    """`with frozen_heap:` around one engine step (re-entrant, thread-safe; see the module docstring)."""

    __slots__ = ()

    def __enter__(self) -> None:
        global _holders, _ours
        with _lock:
            if _holders == 0:
                _ours = enabled() and gc.isenabled() and gc.get_freeze_count() == 0
                if _ours:
                    gc.freeze()
            _holders += 1

    def __exit__(self, *exc) -> None:
        global _holders, _ours
        with _lock:
            _holders -= 1
            if _holders == 0 and _ours:
                _ours = False
                gc.unfreeze()


frozen_heap = FrozenHeap()


def holders() -> int:
    """Steps holding the freeze now (tests)."""
    return _holders
