"""`Inbox`: the commands a manager's callers queue for its engine core, applied at the start of a round.

Callers on any thread queue `add`, `cancel`, `pause` and `resume`; whichever thread runs the next round
(the background thread, or a caller driving) applies them in order, under the manager's step lock.
Pausing travels through the same queue, so a request submitted before `pause()` runs as in flight and
one submitted after it is held (`held`) until the `resume`. The queue is guarded by the manager's
condition variable.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable

from rollout.engine.core import EngineCore
from rollout.requests import Request, RequestStatus


class Inbox:
    """Args: cv: the manager's condition variable (guards the queue and the held requests); follower: a
    tensor-parallel rank other than 0, whose rounds apply rank 0's commands (`rollout.engine.tp`): its own are dropped
    (its submissions only register which results it waits for)."""

    def __init__(self, cv: threading.Condition, follower: bool = False) -> None:
        self.cv = cv
        self.follower = follower
        self.commands: deque[tuple[str, object]] = deque()
        self.held: deque[Request] = deque()  # submitted while paused, admitted on resume
        self.paused: str | None = None  # the pause mode the rounds have reached (None: running)

    def __len__(self) -> int:
        return len(self.commands)

    def push(self, kind: str, arg: object = None) -> None:
        """Queue one command ("add", "cancel", "pause", "resume"); call under `cv`."""
        if not self.follower:
            self.commands.append((kind, arg))

    def take(self) -> list[tuple[str, object]]:
        """Every queued command, oldest first, leaving the queue empty; call under `cv`."""
        commands = list(self.commands)
        self.commands.clear()
        return commands

    def apply(self, core: EngineCore, commands: list[tuple[str, object]]) -> list[Request]:
        """Apply `commands` to `core` (hold the step lock, not `cv`); returns the requests with news."""
        news: list[Request] = []
        for kind, arg in commands:
            if kind == "add" and self.paused is not None:
                with self.cv:
                    self.held.append(arg)
            elif kind == "pause":
                with self.cv:
                    self.paused = arg
                if arg == "abort":
                    news += [r for r in (core.cancel(rid) for rid in list(core.requests)) if r is not None]
                    news += self._cancel_held(lambda r: True)
            elif kind == "resume":
                with self.cv:
                    self.paused = None
                    held, self.held = list(self.held), deque()
                news += self.apply(core, [("add", r) for r in held])
            elif kind == "add":
                try:
                    core.add(arg)
                except ValueError as e:  # NOTE: raced with a live id; fail this request alone
                    arg.status, arg.finish_reason, arg.error = RequestStatus.FAILED, "error", str(e)
                    news.append(arg)
            elif kind == "cancel":
                req = core.cancel(arg)
                if req is not None:
                    news.append(req)
                news += self._cancel_held(lambda r, rid=arg: r.request_id == rid)
        return news

    def _cancel_held(self, match: Callable[[Request], bool]) -> list[Request]:
        with self.cv:
            gone = [r for r in self.held if match(r)]
            self.held = deque(r for r in self.held if not match(r))
        for req in gone:
            req.status, req.finish_reason = RequestStatus.CANCELLED, "cancelled"
        return gone
