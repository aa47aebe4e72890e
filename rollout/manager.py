"""`ContinuousBatchingManager`: the engine loop on a background thread, and its queues.

Differences from transformers' manager, on purpose:
  - `for result in manager` ends once every request submitted so far has delivered its final result;
  - a cancelled request delivers one final CANCELLED result;
  - one bad or oversized request fails alone, and an exception inside a step fails only that step;
  - the thread is a daemon and an idle manager sleeps on a condition variable (no polling);
  - `persistent_manager=True` honours a later call's generation config;
  - a caller that blocks on its own requests can step the engine on its own thread (`driving`,
    `step_here`; `RolloutEngine.generate` does): the background thread parks meanwhile. With libgomp,
    every thread that runs parallel torch work keeps its own OpenMP team, and once the teams add up
    to more threads than CPUs their idle workers stop spinning, so every parallel region of a step
    pays a futex wake-up: an engine thread stepping beside a trainer's main thread (which always has
    a team) ran slower at 2 threads than at 1 (benchmarks/PROFILE.md, "Threads").
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Iterator, Sequence

import torch
from transformers import GenerationConfig

from .config import ContinuousBatchingConfig
from .core import EngineCore
from .requests import GenerationOutput, Request, RequestStatus

logger = logging.getLogger("rollout")

HARD_STOP_ERROR = "manager stopped with hard_stop=True before the request finished"



def _step_or_fail(core) -> list:
    """One engine step; an exception outside a step's own handling fails every live request instead."""
    try:
        return core.step()
    except Exception as e:  # NOTE: a scheduler bug must not kill the loop silently
        logger.exception("engine loop error; failing all live requests")
        return core.fail_all(f"engine loop error: {type(e).__name__}: {e}")

