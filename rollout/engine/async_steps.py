"""`use_async_batching=True`: the host schedules and queues step k+1 while the device still runs step k.

A step is queued in two parts (`ModelRunner.stage`): its host part builds the inputs from the requests as they
are; its device part (the forward, the sampler's `draw`, one copy of the sampled tokens and logprobs) goes to a
`DeviceQueue` and returns at once. Its sampled tokens are not known when the next step is scheduled, so every row
it sampled gets a placeholder token (`PLACEHOLDER`) and stays scheduled as if it went on; the next step's input
ids for those rows are written on the device from this step's token tensor (`rollout.model.runner.Feed`). Only
after the next step is queued does the host read this step's outputs (`resolve`: one non-blocking copy into
pinned host memory on CUDA, waited for by its event) and fill the placeholders in, stop the rows that drew an
EOS or stop token (their row of the next step is dropped: one wasted row each), record logprobs and versions.
A row that reaches `max_new_tokens` with its placeholder is known to end, so it is taken out of the running list
at once (no wasted row). The outputs are the synchronous engine's, token for token: a seeded row draws at its
position (`len(generated)`, placeholders counted), and nothing the device part reads is changed by the host
before it runs, but through the device's own order (the queue is FIFO, like a CUDA stream).

Steps that read the host's token histories run synchronously, after the step in flight is resolved: rows with
logits processors, top logprobs or scoring, routed experts, LoRA adapters, the first step (its layer check).
`settle()` resolves the step in flight now (its news kept for the next `step()`): `cancel`, `fail_all`, sleeping,
and whoever takes the manager's `StepLock` between two steps (a weight update) settle first, so what they change
never reaches a step queued before. Not with tensor parallelism or speculative decoding (the pipeline is off).

On a CPU the queue runs each device part at once (no overlap: nothing to gain); tests give the pipeline a queue
that delays completions (`tests/support/device_queue.py`), which proves the host never reads a step's results
before it resolves it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass

import torch

from rollout.model.runner import Feed
from rollout.requests import Request, RequestStatus
from rollout.scheduling.stages import SchedulerOutput
from rollout.tensors import int_tensor

PLACEHOLDER = -1  # NOTE: the token id of a row whose sampled token is still on the device


class Copied:
    """A queued step's outputs: tokens [R] and logprobs [R] (or None) copied once, non-blocking, into pinned host
    memory on CUDA (read after its event); on a CPU the tensors themselves."""

    def __init__(self, tokens: torch.Tensor, logprobs: torch.Tensor | None) -> None:
        both = tokens.double()[None] if logprobs is None else torch.stack([tokens.double(), logprobs.double()])
        self.event = None
        if both.is_cuda:
            self.host = torch.empty(both.shape, dtype=both.dtype, pin_memory=True)
            self.host.copy_(both, non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record()
        else:
            self.host = both
        self.with_logprobs = logprobs is not None

    def result(self) -> tuple[list[int], list[float] | None]:
        if self.event is not None:
            self.event.synchronize()
        rows = self.host.tolist()
        return [int(t) for t in rows[0]], rows[1] if self.with_logprobs else None


class DeviceQueue:
    """Runs each device part at once: on CUDA that enqueues its kernels and returns (the stream is the queue)."""

    def submit(self, fn: Callable[[], tuple[torch.Tensor, torch.Tensor | None]]) -> Copied:
        return Copied(*fn())


@dataclass(slots=True)
class InFlight:
    """A queued step: its sampled rows (request, row of `tokens`), its token tensor on the device, the handle on
    its outputs, the policy version that sampled it."""

    rows: list[tuple[Request, int]]
    tokens: torch.Tensor
    handle: object
    version: int
    index: dict[int, int]  # NOTE: id(request) -> its row of `tokens`


class AsyncSteps:
    """The pipeline of one `EngineCore` (see the module docstring). The core's private steps come in as callables."""

    def __init__(self, core, finalize, check_weights, count_prompt_tokens, unstick, queue=None) -> None:
        self.core = core
        self.finalize, self.check_weights = finalize, check_weights
        self.count_prompt_tokens, self.unstick = count_prompt_tokens, unstick
        self.queue = queue or DeviceQueue()
        self.pending: InFlight | None = None
        self.news: list[Request] = []  # NOTE: of a step settled between two steps, returned by the next
        self.overlapped = 0  # NOTE: steps queued while another was in flight, and steps run synchronously
        self.synchronous = 0

    def busy(self) -> bool:
        return self.pending is not None or bool(self.news)

    def settle(self) -> None:
        """Resolve the step in flight now; its news go out with the next step's."""
        if self.pending is not None:
            pending, self.pending = self.pending, None
            self.news += self._resolve(pending)

    def step(self) -> list[Request]:
        core = self.core
        if core.scheduler.waiting:
            self.check_weights()
        out = core.scheduler.schedule()
        if not out:
            self.settle()
            news, self.news = self.news, []
            return news or self.unstick()
        if not self._overlappable(out):
            self.settle()
            _drop_final(out)
            news, self.news = self.news, []
            self.synchronous += 1
            return news + (core.run_step(out) if out.scheduled else [])
        return self._overlap(out)

    def _overlappable(self, out: SchedulerOutput) -> bool:
        runner = self.core.runner
        if not runner.verified or runner.routes is not None or runner.lora is not None:
            return False
        for s in out.scheduled:
            r = s.request
            if r.sampling.uses_processors or r.top_logprobs or r.score_from is not None:
                return False
        return True

    def _feed(self, out: SchedulerOutput) -> Feed | None:
        """Where the step in flight's tokens go in this step's ids: each row whose chunk ends at its last token, a
        placeholder (the packed position of that token, the row of the in-flight tensor)."""
        prev = self.pending
        if prev is None:
            return None
        dst, src, offset = [], [], 0
        for s in out.scheduled:
            req, n = s.request, s.num_new_tokens
            j = prev.index.get(id(req))
            if j is not None and req.num_computed_tokens + n == len(req.token_ids):
                dst.append(offset + n - 1)
                src.append(j)
            offset += n
        if not dst:
            return None
        dev = self.core.device
        return Feed(int_tensor(dst, dev), int_tensor(src, dev), prev.tokens)

    def _overlap(self, out: SchedulerOutput) -> list[Request]:
        core = self.core
        self.count_prompt_tokens(out)
        try:
            run, sampled = core.runner.stage(out, feed=self._feed(out))
            reqs = [out.scheduled[i].request for i in sampled]
            params, ids = [r.sampling for r in reqs], [r.request_id for r in reqs]
            positions = [len(r.generated) for r in reqs]  # NOTE: now: the placeholders are appended below
            mode = core.config.logprobs_mode if core.config.return_logprobs else None
            tokens = torch.full((len(reqs),), PLACEHOLDER, dtype=torch.long, device=core.device)
            sampler = core.sampler

            def device_part() -> tuple[torch.Tensor, torch.Tensor | None]:
                logits, _ = run()
                drawn, logprobs = sampler.draw(logits, params, ids, mode, positions)
                tokens.copy_(drawn)
                return tokens, logprobs

            handle = self.queue.submit(device_part)
        except Exception as e:  # NOTE: as the synchronous step: a failing step fails its own requests
            self.settle()
            failed = [s.request for s in out.scheduled if not s.request.status.is_final]
            for req in failed:
                core.fail(req, f"engine step failed: {type(e).__name__}: {e}")
            news, self.news = self.news, []
            return news + failed
        self.overlapped += self.pending is not None
        self.settle()  # NOTE: the previous step, resolved while this one is queued
        news, self.news = self.news, []
        _drop_final(out)  # NOTE: rows whose request ended at the previous step: their row here is wasted
        core.scheduler.after_step(out)
        rows = []
        for i, req in enumerate(reqs):
            if req.status.is_final:
                continue
            req.token_ids.append(PLACEHOLDER)
            req.generated.append(PLACEHOLDER)
            rows.append((req, i))
            if len(req.generated) >= req.max_new_tokens and req in core.scheduler.running:
                core.scheduler.running.remove(req)  # NOTE: ends at this step by length: never scheduled again
        self.pending = InFlight(rows, tokens, handle, core.policy_version, {id(r): i for r, i in rows})
        return news

    def _resolve(self, step: InFlight) -> list[Request]:
        """Read a queued step's outputs and apply them (the synchronous step's bookkeeping)."""
        tokens, logprobs = step.handle.result()
        news: list[Request] = []
        for req, i in step.rows:
            if req.status.is_final:  # NOTE: failed meanwhile
                continue
            token = tokens[i]
            req.token_ids[-1] = req.generated[-1] = token
            req.versions.append(step.version)
            if logprobs is not None:
                req.logprobs.append(logprobs[i])
            reason = "stop" if token in req.eos_token_ids else "length" if len(req.generated) >= req.max_new_tokens \
                else None
            if reason is not None:
                self.finalize(req, RequestStatus.FINISHED, reason)
                news.append(req)
            elif req.streaming:
                news.append(req)
        self.core.stats["generated_tokens"] += len(step.rows)
        return news


