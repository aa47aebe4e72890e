"""`EngineBridge`: one persistent `RolloutEngine` behind an asyncio server.

Requests go to the engine's manager directly (one engine request per sample); their outputs come back
through a manager listener, which hands each one to the asyncio queue of the HTTP request that owns it
(`loop.call_soon_threadsafe`), so no thread waits per request. Control operations (pause, resume, weight
updates, sleep) run on worker threads, one at a time.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass

import torch

from rollout.api.engine import RolloutEngine
from rollout.engine.openmp import team_released_after
from rollout.in_flight import UPDATE_DEFAULT, InFlight, check_mode
from rollout.requests import GenerationOutput
from rollout.sampling.seeding import group_seed, sample_seed
from rollout.sampling_params import SamplingParams
from rollout.serve.protocol import APIError
from rollout.serve.text import SampleText

# NOTE: every `SamplingParams` field (`rollout.sampling_params.FIELDS`) is in exactly one of these (a test keeps
# it so: a new field fails it until it is placed): on the OpenAI wire under its own name (`SamplingRequest`), under
# vLLM's other name, or not on the wire (transformers' processors; the engine's `generate` takes them)
WIRE_FIELDS = ("temperature", "top_p", "top_k", "min_p", "seed", "max_tokens", "min_tokens", "stop_token_ids",
               "ignore_eos", "repetition_penalty", "presence_penalty", "frequency_penalty", "logit_bias",
               "return_sampling_mask", "prompt_logprobs")
WIRE_RENAMED = {"logprobs": "logprobs / top_logprobs (top-k count)", "bad_words_ids": "bad_words (strings)"}
DISCONNECT_POLL_S = 0.5  # NOTE: how long `collect` waits for an output before asking whether the client left
NOT_ON_THE_WIRE = ("no_repeat_ngram_size", "min_length", "sequence_bias", "suppress_tokens", "begin_suppress_tokens",
                   "forced_bos_token_id", "forced_eos_token_ids", "prompt_lookup_num_tokens", "max_matching_ngram_size")


@dataclass(frozen=True, slots=True)
class Sample:
    """One sample to run: its `SamplingParams` (checked by the protocol models and `SamplingParams` itself) and
    what the server asks beside sampling."""

    sampling: SamplingParams
    score_from: int | None = None  # 1: the prompt's logprobs too (echo with logprobs, prompt_logprobs)
    routes: bool = False  # record the routed experts (an MoE model)


class EngineBridge:
    """Submits samples to the engine and delivers their outputs to asyncio queues; RL control.

    Args:
        engine: the persistent engine (its manager must be running).
        max_model_len: context limit of prompt + completion (None: the model's own).
    """

    def __init__(self, engine: RolloutEngine, max_model_len: int | None = None,
                 return_routed_experts: bool = False) -> None:
        self.engine = engine
        self.manager = engine.manager
        self.vocab_size: int = self.manager.vocab_size
        limits = [x for x in (self.manager.max_context, max_model_len) if x]
        self.max_model_len: int | None = min(limits) if limits else None
        if return_routed_experts:
            # NOTE: a dense model (or TP, or the compiled forward) refuses to start, by name
            self.manager.check_routes()
        self.return_routed_experts = return_routed_experts  # every non-streamed choice carries its routes
        self._sinks: dict[str, Callable[[GenerationOutput], None]] = {}
        self._ids = itertools.count()
        self._control = threading.Lock()  # one pause / resume / update / sleep at a time
        self.user_paused: str | None = None
        self.asleep = False
        self.counters = {"requests": 0, "samples": 0, "failed": 0}
        self.manager.add_listener(self._take)

    def weight_targets(self) -> dict[str, torch.Tensor]:
        """Every parameter and buffer the engine runs, by name (tied names each listed): what a weight push fills."""
        return self.manager.weight_targets()

    # ------------------------------------------------------------ requests
    def _take(self, out: GenerationOutput) -> bool:
        sink = self._sinks.get(out.request_id)
        if sink is None:
            return False
        if out.status.is_final:
            self._sinks.pop(out.request_id, None)
        sink(out)
        return True

    def check_ids(self, ids: Sequence[int], param: str) -> None:
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise APIError(f"{param} holds token ids outside the vocabulary [0, {self.vocab_size}): {bad[:5]}", param)

    def budget(self, prompt_len: int, max_tokens: int | None, param: str) -> int:
        """`max_tokens`, or what the context leaves when None; APIError if prompt + max_tokens is too long."""
        if prompt_len == 0:
            raise APIError(f"{param} is empty", param)
        limit = self.max_model_len
        if max_tokens is None:
            if limit is None:
                return 256
            max_tokens = limit - prompt_len
            if max_tokens < 1:
                raise APIError(f"{param} has {prompt_len} tokens; the context is {limit}", param)
        if limit is not None and prompt_len + max_tokens > limit:
            raise APIError(
                f"this model's context is {limit} tokens, but prompt ({prompt_len}) + max_tokens "
                f"({max_tokens}) = {prompt_len + max_tokens}", "max_tokens")
        return max_tokens

    def wants_routes(self, req) -> bool:
        """Whether `req`'s choices carry `routed_experts`: asked (`return_routed_experts`, SGLang's and vLLM's
        `/inference/v1/generate` name) or on for the server (`--enable-return-routed-experts`), never streamed."""
        if req.return_routed_experts and req.stream:
            raise APIError("return_routed_experts is not supported with stream: as vLLM, routed experts come with "
                           "non-streamed choices", "return_routed_experts")
        return (req.return_routed_experts or self.return_routed_experts) and not req.stream

    def sampling(self, req, max_new_tokens: int, prompt: int, sample: int) -> Sample:
        """Sample `sample` of prompt `prompt` of a request; seeded, its stream is the engine's for the same call
        (`rollout.sampling.seeding`: the request is a call, its prompts the groups)."""
        stops = tuple(sorted(set(req.stop_token_ids or ())))
        self.check_ids(stops, "stop_token_ids")
        if req.min_tokens > max_new_tokens:
            raise APIError(f"min_tokens ({req.min_tokens}) must be <= max_tokens ({max_new_tokens})", "min_tokens")
        try:
            sp = SamplingParams(
                max_tokens=max_new_tokens,
                temperature=float(req.temperature),
                top_k=max(0, req.top_k),
                top_p=float(req.top_p),
                seed=None if req.seed is None else sample_seed(group_seed(req.seed, prompt), sample),
                stop_token_ids=stops,
                ignore_eos=bool(req.ignore_eos),
                logprobs=req.num_top_logprobs,
                min_p=float(req.min_p),
                repetition_penalty=float(req.repetition_penalty),
                presence_penalty=float(req.presence_penalty),
                frequency_penalty=float(req.frequency_penalty),
                min_tokens=req.min_tokens,
                logit_bias=self._logit_bias(req.logit_bias),
                bad_words_ids=self._bad_words(req.bad_words),
                return_sampling_mask=bool(req.return_sampling_mask),
            )
        except ValueError as e:
            raise APIError(str(e), _param_of(str(e))) from None
        return Sample(sp, 1 if req.scores_prompt else None, self.wants_routes(req))

    def _logit_bias(self, bias: Mapping[str, float] | None) -> tuple[tuple[int, float], ...]:
        """vLLM's logit_bias: token id (a string key in JSON) -> bias clamped to [-100, 100]."""
        out = []
        for key, value in (bias or {}).items():
            try:
                token = int(key)
            except ValueError:
                raise APIError(f"logit_bias keys must be token ids, got {key!r}", "logit_bias") from None
            if not 0 <= token < self.vocab_size:
                raise APIError(f"logit_bias holds token id {token} outside the vocabulary [0, {self.vocab_size})",
                               "logit_bias")
            out.append((token, min(100.0, max(-100.0, float(value)))))
        return tuple(out)

    def _bad_words(self, words: Sequence[str] | None) -> tuple[tuple[int, ...], ...]:
        """vLLM's tokenization of bad words: each word alone, and after a space when that is another token."""
        if not words:
            return ()
        tokenizer = self.engine.tokenizer
        if tokenizer is None:
            raise APIError("bad_words needs the server's tokenizer", "bad_words")
        out: list[tuple[int, ...]] = []
        for word in words:
            plain = tuple(tokenizer.encode(word.lstrip(), add_special_tokens=False))
            spaced = tuple(tokenizer.encode(" " + word.lstrip(), add_special_tokens=False))
            if not plain:
                raise APIError(f"bad_words holds {word!r}, which encodes to no token", "bad_words")
            out.append(plain)
            if spaced and spaced[0] != plain[0] and len(spaced) == len(plain):
                out.append(spaced)
        return tuple(out)

    def submit(self, samples: Sequence[tuple[list[int], Sample]], streaming: bool, queue: asyncio.Queue,
               lora: str | None = None, cache_salt: str | None = None) -> list[str]:
        """Queue samples, all or none, under LoRA adapter `lora` (None: the base model); their outputs (partial
        ones too when `streaming`) go to `queue`. Returns their ids in order. `cache_salt` (vLLM's): prefix KV
        is shared only between requests of the same salt."""
        loop = asyncio.get_running_loop()
        reqs = []
        try:
            slot, salt = self.engine.resolve_lora(lora)  # NOTE: (slot, prefix-cache salt), `rollout.api.lora`
            if cache_salt:  # NOTE: vLLM's: a request's own salt on top of the adapter's
                salt = salt + b"|salt:" + cache_salt.encode()
            for ids, sample in samples:
                reqs.append(self.manager.make_request(
                    ids, request_id=f"srv-{next(self._ids)}", streaming=streaming, sampling=sample.sampling,
                    score_from=sample.score_from, return_routed_experts=sample.routes, lora_slot=slot,
                    cache_salt=salt))
        except ValueError as e:
            raise APIError(str(e), _param_of(str(e))) from None
        sink = lambda out: loop.call_soon_threadsafe(queue.put_nowait, out)  # noqa: E731
        for r in reqs:
            self._sinks[r.request_id] = sink
        try:
            ok = self.manager.submit(reqs)
        except BaseException:
            ok = False
            raise
        finally:
            if not ok:
                for r in reqs:
                    self._sinks.pop(r.request_id, None)
        if not ok:
            raise APIError("the engine is not running", None, 503, "server_error")
        self.counters["samples"] += len(reqs)
        return [r.request_id for r in reqs]

    async def collect(self, queue: asyncio.Queue, texts: Mapping[str, SampleText], routes: bool,
                      disconnected: Callable[[], Awaitable[bool]]) -> bool:
        """Hand each output on `queue` to its sample (`texts`: engine request id -> `SampleText`, as `submit` put
        them) until every sample is done, with `routes` until each has its final output (the one that carries
        them); a sample a stop string ended is cancelled. Every sample still running is cancelled on the way out.
        Returns False when the client went away (`disconnected()`, asked after `DISCONNECT_POLL_S` without an
        output); a failed sample is a 500 `APIError` naming the first one's error."""
        try:
            while not all(s.done and (s.final is not None or not routes) for s in texts.values()):
                try:
                    out = await asyncio.wait_for(queue.get(), DISCONNECT_POLL_S)
                except asyncio.TimeoutError:
                    if await disconnected():
                        return False
                    continue
                sample = texts[out.request_id]
                sample.absorb(out)
                if sample.done and not out.status.is_final:
                    self.cancel([out.request_id])  # NOTE: stopped by a stop string
        finally:
            self.cancel([r for r, s in texts.items() if not s.done])
        failed = [s for s in texts.values() if s.finish_reason == "error"]
        if failed:
            self.counters["failed"] += 1
            raise APIError(f"generation failed: {failed[0].error}", None, 500, "server_error")
        return True

    async def updates(self, queue: asyncio.Queue,
                      texts: Mapping[str, SampleText]) -> AsyncIterator[tuple[SampleText, str]]:
        """For a stream: hand each output on `queue` to its sample (`texts` as in `collect`) until every sample is
        done, yielding `(sample, its new text)` for each output a running sample took (a failed one too: its
        `finish_reason` is "error"); a sample a stop string ended is cancelled. The caller cancels what is left
        when the stream ends early."""
        while not all(s.done for s in texts.values()):
            out = await queue.get()
            sample = texts[out.request_id]
            if sample.done:
                continue
            delta = sample.absorb(out)
            if sample.done and not out.status.is_final:
                self.cancel([out.request_id])  # NOTE: stopped by a stop string
            yield sample, delta

    def cancel(self, rids: Sequence[str]) -> None:
        for rid in rids:
            if rid in self._sinks:  # NOTE: finished ones have left; their sink is gone
                self.manager.cancel_request(rid)

    def cancel_all(self) -> int:
        """Cancel every request this server has in flight; returns how many samples."""
        live = list(self._sinks)
        self.cancel(live)
        return len(live)

    # ------------------------------------------------------------- control
    def pause(self, mode: InFlight) -> None:
        with self._control:
            self.user_paused = mode
            self.manager.pause(mode)

    def resume(self) -> None:
        with self._control:
            self.user_paused = None
            if not self.asleep:
                self.manager.resume()

    def is_paused(self) -> bool:
        return self.manager.is_paused()

    def update_weights(self, source: Mapping[str, torch.Tensor] | torch.nn.Module,
                       in_flight: InFlight = UPDATE_DEFAULT) -> int:
        """Copy new weights in (all or nothing for a mapping); returns the new version. Requests in flight
        (`rollout.in_flight`): "wait" finishes them first under the old weights, "abort" cancels them, "keep"
        lands the update between two engine steps and they go on under the new weights, their KV kept.
        Paused with mode=keep, they are kept whatever `in_flight` says (frozen, they could never finish)."""
        check_mode(in_flight, "in_flight")
        with self._control, team_released_after():
            if self.manager.pause_mode == "keep" or in_flight == "keep":
                return self.engine.update_weights(source, in_flight="keep")
            return self._while_paused(lambda: self.engine.update_weights(source, in_flight), in_flight)

    def reset_prefix_cache(self) -> int:
        with self._control:
            return self._while_paused(self._reset)

    def _reset(self) -> int:
        with self.manager.step_lock:
            return self.manager.reset_prefix_cache()

    def sleep(self) -> None:
        with self._control:
            if self.asleep:
                return
            if self.manager.pause_mode == "keep" and self.manager.has_work():
                raise APIError("sleep needs no requests in flight: resume, or pause with mode=abort|wait", None, 409)
            self.manager.pause(self.manager.pause_mode or "wait")
            with team_released_after():
                self.engine.sleep()
            self.asleep = True

    def wake_up(self) -> None:
        with self._control:
            if not self.asleep:
                return
            with team_released_after():
                self.engine.wake()
            self.asleep = False
            if self.user_paused is None:
                self.manager.resume()

    def _while_paused(self, fn, mode: InFlight = "wait"):
        """Run `fn` with no step under way and no new request admitted, in-flight work first finished
        ("wait") or cancelled ("abort")."""
        own = self.manager.pause_mode is None
        if own:
            self.manager.pause(mode)
        try:
            return fn()
        finally:
            if own:
                self.manager.resume()

    @property
    def weight_version(self) -> int:
        return self.engine.policy_version

    def cache_stats(self) -> dict:
        return self.manager.cache_stats()


def _param_of(message: str) -> str | None:
    """The request field an engine ValueError is about."""
    for key, param in (
        ("return_routed_experts", "return_routed_experts"),
        ("min_p", "min_p"),
        ("repetition_penalty", "repetition_penalty"),
        ("presence_penalty", "presence_penalty"),
        ("frequency_penalty", "frequency_penalty"),
        ("min_tokens", "min_tokens"),
        ("logit_bias", "logit_bias"),
        ("bad_words", "bad_words"),
        ("generation_config", None),
        ("input_ids", "prompt"),
        ("max_new_tokens", "max_tokens"),
        ("KV pages", "max_tokens"),
        ("temperature", "temperature"),
        ("top_k", "top_k"),
        ("top_p", "top_p"),
        ("seed", "seed"),
        ("eos", "stop_token_ids"),
        ("top_logprobs", "logprobs"),
        ("score_from", "echo"),
    ):
        if key in message:
            return param
    return None