class ContinuousBatchingManager:
    """Runs an `EngineCore` on a background thread; safe to call from any thread.

    Args:
        model: a Hugging Face causal LM (shared, never copied; its own attention is left untouched).
        generation_config: defaults for requests (max_new_tokens, eos, sampling).
        continuous_batching_config: engine configuration.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        generation_config: GenerationConfig | None = None,
        continuous_batching_config: ContinuousBatchingConfig | None = None,
    ) -> None:
        # NOTE: the model is held weakly: a persistent manager is kept alive by its model (see
        # `_PERSISTENT`), so a strong reference back would keep both forever.
        self._model_ref = weakref.ref(model)
        self.config = continuous_batching_config or ContinuousBatchingConfig()
        self.core: EngineCore | None = EngineCore(model, generation_config, self.config)
        self._cv = threading.Condition()
        # NOTE: a manager dropped without destroy() wakes its thread, which then ends (see `_engine_loop`).
        weakref.finalize(self, _notify, self._cv)
        self.step_lock = threading.RLock()  # held by the loop during a step; others may pause it
        self._inbox: deque[tuple[str, object]] = deque()
        self._results: deque[GenerationOutput] = deque()
        self._streams: dict[str, deque[GenerationOutput]] = {}
        self._live: set[str] = set()  # submitted, final result not yet delivered to a consumer
        self._thread: threading.Thread | None = None
        self._accepting = False
        self._stop_mode: str | None = None  # None, "drain" or "hard"
        self._destroyed = False
        self._paused: str | None = None  # None, or the pause mode: "abort", "wait" or "keep"
        # NOTE: the mode the loop has reached: pause/resume travel through the inbox, so a request
        # submitted before pause() runs as in flight and one submitted after it is held.
        self._loop_paused: str | None = None
        self._held: deque[Request] = deque()  # requests submitted while paused, admitted on resume
        self._listeners: list[Callable[[GenerationOutput], bool]] = []
        self._drivers = 0  # callers stepping the engine on their own thread (see `driving`)
        _LIVE_MANAGERS.add(self)

    @property
    def model(self) -> torch.nn.Module | None:
        """The model this manager serves (its engine view once the caller dropped it; None once destroyed)."""
        model = self._model_ref()
        if model is None and self.core is not None:
            return self.core.view
        return model

    # -------------------------------------------------------------- lifecycle
    def start(self) -> None:
        """Start (or restart) the background loop."""
        if self._destroyed:
            raise RuntimeError("this manager was destroyed; create a new one")
        if self.is_running():
            if self._stop_mode is None:
                return
            # NOTE: a stop(block=False) is still draining; let that session end, then start anew
            # (else the old loop exits and this start() would silently leave the manager stopped).
            self._thread.join()
        self._stop_mode = None
        self._accepting = True
        # NOTE: the thread holds the manager only weakly between rounds: a manager nobody references is
        # garbage, and its finalizer ends the thread (the KV cache goes with the core).
        self._thread = threading.Thread(target=_engine_loop, args=(weakref.ref(self), self._cv),
                                        name="rollout-engine", daemon=True)
        self._thread.start()

    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def stop(self, hard_stop: bool = False, block: bool = True, timeout: float | None = None) -> None:
        """Refuse new work, then drain queued and active requests (or fail them at once if `hard_stop`)."""
        with self._cv:
            self._accepting = False
            if self._stop_mode != "hard":
                self._stop_mode = "hard" if hard_stop else "drain"
            self._cv.notify_all()
        if block and self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)

    def destroy(self) -> None:
        """Stop at once and free the KV cache for good."""
        self.stop(hard_stop=True)
        with self.step_lock:
            if self.core is not None:
                self.core.cache.release()
                self.core = None
        self._destroyed = True
        _LIVE_MANAGERS.discard(self)

    def set_generation_config(self, generation_config: GenerationConfig | None) -> None:
        with self.step_lock:
            self._core().set_generation_config(generation_config)

    # ---------------------------------------------------------------- pausing
    PAUSE_MODES = ("abort", "wait", "keep")

    def pause(self, mode: str = "keep", timeout: float | None = None) -> None:
        """Hold new requests until `resume()`; what happens to the live ones depends on `mode`:
        "abort" cancels them (each delivers a final CANCELLED result), "wait" lets them finish,
        "keep" freezes them where they are (no step runs; they continue on resume). Returns once that
        state is reached (for "wait", once the running requests have finished)."""
        if mode not in self.PAUSE_MODES:
            raise ValueError(f"mode must be one of {self.PAUSE_MODES}, got {mode!r}")
        with self._cv:
            self._paused = mode
            self._inbox.append(("pause", mode))
            self._cv.notify_all()
        deadline = None if timeout is None else time.monotonic() + timeout
        # NOTE: the loop holds step_lock for a whole step: once we get it, no step is under way.
        while self.is_running():
            with self.step_lock, self._cv:
                if self._paused != mode:
                    return
                if self._loop_paused == mode and (mode == "keep" or not self._core().has_work()):
                    return
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"pause(mode={mode!r}) did not settle within {timeout} s")
            time.sleep(0.002)

    def resume(self) -> None:
        """Admit the held requests and run again."""
        with self._cv:
            self._paused = None
            self._inbox.append(("resume", None))
            self._cv.notify_all()

    def is_paused(self) -> bool:
        return self._paused is not None

    def add_listener(self, fn: Callable[[GenerationOutput], bool]) -> None:
        """Call `fn(output)` from the engine thread for every piece of news (final results, and chunks of
        streaming requests). If it returns True it has taken the output: the manager keeps no copy, and a
        final one counts as delivered. `fn` must be quick and must not call into the manager."""
        self._listeners.append(fn)

    # ------------------------------------------------------------- submission
    def add_request(
        self,
        input_ids: Sequence[int] | torch.Tensor,
        request_id: str | None = None,
        max_new_tokens: int | None = None,
        streaming: bool = False,
        temperature: float | None = None,
        top_k: int | None = None,
        top_p: float | None = None,
        seed: int | None = None,
        eos_token_ids: Sequence[int] | None = None,
        ignore_eos: bool = False,
    ) -> str | None:
        """Queue one request; returns its id, or None (with a warning) if the manager is not running.

        `input_ids` is one prompt: a flat sequence of token ids (a 1-D tensor is fine). Stop tokens are
        the engine's EOS ids (none with `ignore_eos`) plus `eos_token_ids`.
        Raises ValueError naming the field for bad input; nothing is queued then."""
        if not self._accepting or self._destroyed:
            logger.warning("add_request refused: the manager is stopped (call start() first)")
            return None
        if request_id is not None and request_id in self._live:
            raise ValueError(f"request_id {request_id!r} is already in use by a live request")
        # NOTE: validated outside the lock: the engine loop takes it between steps.
        req = self._core().make_request(
            input_ids, request_id, max_new_tokens, streaming, temperature, top_k, top_p, seed, eos_token_ids,
            ignore_eos,
        )
        return req.request_id if self.submit([req]) else None

    def add_requests(self, inputs: Sequence[Sequence[int]], **kwargs) -> list[str]:
        """Queue several requests (same kwargs); returns their ids in input order.

        Raises ValueError naming the field if any input is bad; nothing of the batch is queued then.

        With prefix sharing on, the batch is submitted sorted by its tokens, so prompts with a common
        prefix run back to back and the later ones read the shared pages from the cache."""
        if not self._accepting or self._destroyed:
            logger.warning("add_requests refused: the manager is stopped (call start() first)")
            return []
        stamp = time.monotonic_ns()
        core = self._core()
        reqs = [core.make_request(ids_i, request_id=f"req_{stamp}_{i}", **kwargs) for i, ids_i in enumerate(inputs)]
        order = list(range(len(reqs)))
        if self.config.allow_block_sharing:
            order.sort(key=lambda i: reqs[i].prompt_ids)
        if not self.submit([reqs[i] for i in order]):
            return []
        return [r.request_id for r in reqs]

    def submit(self, requests: Sequence[Request]) -> bool:
        """Queue requests built by `self.core.make_request`, all or none; False (with a warning) if the
        manager is not running. ValueError if an id is live already (nothing is queued then)."""
        with self._cv:
            if not self._accepting or self._destroyed:
                logger.warning("submission refused: the manager is stopped (call start() first)")
                return False
            seen: set[str] = set()
            for req in requests:
                if req.request_id in self._live or req.request_id in seen:
                    raise ValueError(f"request_id {req.request_id!r} is already in use by a live request")
                seen.add(req.request_id)
            for req in requests:
                self._live.add(req.request_id)
                self._streams.pop(req.request_id, None)  # NOTE: never a stale stream of an earlier same-id request
                if req.streaming:
                    self._streams[req.request_id] = deque()
                self._inbox.append(("add", req))
            self._cv.notify_all()
            return True

    def cancel_request(self, request_id: str) -> bool:
        """Cancel a live request; it delivers one final CANCELLED result. False if it is not live."""
        with self._cv:
            if request_id not in self._live or not self.is_running():
                return False
            self._inbox.append(("cancel", request_id))
            self._cv.notify_all()
            return True

    # ---------------------------------------------------------------- results
    def get_result(self, request_id: str | None = None, timeout: float | None = None) -> GenerationOutput | None:
        """The next final result (or the next for `request_id`); None on timeout or if none can come."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cv:
            while True:
                for i, out in enumerate(self._results):
                    if request_id is None or out.request_id == request_id:
                        del self._results[i]
                        # NOTE: the final chunk is already in the stream deque a request_id_iter holds.
                        self._streams.pop(out.request_id, None)
                        self._delivered(out.request_id)
                        return out
                if (request_id is None and not self._live) or (request_id is not None and request_id not in self._live):
                    return None
                if not self.is_running() and not self._inbox:
                    return None
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    return None
                self._cv.wait(remaining)

    def __iter__(self) -> Iterator[GenerationOutput]:
        """Each final result as it finishes; ends once every request submitted so far has delivered."""
        while True:
            out = self.get_result()
            if out is None:
                return
            yield out

    def request_id_iter(self, request_id: str) -> Iterator[GenerationOutput]:
        """Partial outputs of a streaming request as they grow; the last one has a final status."""
        with self._cv:
            stream = self._streams.get(request_id)
        if stream is None:
            out = self.get_result(request_id)
            if out is not None:
                yield out
            return
        while True:
            with self._cv:
                while not stream and self.is_running():
                    self._cv.wait()
                if not stream:
                    self._streams.pop(request_id, None)
                    return
                chunk = stream.popleft()
                if chunk.status.is_final:
                    self._streams.pop(request_id, None)
                    self._results = deque(o for o in self._results if o.request_id != request_id)
                    self._delivered(request_id)
            yield chunk
            if chunk.status.is_final:
                return

    def _delivered(self, request_id: str) -> None:
        self._live.discard(request_id)
        self._cv.notify_all()

    def cache_stats(self) -> dict:
        return self._core().cache_stats()

    def _core(self) -> EngineCore:
        if self.core is None:
            raise RuntimeError("this manager was destroyed")
        return self.core

    # ------------------------------------------------------------------- loop
    @contextlib.contextmanager
    def driving(self) -> Iterator[None]:
        """While inside, the caller steps the engine with `step_here` and the background loop parks
        (unless the manager is stopping); on exit the loop takes over whatever work is left."""
        with self._cv:
            self._drivers += 1
        try:
            yield
        finally:
            with self._cv:
                self._drivers -= 1
                self._cv.notify_all()

    def step_here(self) -> bool:
        """One round of the engine loop on the calling thread (queued commands, then one step); False
        when there was nothing to do (or the loop is paused). Use inside `driving()`."""
        core = self._core()
        with self._cv:
            commands = list(self._inbox)
            self._inbox.clear()
        if not commands and not (core.has_work() and self._loop_paused != "keep"):
            return False
        with self.step_lock:
            news = self._apply(core, commands)
            if core.has_work() and self._loop_paused != "keep":
                news += _step_or_fail(core)
        self._publish(news)
        return True

    def _idle(self) -> bool:
        """Nothing to do until notified, or a caller is driving (called under `_cv`)."""
        if self._drivers and self._stop_mode is None:
            return True
        return (not self._inbox and not (self._core().has_work() and self._loop_paused != "keep")
                and self._stop_mode is None)

    def _run_once(self) -> bool:
        """One round of the engine loop: apply the queued commands, run a step; False once it must end."""
        core = self._core()
        with self._cv:
            commands = list(self._inbox)
            self._inbox.clear()
            stop_mode = self._stop_mode
            if stop_mode is not None:  # NOTE: a stop ends the pause: held requests drain (or fail)
                self._paused = None
                commands.append(("resume", None))
        with self.step_lock:
            news = self._apply(core, commands)
            if stop_mode == "hard":
                news += core.fail_all(HARD_STOP_ERROR)
            elif core.has_work() and self._loop_paused != "keep":
                news += _step_or_fail(core)
        self._publish(news)
        if stop_mode is not None and not core.has_work():
            with self._cv:
                if not self._inbox:
                    self._cv.notify_all()
                    return False
        return True

    def _apply(self, core: EngineCore, commands: list[tuple[str, object]]) -> list[Request]:
        news: list[Request] = []
        for kind, arg in commands:
            if kind == "add" and self._loop_paused is not None:
                with self._cv:
                    self._held.append(arg)
            elif kind == "pause":
                with self._cv:
                    self._loop_paused = arg
                if arg == "abort":
                    news += [r for r in (core.cancel(rid) for rid in list(core.requests)) if r is not None]
                    news += self._cancel_held(lambda r: True)
            elif kind == "resume":
                with self._cv:
                    self._loop_paused = None
                    held, self._held = list(self._held), deque()
                news += self._apply(core, [("add", r) for r in held])
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
        with self._cv:
            gone = [r for r in self._held if match(r)]
            self._held = deque(r for r in self._held if not match(r))
        for req in gone:
            req.status, req.finish_reason = RequestStatus.CANCELLED, "cancelled"
        return gone

    def _publish(self, news: list[Request]) -> None:
        if not news:
            return
        with self._cv:
            for req in news:
                out = req.to_output()
                if self._taken(out):
                    continue
                stream = self._streams.get(req.request_id)
                if stream is not None:
                    stream.append(out)
                if out.status.is_final:
                    self._results.append(out)
            self._cv.notify_all()

    def _taken(self, out: GenerationOutput) -> bool:
        for fn in self._listeners:
            try:
                taken = fn(out)
            except Exception:  # NOTE: a listener's bug must not kill the engine loop
                logger.exception("manager listener failed")
                continue
            if taken:
                if out.status.is_final:
                    self._streams.pop(out.request_id, None)
                    self._live.discard(out.request_id)
                return True
        return False