def _drop_final(out: SchedulerOutput) -> None:
    """Take the rows of requests that ended (at the step resolved meanwhile) out of a scheduled step."""
    if any(s.request.status.is_final for s in out.scheduled):
        out.scheduled = [s for s in out.scheduled if not s.request.status.is_final]


class StepLock:
    """The manager's step lock (an `RLock`): a round holds it through `stepping()`; anyone else's outermost hold
    first settles the step in flight (`settle`, set by the manager), so a weight copy, a sleep or a config change
    lands after every step queued so far has run, as in the synchronous engine.

    A lock is not fair: the engine thread releases it at the end of a round and takes it again for the next one
    before a thread woken by the release has run, so a waiter can sit through any number of rounds (a probe with
    1 ms rounds that hold the GIL: waits of 1-1299 rounds; CI once saw an in-flight update land only after a
    request's ~90 remaining tiny-model steps). So a round first `make_way()`s: while another thread waits in
    `with lock:` it lets that thread in, and the update lands between the next two steps."""

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._depth = 0
        self.settle: Callable[[], None] | None = None
        self._waiting = 0  # NOTE: threads inside `__enter__` that have not got the lock yet
        self._turn = threading.Condition(threading.Lock())

    def __enter__(self) -> StepLock:
        with self._turn:
            self._waiting += 1
        try:
            self._lock.acquire()
        finally:
            with self._turn:
                self._waiting -= 1
                self._turn.notify_all()
        self._depth += 1
        if self._depth == 1 and self.settle is not None:
            try:
                self.settle()
            except BaseException:
                self.__exit__(None, None, None)
                raise
        return self

    def __exit__(self, *exc) -> None:
        self._depth -= 1
        self._lock.release()

    def make_way(self, timeout: float = 0.1) -> None:
        """Before a round takes the lock: wait (up to `timeout` seconds) until every thread waiting in `with lock:`
        has got it. Called without holding the lock; a holder's work then runs before the round's step."""
        if self._waiting:  # NOTE: an int read, no lock: the common case costs nothing
            with self._turn:
                self._turn.wait_for(lambda: not self._waiting, timeout)

    def stepping(self) -> _Held:
        """Held by a round (it settles itself when it must) or by a reader of the engine's state."""
        return _Held(self)


class _Held:
    def __init__(self, lock: StepLock) -> None:
        self.lock = lock

    def __enter__(self) -> StepLock:
        self.lock._lock.acquire()  # noqa: SLF001 - the lock's own helper
        self.lock._depth += 1
        return self.lock

    def __exit__(self, *exc) -> None:
        self.lock.__exit__(*exc)
