"""`ContinuousBatchingManager`: one `EngineCore`, its inbox, its outbox, and who steps it.

There is one stepping path, `round` (apply the queued commands, then one engine step, then publish the
news), and two drivers of it: the manager's own background thread (`rollout serve`, and the seed API's
`add_request` / `get_result` / `for result in manager`), and a caller that blocks on its own requests
(`rollout.engine.collect`, inside `driving()`: `RolloutEngine.generate`, `generate_batch`), while the thread
parks.
Both run equally fast: a thread that waits for the other to compute gives back its OpenMP team
(`rollout.engine.openmp`). Under tensor parallelism every rank runs rank 0's rounds (`rollout.engine.tp`).

Differences from transformers' manager, on purpose:
  - `for result in manager` ends once every request submitted so far has delivered its final result;
  - a cancelled request delivers one final CANCELLED result;
  - one bad or oversized request fails alone, and an exception inside a step fails only that step;
  - the thread is a daemon and an idle manager sleeps on a condition variable (no polling);
  - `persistent_manager=True` honours a later call's generation config (`rollout.api.factories`).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Sequence

import torch
from transformers import GenerationConfig

from rollout.config import ContinuousBatchingConfig
from rollout.engine.async_steps import StepLock
from rollout.engine.core import EngineCore
from rollout.engine.engine_thread import LIVE_MANAGERS, start_engine_thread, wake
from rollout.engine.inbox import Inbox
from rollout.engine.outbox import Outbox
from rollout.engine.routed_experts import check_routes
from rollout.in_flight import PAUSE_DEFAULT, InFlight, check_mode
from rollout.requests import GenerationOutput, Request

logger = logging.getLogger("rollout")

HARD_STOP_ERROR = "manager stopped with hard_stop=True before the request finished"


class ContinuousBatchingManager:
    """Runs an `EngineCore` for callers on any thread (see the module docstring).

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
        # NOTE: the model is held weakly: a persistent manager is kept alive by its model
        # (`rollout.api.factories`), so a strong reference back would keep both forever.
        self._model_ref = weakref.ref(model)
        self.config = continuous_batching_config or ContinuousBatchingConfig()
        self._core: EngineCore | None = EngineCore(model, generation_config, self.config)
        self._cv = threading.Condition()
        # NOTE: a manager dropped without destroy() wakes its thread, which then ends (rollout.engine.engine_thread).
        weakref.finalize(self, wake, self._cv)
        # NOTE: held during a round; hold it to keep steps out (a caller's hold first settles an asynchronous step)
        self.step_lock = StepLock()
        self.step_lock.settle = lambda: self._core is not None and self._core.settle()
        self._inbox = Inbox(self._cv, follower=self._core.follower)
        self._outbox = Outbox(self._cv)
        self._thread: threading.Thread | None = None
        self._accepting = False
        self._stop_mode: str | None = None  # None, "drain" or "hard"
        self._destroyed = False
        self._paused: str | None = None  # None, or the pause mode: "abort", "wait" or "keep"
        self._drivers = 0  # callers stepping on their own thread (see `driving`)
        LIVE_MANAGERS.add(self)

    # ------------------------------------------------------------ inspection
    @property
    def model(self) -> torch.nn.Module | None:
        """The model this manager serves (its engine view once the caller dropped it; None once destroyed)."""
        model = self._model_ref()
        if model is None and self._core is not None:
            return self._core.view
        return model

    @property
    def core(self) -> EngineCore:
        """The engine core (cache, scheduler, runner, sampler); RuntimeError once destroyed. Mutate it only
        while holding `step_lock`."""
        if self._core is None:
            raise RuntimeError("this manager was destroyed")
        return self._core

    policy_version = property(lambda self: self.core.policy_version)

    @property
    def thread(self) -> threading.Thread | None:
        """The background engine thread of the current session (None before the first `start`)."""
        return self._thread

    is_destroyed = property(lambda self: self._destroyed)

    @property
    def pause_mode(self) -> InFlight | None:
        """The mode of the current pause (`rollout.in_flight`), None when not paused."""
        return self._paused

    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def is_paused(self) -> bool:
        return self._paused is not None

    def live_request_ids(self) -> frozenset[str]:
        """Requests submitted whose final result has not been delivered yet."""
        with self._cv:
            return frozenset(self._outbox.live)

    def cache_stats(self) -> dict:
        return self.core.cache_stats()

    def debug_state(self) -> dict:
        """Test hook: sizes of the internal queues, and whether the calling thread holds the manager's lock."""
        lock_held = self._cv._is_owned()  # NOTE: before taking it below
        with self._cv:
            ob = self._outbox
            return {"live": set(ob.live), "results": [o.request_id for o in ob.results], "streams": set(ob.streams),
                    "inbox": len(self._inbox), "held": len(self._inbox.held), "lock_held": lock_held}

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
        self._thread = start_engine_thread(self, self._cv)

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
            if self._core is not None:
                self._core.cache.release()
                self._core = None
        self._destroyed = True
        LIVE_MANAGERS.discard(self)

    def set_generation_config(self, generation_config: GenerationConfig | None) -> None:
        with self.step_lock:
            self.core.set_generation_config(generation_config)

    # ---------------------------------------------------------------- pausing
    def pause(self, mode: InFlight = PAUSE_DEFAULT, timeout: float | None = None) -> None:
        """Hold new requests until `resume()`; what happens to the live ones depends on `mode`
        (`rollout.in_flight`): "abort" (default) cancels them (each delivers a final CANCELLED result),
        "wait" lets them finish, "keep" freezes them where they are (no step runs; they continue on resume).
        Returns once that state is reached (for "wait", once the running requests have finished)."""
        check_mode(mode, "mode")
        with self._cv:
            self._paused = mode
            self._inbox.push("pause", mode)
            self._cv.notify_all()
        deadline = None if timeout is None else time.monotonic() + timeout
        # NOTE: a round holds step_lock from start to end: once we get it, no step is under way.
        while self.is_running():
            with self.step_lock.stepping(), self._cv:  # NOTE: reads only: the step in flight may go on
                if self._paused != mode:
                    return
                if self._inbox.paused == mode and (mode == "keep" or not self.core.has_work()):
                    return
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"pause(mode={mode!r}) did not settle within {timeout} s")
            time.sleep(0.002)

    def resume(self) -> None:
        """Admit the held requests and run again."""
        with self._cv:
            self._paused = None
            self._inbox.push("resume")
            self._cv.notify_all()

    def wait_idle(self, timeout: float | None = None, poll: float = 0.002) -> None:
        """Block until no request is queued or running (steps go on meanwhile); TimeoutError after `timeout`."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            with self.step_lock.stepping():  # NOTE: reads only
                if not self.core.has_work() and not self._inbox:
                    return
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"the engine did not become idle within {timeout} s")
            time.sleep(poll)

    def abort_live(self) -> list[str]:
        """Cancel every request not yet delivered (queued, held or running); returns their ids."""
        # NOTE: every live id, not only the core's requests: one still in the inbox would otherwise run on.
        live = sorted(self.live_request_ids())
        for rid in live:
            self.cancel_request(rid)
        return live

    def add_listener(self, fn: Callable[[GenerationOutput], bool]) -> None:
        """Call `fn(output)` from the stepping thread for every piece of news (final results, and chunks of
        streaming requests). If it returns True it has taken the output: the manager keeps no copy, and a
        final one counts as delivered. `fn` must be quick and must not call into the manager."""
        self._outbox.listeners.append(fn)

    # ------------------------------------------------------- the core, by name
    # NOTE: what the layers above need of the engine core, so nothing outside rollout/engine/ reaches into it
    @property
    def vocab_size(self) -> int:
        return self.core.vocab_size

    @property
    def max_context(self) -> int | None:
        return self.core.max_context

    @property
    def tp(self):
        """The tensor-parallel group (`rollout.engine.tp`), None without TP."""
        return self.core.tp

    def check_prompt(self, input_ids) -> list[int]:
        return self.core.check_prompt(input_ids)

    def make_request(self, input_ids, **fields) -> Request:
        """A validated `Request` (`EngineCore.make_request`'s fields) for `submit`."""
        return self.core.make_request(input_ids, **fields)

    def weight_targets(self) -> dict[str, torch.Tensor]:
        return self.core.weight_targets()

    def load_weights(self, source, recompute_kv: bool = False, version: int | None = None) -> tuple[int, int]:
        """`EngineCore.load_weights`; the caller holds `step_lock` (between two steps)."""
        return self.core.load_weights(source, recompute_kv, version)

    def load_policy_adapter(self, weights, recompute_kv: bool = False,
                            version: int | None = None) -> tuple[int, int]:
        return self.core.load_policy_adapter(weights, recompute_kv, version)

    def loras(self, create: bool = True):
        return self.core.loras(create)

    def adopt_peft_policy(self, model) -> str:
        return self.core.adopt_peft_policy(model)

    def reset_prefix_cache(self) -> int:
        return self.core.reset_prefix_cache()

    def check_routes(self) -> None:
        """ValueError naming `return_routed_experts` where this engine cannot record routes."""
        check_routes(self.core)

    def has_work(self) -> bool:
        return self.core.has_work()

    def release_memory(self) -> int:
        return self.core.release_memory()

    def restore_memory(self) -> int:
        return self.core.restore_memory()

    # ------------------------------------------------------------- submission
    def add_request(self, input_ids: Sequence[int] | torch.Tensor, request_id: str | None = None,
                    max_new_tokens: int | None = None, streaming: bool = False, **fields) -> str | None:
        """Queue one request; returns its id, or None (with a warning) if the manager is not running.

        `input_ids` is one prompt: a flat sequence of token ids (a 1-D tensor is fine). `fields` are
        `EngineCore.make_request`'s, the one list of a submission's fields: the seed API's `temperature`,
        `top_k`, `top_p`, `seed`, then `eos_token_ids` (stop tokens beside the engine's EOS ids, none of
        those with `ignore_eos`) and the generation config's sampling fields
        (`rollout.sampling.sampling_fields.SAMPLING_FIELDS`) for this request.
        Raises ValueError naming the field for bad input; nothing is queued then."""
        if not self._accepting or self._destroyed:
            logger.warning("add_request refused: the manager is stopped (call start() first)")
            return None
        if request_id is not None and request_id in self._outbox.live and not self.core.follower:
            raise ValueError(f"request_id {request_id!r} is already in use by a live request")
        # NOTE: validated outside the lock: a round takes it between steps.
        req = self.core.make_request(input_ids, request_id, max_new_tokens, streaming, **fields)
        return req.request_id if self.submit([req]) else None

    def add_requests(self, inputs: Sequence[Sequence[int]], **kwargs) -> list[str]:
        """Queue several requests (same kwargs); returns their ids in input order.

        Raises ValueError naming the field if any input is bad; nothing of the batch is queued then.

        With prefix sharing on, the batch is submitted sorted by its tokens, so prompts with a common
        prefix run back to back and the later ones read the shared pages from the cache."""
        if not self._accepting or self._destroyed:
            logger.warning("add_requests refused: the manager is stopped (call start() first)")
            return []
        stamp = time.monotonic_ns() if self.core.tp is None else next(self.core.batch_ids)  # NOTE: same on every rank
        core = self.core
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
                if (req.request_id in self._outbox.live and not self.core.follower) or req.request_id in seen:
                    raise ValueError(f"request_id {req.request_id!r} is already in use by a live request")
                seen.add(req.request_id)
            self._outbox.expect(requests)
            for req in requests:
                self._inbox.push("add", req)
            self._cv.notify_all()
            return True

    def cancel_request(self, request_id: str) -> bool:
        """Cancel a live request; it delivers one final CANCELLED result. False if it is not live."""
        with self._cv:
            if request_id not in self._outbox.live or not self.is_running():
                return False
            self._inbox.push("cancel", request_id)
            self._cv.notify_all()
            return True

    # ---------------------------------------------------------------- results
    def get_result(self, request_id: str | None = None, timeout: float | None = None) -> GenerationOutput | None:
        """The next final result (or the next for `request_id`); None on timeout or if none can come."""
        return self._outbox.get(request_id, timeout, self._producing, release_team=not self._drivers)

    def __iter__(self) -> Iterator[GenerationOutput]:
        """Each final result as it finishes; ends once every request submitted so far has delivered."""
        while True:
            out = self.get_result()
            if out is None:
                return
            yield out

    def request_id_iter(self, request_id: str) -> Iterator[GenerationOutput]:
        """Partial outputs of a streaming request as they grow; the last one has a final status."""
        return self._outbox.stream(request_id, self.is_running, release_team=not self._drivers)

    def _producing(self) -> bool:
        return self.is_running() or bool(self._inbox)

    # ------------------------------------------------ stepping on the caller
    @contextlib.contextmanager
    def driving(self) -> Iterator[None]:
        """While inside, the caller steps the engine (`run_once`, `rollout.engine.collect`) and the background thread
        parks
        (unless the manager is stopping); on exit the thread takes over whatever work is left."""
        with self._cv:
            self._drivers += 1
        try:
            yield
        finally:
            with self._cv:
                self._drivers -= 1
                self._cv.notify_all()

    def run_once(self) -> bool:
        """One round on the calling thread (queued commands, then one step); False when there was nothing
        to do (or the manager is paused in "keep" mode). Use inside `driving()`."""
        return self.round()[0]

    # ------------------------------------------------------------ the round
    def idle(self) -> bool:
        """For the background thread (`rollout.engine.engine_thread`): nothing to do until notified, or a caller
        drives. Call holding the manager's condition (the one `start` hands the thread)."""
        if self._drivers and self._stop_mode is None:
            return True
        if self.core.tp is not None and self.core.tp.wants_round():  # NOTE: follow rank 0 / heartbeat
            return False
        return (not self._inbox and not (self.core.has_work() and self._inbox.paused != "keep")
                and self._stop_mode is None)

    def round(self) -> tuple[bool, bool]:
        """The one stepping path: apply the queued commands, run one step, publish the news. Returns (whether
        anything was done, whether the background thread goes on). Used by `run_once`, `collect`, the thread."""
        core = self.core
        with core.tp.lock if core.tp is not None else contextlib.nullcontext():
            return self._round(core)

    def _round(self, core: EngineCore) -> tuple[bool, bool]:
        with self._cv:
            commands = self._inbox.take()
            stop_mode = self._stop_mode
            if stop_mode is not None:  # NOTE: a stop ends the pause: held requests drain (or fail)
                self._paused = None
                commands.append(("resume", None))
        stepping = core.has_work() and self._inbox.paused != "keep"
        if core.tp is not None:  # NOTE: every rank runs rank 0's round (rollout.engine.tp)
            commands, stop_mode, stepping = core.tp.exchange(commands, stop_mode, stepping, core, self._outbox)
        if not commands and not stepping and stop_mode is None:
            return False, True
        self.step_lock.make_way()  # NOTE: an update (or a sleep, a config change) waiting for the lock goes first
        with self.step_lock.stepping():
            news = self._inbox.apply(core, commands)
            if stop_mode == "hard":
                news += core.fail_all(HARD_STOP_ERROR)
            elif core.has_work() and self._inbox.paused != "keep":
                news += _step_or_fail(core)
        self._outbox.publish(news)
        if stop_mode is not None and not core.has_work():
            with self._cv:
                if not self._inbox:
                    self._cv.notify_all()
                    return True, False
        return True, True


def _step_or_fail(core: EngineCore) -> list[Request]:
    """One engine step; an exception outside a step's own handling fails every live request instead."""
    try:
        return core.step()
    except Exception as e:  # NOTE: a scheduler bug must not kill the loop silently
        logger.exception("engine loop error; failing all live requests")
        return core.fail_all(f"engine loop error: {type(e).__name__}: {e}")