# NOTE: a safety net only: every wake-up that matters (submissions, stops, the manager's finalizer) notifies.
IDLE_RECHECK_S = 30.0


def _engine_loop(ref: weakref.ref[ContinuousBatchingManager], cv: threading.Condition) -> None:
    """The engine thread. It holds the manager only while it works on it; idle, it waits on the condition
    variable holding nothing but `ref`, so an unreferenced manager is collected and its finalizer's
    notify ends the thread."""
    while True:
        manager = ref()
        if manager is None:
            return
        with cv:
            if manager._idle():
                del manager
                if ref() is not None:  # NOTE: collected just now (in this thread): no notify will come
                    cv.wait(IDLE_RECHECK_S)
                continue
        if not manager._run_once():
            return
        del manager


def _notify(cv: threading.Condition) -> None:
    with cv:
        cv.notify_all()


# NOTE: daemon threads never block interpreter exit; this only lets them finish their step cleanly.
_LIVE_MANAGERS: weakref.WeakSet[ContinuousBatchingManager] = weakref.WeakSet()


@atexit.register
def _stop_all_at_exit() -> None:
    for manager in list(_LIVE_MANAGERS):
        with contextlib.suppress(Exception):
            manager.stop(hard_stop=True, block=True, timeout=2.0)


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
    if manager is not None and (manager._destroyed or (continuous_batching_config is not None
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
