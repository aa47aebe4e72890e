"""`Outbox`: where a manager's outputs wait for their consumers.

Every submitted request is *live* until its final output has been delivered: taken by a listener,
returned by `get`, or read as the last chunk of its stream. Final outputs queue in submission-agnostic
finishing order; streaming requests also get a queue of partial chunks. All state is guarded by the
manager's condition variable (shared with its inbox), so a consumer waiting here wakes on every
publication, submission and stop.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator

from rollout.engine.openmp import release_thread_team
from rollout.requests import GenerationOutput, Request

logger = logging.getLogger("rollout")


class Outbox:
    """Args: cv: the manager's condition variable (guards everything here)."""

    def __init__(self, cv: threading.Condition) -> None:
        self.cv = cv
        self.results: deque[GenerationOutput] = deque()  # final outputs not yet delivered
        self.streams: dict[str, deque[GenerationOutput]] = {}  # chunks of streaming requests
        self.live: set[str] = set()  # submitted, final output not yet delivered
        self.listeners: list[Callable[[GenerationOutput], bool]] = []

    # ------------------------------------------------------------ producers
    def expect(self, requests: Iterable[Request]) -> None:
        """Register submitted requests (call under `cv`, after checking their ids are free). An id live already
        is left as it is: a tensor-parallel follower's submission of a request rank 0's round brought
        (rollout.engine.tp)."""
        for req in requests:
            if req.request_id in self.live:
                continue
            self.live.add(req.request_id)
            self.streams.pop(req.request_id, None)  # NOTE: never a stale stream of an earlier same-id request
            if req.streaming:
                self.streams[req.request_id] = deque()

    def publish(self, news: list[Request]) -> None:
        """Hand each request's news (final, or a chunk when streaming) to a listener or the queues."""
        if not news:
            return
        with self.cv:
            for req in news:
                out = req.to_output()
                if self._taken(out):
                    continue
                stream = self.streams.get(req.request_id)
                if stream is not None:
                    stream.append(out)
                if out.status.is_final:
                    self.results.append(out)
            self.cv.notify_all()

    def _taken(self, out: GenerationOutput) -> bool:
        for fn in self.listeners:
            try:
                taken = fn(out)
            except Exception:  # NOTE: a listener's bug must not kill the engine loop
                logger.exception("manager listener failed")
                continue
            if taken:
                if out.status.is_final:
                    self.streams.pop(out.request_id, None)
                    self.live.discard(out.request_id)
                return True
        return False

    # ------------------------------------------------------------ consumers
    def get(self, request_id: str | None, timeout: float | None, producing: Callable[[], bool],
            release_team: bool) -> GenerationOutput | None:
        """The next final output (of `request_id` when given); None on timeout, or when none can come
        (nothing live, or `producing()` is False). `release_team`: free this thread's OpenMP team before
        blocking (another thread computes what we wait for; see rollout.engine.openmp)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        released = not release_team
        while True:
            with self.cv:
                while True:
                    for i, out in enumerate(self.results):
                        if request_id is None or out.request_id == request_id:
                            del self.results[i]
                            # NOTE: the final chunk is already in the stream deque a `stream` reader holds.
                            self.streams.pop(out.request_id, None)
                            self._delivered(out.request_id)
                            return out
                    if (request_id is None and not self.live) or (
                        request_id is not None and request_id not in self.live
                    ):
                        return None
                    if not producing():
                        return None
                    remaining = None if deadline is None else deadline - time.monotonic()
                    if remaining is not None and remaining <= 0:
                        return None
                    if not released:
                        break  # NOTE: free the team outside the lock (the producer must not wait on it)
                    self.cv.wait(remaining)
            released = True
            release_thread_team()

    def stream(self, request_id: str, running: Callable[[], bool], release_team: bool) -> Iterator[GenerationOutput]:
        """Partial outputs of a streaming request as they grow; the last one has a final status."""
        with self.cv:
            chunks = self.streams.get(request_id)
        if chunks is None:
            out = self.get(request_id, None, running, release_team)
            if out is not None:
                yield out
            return
        released = not release_team
        while True:
            with self.cv:
                while not chunks and running() and released:
                    self.cv.wait()
                if not chunks and not running():
                    self.streams.pop(request_id, None)
                    return
                chunk = chunks.popleft() if chunks else None
                if chunk is not None and chunk.status.is_final:
                    self.streams.pop(request_id, None)
                    self.results = deque(o for o in self.results if o.request_id != request_id)
                    self._delivered(request_id)
            if chunk is None:  # NOTE: about to block: free the team outside the lock, then wait
                released = True
                release_thread_team()
                continue
            yield chunk
            if chunk.status.is_final:
                return

    def _delivered(self, request_id: str) -> None:
        self.live.discard(request_id)
        self.cv.notify_all()
