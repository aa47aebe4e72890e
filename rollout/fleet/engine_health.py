"""`EngineHealth`: a fleet's view of its engine actors: work in flight, failures, and which are recovering.

An engine that fails a call (its actor died, or it hung and was killed) is restarted by Ray and marked
recovering: no new work goes to it until a `ready()` probe answers; then, if it holds an older weight version than
the fleet (it read the weight store before the latest update landed there), it gets the current weights first:
the object-store copy of the latest update, or, when that update came by broadcast (no such copy), a survivor's
copy of its own weights (`copy_of`), put in the object store then and kept in the weight store for the next one.
An engine that failed more than `max_restarts` times is dropped for good.
"""

from __future__ import annotations

import logging
import threading
import time

from rollout.fleet.shards import plan_shards

logger = logging.getLogger("rollout.fleet")


class EngineHealth:
    """Bookkeeping of `actors` (all calls thread-safe).

    Args:
        ray: the `ray` module; actors: the engine actor handles; infos: their first `ready()` answers.
        max_restarts: failures an engine may have before it is dropped; start_timeout_s: a recovery's deadline.
    """

    def __init__(self, ray, actors: list, infos: list[dict], max_restarts: int, start_timeout_s: float,
                 store=None) -> None:
        self.ray, self.actors, self.infos, self.store = ray, actors, list(infos), store
        self.max_restarts, self.start_timeout_s = max_restarts, start_timeout_s
        self.load = [0] * len(actors)  # groups (or scored rows) in flight on each engine
        self.failures = [0] * len(actors)
        self.recovering: set[int] = set()
        self.restarts = 0  # engine failures seen (each restarted by Ray, up to max_restarts)
        self.resubmitted = 0  # shards sent again after their engine died or hung
        self.current: tuple[object, int] | None = None  # (object-store ref of the weights or None, version)
        self.lock = threading.RLock()

    # ------------------------------------------------------------------ which engines
    def alive(self) -> list[int]:
        """Engines not dropped (recovering ones included)."""
        return [k for k in range(len(self.actors)) if self.failures[k] <= self.max_restarts]

    def serving(self) -> list[int]:
        """Engines that take work now: alive and not recovering; waits for a recovery when none is left."""
        self.poll()
        deadline = time.monotonic() + self.start_timeout_s
        while True:
            with self.lock:
                alive = self.alive()
                ready = [k for k in alive if k not in self.recovering]
            if ready:
                return ready
            if not alive:
                raise RuntimeError(f"no rollout engine left alive (of {len(self.actors)})")
            if time.monotonic() > deadline:
                raise RuntimeError(f"no rollout engine recovered within {self.start_timeout_s:.0f} s")
            time.sleep(0.1)
            self.poll()

    def poll(self, timeout_s: float = 0.0) -> None:
        """Probe each recovering engine once (waiting up to `timeout_s` for its answer); put the ready ones back."""
        for k in sorted(self.recovering):
            self.probe(k, timeout_s)

    def probe(self, k: int, timeout_s: float) -> bool:
        """Whether engine `k` answers `ready()` within `timeout_s`; if it does, it is on the current weights."""
        ray = self.ray
        try:
            ref = self.actors[k].ready.remote()
            done, _ = ray.wait([ref], timeout=timeout_s)
            if not done:
                return False
            info = ray.get(ref)
            current = self.current
            if current is not None and info["version"] != current[1]:
                ref = current[0] if current[0] is not None else self.copy_of(current[1], k)
                info["version"] = ray.get(self.actors[k].update_weights.remote(ref, current[1], "wait"),
                                          timeout=self.start_timeout_s)
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError, LookupError):
            return False
        with self.lock:
            self.infos[k] = info
            if k in self.recovering:
                self.recovering.discard(k)
                logger.info("rollout engine %d is back (pid %d, weights v%d)", k, info["pid"], info["version"])
        return True

    def copy_of(self, version: int, k: int):
        """An object-store copy of weights `version` from a serving engine other than `k` (LookupError if none
        has it); it becomes `current` and the weight store's, for the next replacement."""
        for j in self.alive():
            if j == k or j in self.recovering:
                continue
            try:
                (ref,) = self.ray.get(self.actors[j].export_weights.remote(version), timeout=self.start_timeout_s)
            except Exception as err:  # NOTE: dead, or on another version: ask the next one
                logger.info("rollout engine %d has no copy of weights v%d: %s", j, version, err)
                continue
            if self.store is not None:
                (ref,) = self.ray.get(self.store.adopt.remote([ref], version), timeout=self.start_timeout_s)
            if self.current is not None and self.current[1] == version:
                self.current = (ref, version)
            logger.info("rollout engine %d gets weights v%d copied from engine %d", k, version, j)
            return ref
        raise LookupError(f"no serving engine holds weights v{version}")

    def wait_all(self) -> list[dict]:
        """Every alive engine's `ready()` answer, waiting (up to `start_timeout_s`) for the recovering ones."""
        deadline = time.monotonic() + self.start_timeout_s
        for k in self.alive():
            while not self.probe(k, max(0.0, deadline - time.monotonic())):
                if time.monotonic() > deadline:
                    raise RuntimeError(f"rollout engine {k} did not come back within {self.start_timeout_s:.0f} s")
                time.sleep(0.1)
        return [self.infos[k] for k in self.alive()]

    # ----------------------------------------------------------------------- work
    def reserve(self, n: int) -> list[tuple[int, int, int]]:
        """Contiguous shards of `n` items over the serving engines, least loaded first, counted in flight."""
        serving = self.serving()
        with self.lock:
            shards = plan_shards(n, self.load, serving)
            for k, start, end in shards:
                self.load[k] += end - start
        return shards

    def done(self, k: int, count: int) -> None:
        with self.lock:
            self.load[k] -= count

    def failed(self, k: int, reason: str, count: int, unit: str, kill: bool = False) -> None:
        """Engine `k` failed a call holding `count` items: recovering (or dropped), with one warning line."""
        with self.lock:
            self.load[k] -= count
            if k in self.recovering:  # NOTE: another call on the same dead actor: one failure, one line
                return
            self.failures[k] += 1
            self.restarts += 1
            gone = self.failures[k] > self.max_restarts
            if not gone:
                self.recovering.add(k)
        if kill:
            self.ray.kill(self.actors[k], no_restart=gone)
        what = "out of restarts, dropped" if gone else "restarted by Ray, it gets the current weights"
        logger.warning("rollout engine %d failed (%s): %s; resubmitting its %d %s(s)", k, reason, what, count, unit)

    def take_over(self, k: int, count: int) -> int:
        """The engine that takes `count` items from failed engine `k`: the least loaded serving one."""
        serving = self.serving()
        with self.lock:
            others = [j for j in serving if j != k] or serving
            target = min(others, key=lambda j: self.load[j])
            self.load[target] += count
            self.resubmitted += 1
        return target
