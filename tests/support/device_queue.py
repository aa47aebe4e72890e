"""`DelayedQueue`: a device queue for `rollout.engine.async_steps` that runs each step's device part late, as a GPU
does, so a CPU test proves the host never needs a step's results before it resolves that step.

Device parts run first in, first out (as on one CUDA stream), each only once more than `depth` are waiting or
when someone asks for its results (`result()` runs everything queued up to it). Until a part has run, the tensors it
writes still hold what they held: a host that read them early, or fed the next step from the host instead of
the device, would see the placeholder (-1) and sample something else. `wait_order` records which step each
`result()` waited for and `ran` how many parts ran, for the tests.
"""

from __future__ import annotations

from collections import deque

from rollout.engine.async_steps import Copied


class Handle:
    def __init__(self, queue: DelayedQueue, fn, number: int) -> None:
        self.queue, self.fn, self.number = queue, fn, number
        self.copied: Copied | None = None

    def run(self) -> None:
        self.copied = Copied(*self.fn())
        self.fn = None

    def result(self):
        self.queue.wait_order.append(self.number)
        while self.copied is None:
            self.queue.run_one()
        return self.copied.result()


class DelayedQueue:
    def __init__(self, depth: int = 1) -> None:
        self.depth = depth
        self.waiting: deque[Handle] = deque()
        self.submitted = 0
        self.ran = 0
        self.max_waiting = 0
        self.wait_order: list[int] = []

    def submit(self, fn) -> Handle:
        handle = Handle(self, fn, self.submitted)
        self.submitted += 1
        self.waiting.append(handle)
        self.max_waiting = max(self.max_waiting, len(self.waiting))
        while len(self.waiting) > self.depth:
            self.run_one()
        return handle

    def run_one(self) -> None:
        self.waiting.popleft().run()
        self.ran += 1
