"""OpenMP teams across threads: a thread that stops running torch work gives its team back.

With libgomp (torch's CPU wheels), every thread that runs a parallel torch op keeps its own team of
worker threads for as long as it lives, idle or not. libgomp counts every team's threads, and once that
count exceeds the CPUs it *throttles* spinning (`gomp_throttled_spin_count_var`, ~100 spins instead of
~300,000): between two parallel regions each worker then sleeps on a futex and must be woken, which
costs a few microseconds per region and a decode step has thousands of regions. So two threads that
each ran torch work once (a trainer's main thread and the engine's own thread) slow *both* for the rest
of the process, even when only one of them is working: measured on 2 cores, 5M model, after one training
step on the main thread, the engine thread decoded at 0.75x the speed of the same steps driven from the
main thread, and 2 torch threads were slower than 1 (benchmarks/PROFILE.md, "Threads").
`GOMP_SPINCOUNT` and `OMP_WAIT_POLICY` do not help (the throttled count ignores the first; PASSIVE
makes every wake a futex). What does is OpenMP 5.0's `omp_pause_resource_all`, which frees the *calling*
thread's team (libgomp: `gomp_pause_host`) and lowers the count: a thread that is about to block on the
engine, or an engine thread about to idle, calls `release_thread_team()`; its next parallel op builds a
new team (tens of microseconds).

Runtimes without the call (or no OpenMP at all) make this a no-op.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import threading
from collections.abc import Callable, Iterator

logger = logging.getLogger("rollout")

OMP_PAUSE_SOFT = 1  # NOTE: omp_pause_resource_t: 1 = soft (threads freed, state kept), 2 = hard
_RUNTIMES = ("libgomp", "libiomp", "libomp")

_pause: Callable[[int], int] | None = None
_resolved = False
_lock = threading.Lock()


def _find_pause() -> Callable[[int], int] | None:
    """`omp_pause_resource_all` of the OpenMP runtime torch loaded, or None."""
    import torch  # noqa: F401  NOTE: make sure torch (and its OpenMP runtime) is loaded first

    try:
        with open("/proc/self/maps") as f:
            paths = {line.split()[-1] for line in f if any(r in line for r in _RUNTIMES) and "/" in line}
    except OSError:  # NOTE: not Linux: no team bookkeeping of this kind to undo
        return None
    for path in sorted(paths):
        try:
            fn = ctypes.CDLL(path).omp_pause_resource_all
        except (OSError, AttributeError):
            continue
        fn.argtypes = [ctypes.c_int]
        fn.restype = ctypes.c_int
        return fn
    return None


def release_thread_team() -> bool:
    """Free the calling thread's OpenMP team (see the module docstring); True if the runtime did.

    Call it on a thread that will not run torch work for a while: before blocking on results another
    thread computes, or before an engine thread idles. Never inside a parallel region (the runtime then
    refuses and nothing happens)."""
    global _pause, _resolved
    if not _resolved:
        with _lock:
            if not _resolved:
                _pause = _find_pause()
                _resolved = True
    return _pause is not None and _pause(OMP_PAUSE_SOFT) == 0


@contextlib.contextmanager
def team_released_after() -> Iterator[None]:
    """Run the body (torch work on a helper thread: a weight copy, a sleep), then free this thread's team
    so that its idle workers do not slow the engine's thread."""
    try:
        yield
    finally:
        release_thread_team()
