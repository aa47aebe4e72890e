"""The manager's background thread: it runs rounds (`ContinuousBatchingManager.round`) while there is work
and nobody else drives, and sleeps on the manager's condition variable otherwise.

The thread holds its manager only weakly between rounds, so a manager nobody references is collected (its
finalizer wakes the thread, which then ends). Before it idles it frees its OpenMP team (`rollout.engine.openmp`).
Daemon threads never block interpreter exit; an exit hook stops live managers cleanly.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import threading
import weakref

from rollout.engine.openmp import release_thread_team
from rollout.engine.tp import TensorParallelTimeout

logger = logging.getLogger("rollout")


def start_engine_thread(manager, cv: threading.Condition) -> threading.Thread:
    """Start the background thread of `manager` (a `ContinuousBatchingManager`) waiting on `cv`."""
    thread = threading.Thread(target=_engine_loop, args=(weakref.ref(manager), cv), name="rollout-engine", daemon=True)
    thread.start()
    return thread


# NOTE: a safety net only: every wake-up that matters (submissions, stops, the manager's finalizer) notifies.
IDLE_RECHECK_S = 30.0


def _engine_loop(ref: weakref.ref, cv: threading.Condition) -> None:
    """The background thread. It holds the manager only while it works on it; idle, it waits on the
    condition variable holding nothing but `ref`, so an unreferenced manager is collected and its
    finalizer's notify ends the thread. Before idling it gives back its OpenMP team (rollout.engine.openmp), so
    that a trainer's work on its own thread runs unthrottled meanwhile."""
    team = False  # NOTE: whether a step may have built an OpenMP team since the last release
    while True:
        manager = ref()
        if manager is None:
            return
        with cv:
            if manager.idle():
                tp = manager.core.tp
                wait_s = IDLE_RECHECK_S if tp is None else tp.idle_wait_s()  # NOTE: rank 0's heartbeat
                del manager, tp
                if team:
                    team = False
                    release_thread_team()
                if ref() is not None:  # NOTE: collected just now (in this thread): no notify will come
                    cv.wait(wait_s)
                continue
        try:
            worked, going = manager.round()
        except TensorParallelTimeout as e:  # NOTE: the group is broken; callers get its error (rollout.engine.collect)
            logger.error("the engine thread ends: %s", e)
            return
        team = team or worked
        if not going:
            if team:
                release_thread_team()
            return
        del manager


def wake(cv: threading.Condition) -> None:
    with cv:
        cv.notify_all()


# NOTE: daemon threads never block interpreter exit; this only lets them finish their step cleanly.
LIVE_MANAGERS: weakref.WeakSet = weakref.WeakSet()


@atexit.register
def _stop_all_at_exit() -> None:
    for manager in list(LIVE_MANAGERS):
        with contextlib.suppress(Exception):
            manager.stop(hard_stop=True, block=True, timeout=2.0)
