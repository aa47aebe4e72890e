"""The Tinker service's state: sessions, training clients, sampling sessions and futures, and the two workers
that run requests.

Every training request (`create_model`, `forward_backward`, `optim_step`, saves and loads) goes to one FIFO
worker in the order it arrived (the SDK submits a training client's requests in its own order); `asample`
requests go to a second worker, which takes every request queued at once (waiting `batch_wait_s` for
more) and runs those with the same adapter and sampling fields as one `generate` call. A request returns a
future id at once;
`retrieve_future` answers its result, `try_again` while it is queued or running (after waiting up to
`poll_s` for it), or `{error, category}` (`user`: the request was wrong; `server`: it failed here).
"""

from __future__ import annotations

import functools
import itertools
import logging
import queue
import threading
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rollout.tinker.sampling import Params, Sampler, check_params, prompt_tokens
from rollout.tinker.training import Trainer, checkpoint_rank
from rollout.tinker.wire import UserError, forward_backward_output, parse_forward_backward

logger = logging.getLogger("rollout.tinker")
MAX_FUTURES = 20_000  # NOTE: finished results kept for retrieval; the oldest go first past this


@dataclass
class Future:
    kind: str  # "json" | "proto"
    done: threading.Event = field(default_factory=threading.Event)
    result: Any = None
    error: str | None = None
    category: str = "user"


@dataclass
class SampleJob:
    request_id: str
    target: str | None
    prompt: list[int]
    params: Params
    prompt_logprobs: bool
    topk: int


def reraise(e: BaseException):
    raise e


def tinker_path(model_id: str, kind: str, name: str) -> str:
    return f"tinker://{model_id}/{kind}/{name}"


class Service:
    """Args: engine: `RolloutEngine` on the base; trainer: `Trainer`; sampler: `Sampler`; base_model: the
    name clients send (and the tokenizer path the SDK loads); checkpoint_dir: where `save_weights` writes."""

    def __init__(
        self,
        engine,
        trainer: Trainer,
        sampler: Sampler,
        base_model: str,
        checkpoint_dir: Path,
        max_context: int | None = None,
        poll_s: float = 5.0,
    ) -> None:
        self.engine, self.trainer, self.sampler = engine, trainer, sampler
        self.base_model, self.checkpoint_dir, self.max_context = base_model, Path(checkpoint_dir), max_context
        self.poll_s = poll_s
        self.batch_wait_s = 0.005  # NOTE: how long the sampling worker waits for more requests to batch
        self.tokenizer = engine.tokenizer
        self.vocab = trainer.vocab
        self.sessions: dict[str, dict] = {}
        self.models: dict[str, dict] = {}
        self.samplers: dict[str, dict] = {}
        self.saved_paths: dict[str, str] = {}  # tinker://.../sampler_weights/NAME -> sampler target
        self.futures: OrderedDict[str, Future] = OrderedDict()
        self._ids = itertools.count()
        self._lock = threading.Lock()
        self._train: queue.Queue = queue.Queue()
        self._sample: queue.Queue = queue.Queue()
        self._stop = threading.Event()
        self._threads = [
            threading.Thread(target=self._train_loop, name="tinker-train", daemon=True),
            threading.Thread(target=self._sample_loop, name="tinker-sample", daemon=True),
        ]
        for t in self._threads:
            t.start()

    # ----------------------------------------------------------------- futures
    def _new_future(self, kind: str) -> str:
        with self._lock:
            rid = f"fut-{next(self._ids)}"
            self.futures[rid] = Future(kind)
            while len(self.futures) > MAX_FUTURES:
                self.futures.popitem(last=False)
        return rid

    def _finish(self, rid: str, fn) -> None:
        fut = self.futures.get(rid)
        if fut is None:
            return
        try:
            fut.result = fn()
        except UserError as e:
            fut.error, fut.category = str(e), "user"
        except ValueError as e:  # NOTE: the engine's refusals name the problem (a prompt too long, ...)
            fut.error, fut.category = str(e), "user"
        except Exception as e:
            logger.exception("tinker request %s failed", rid)
            fut.error, fut.category = f"{type(e).__name__}: {e}", "server"
        fut.done.set()

    def submit_training(self, fn, kind: str = "json") -> str:
        rid = self._new_future(kind)
        self._train.put((rid, fn))
        return rid

    def future(self, rid) -> Future:
        """Future `rid` (done or not); UserError when unknown."""
        fut = self.futures.get(rid) if isinstance(rid, str) else None
        if fut is None:
            raise UserError(f"unknown request_id {rid!r}")
        return fut

    def _train_loop(self) -> None:
        while not self._stop.is_set():
            try:
                rid, fn = self._train.get(timeout=0.5)
            except queue.Empty:
                continue
            self._finish(rid, fn)

    def _sample_loop(self) -> None:
        while not self._stop.is_set():
            try:
                jobs = [self._sample.get(timeout=0.5)]
            except queue.Empty:
                continue
            time.sleep(self.batch_wait_s)  # NOTE: requests sent together (a group, a batch) arrive together
            while True:
                try:
                    jobs.append(self._sample.get_nowait())
                except queue.Empty:
                    break
            groups: dict[tuple, list[SampleJob]] = {}
            for job in jobs:  # NOTE: seeded or prompt-logprob requests run alone
                alone = job.params.seed is not None or job.prompt_logprobs or job.topk
                key = ("alone", job.request_id) if alone else job.params.batch_key(job.target)
                groups.setdefault(key, []).append(job)
            for group in groups.values():
                self._run_samples(group)

    def _run_samples(self, group: list[SampleJob]) -> None:
        first = group[0]
        try:
            seqs = self.sampler.sample(first.target, [j.prompt for j in group], first.params)
        except Exception as e:
            if len(group) == 1:
                self._finish(first.request_id, functools.partial(reraise, e))
                return
            for job in group:  # NOTE: one bad request must not fail the others: each runs alone
                self._run_samples([job])
            return
        for job, s in zip(group, seqs, strict=True):

            def result(job=job, s=s):
                if job.prompt_logprobs or job.topk:
                    lp, top = self.sampler.prompt_logprobs(job.target, job.prompt, job.topk)
                    return self.sampler.response(s, lp if job.prompt_logprobs else None, top)
                return self.sampler.response(s)

            self._finish(job.request_id, result)

    def close(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(5)
        self.sampler.close()

    # ---------------------------------------------------------------- sessions
    def create_session(self, body: dict) -> dict:
        sid = f"sess-{uuid.uuid4().hex[:8]}"
        self.sessions[sid] = {
            "created": time.time(),
            "finished": False,
            "metadata": body.get("user_metadata"),
        }
        return {"type": "create_session", "session_id": sid}

    def session(self, sid) -> dict:
        s = self.sessions.get(sid) if isinstance(sid, str) else None
        if s is None:
            raise UserError(f"unknown session_id {sid!r} (create_session first)")
        return s

    def check_base(self, base_model) -> None:
        if base_model is not None and base_model != self.base_model:
            raise UserError(
                f"base_model {base_model!r} is not served here (this server serves {self.base_model!r})"
            )

    # ------------------------------------------------------------------ models
    def create_model(self, body: dict) -> str:
        self.session(body.get("session_id"))
        self.check_base(body.get("base_model"))
        seq = body.get("model_seq_id")
        if isinstance(seq, bool) or not isinstance(seq, int):
            raise UserError(f"model_seq_id must be an int, got {seq!r}")
        lora = body.get("lora_config") or {}
        if not isinstance(lora, dict):
            raise UserError("lora_config must be an object")
        model_id = f"{body['session_id']}:train:{seq}"
        if model_id in self.models:
            raise UserError(f"model {model_id!r} exists already")
        opt = body.get("optimizer_config") or {"type": "adamw"}
        if not isinstance(opt, dict) or opt.get("type", "adamw") not in ("adam", "adamw"):
            raise UserError(f"optimizer_config {opt!r} is not supported (Adam only)")
        rank = lora.get("rank", 32)
        self.models[model_id] = {
            "session": body["session_id"],
            "rank": rank,
            "metadata": body.get("user_metadata"),
        }

        def run():
            try:
                self.trainer.create(
                    model_id,
                    rank,
                    lora.get("seed"),
                    bool(lora.get("train_attn", True)),
                    bool(lora.get("train_mlp", True)),
                    bool(lora.get("train_unembed", True)),
                )
            except Exception:
                self.models.pop(model_id, None)
                raise
            return {"type": "create_model", "model_id": model_id}

        return self.submit_training(run)

    def model(self, model_id) -> dict:
        m = self.models.get(model_id) if isinstance(model_id, str) else None
        if m is None:
            raise UserError(f"unknown model_id {model_id!r} (create_model first)")
        return m

    def get_info(self, body: dict) -> dict:
        model_id = body.get("model_id")
        m = self.model(model_id)
        arch = type(self.trainer.original).__name__
        return {
            "type": "get_info",
            "model_id": model_id,
            "is_lora": True,
            "lora_rank": m["rank"],
            "model_name": self.base_model,
            "optimizer_config": {"type": "adamw"},
            "model_data": {"arch": arch, "model_name": self.base_model, "tokenizer_id": self.base_model},
        }

    def forward_backward(self, body: bytes) -> str:
        req = parse_forward_backward(body)
        self.model(req.model_id)

        def run():
            outputs, metrics = self.trainer.forward_backward(
                req.model_id, req.data, req.loss_fn, req.config, req.forward_only
            )
            return forward_backward_output(outputs, metrics)

        return self.submit_training(run, "proto")

    def optim_step(self, body: dict) -> str:
        model_id = body.get("model_id")
        self.model(model_id)
        adam = body.get("adam_params") or body.get("optim_params")
        if not isinstance(adam, dict) or adam.get("learning_rate") is None:
            raise UserError("optim_step needs adam_params with a finite learning_rate")
        keys = ("learning_rate", "beta1", "beta2", "eps", "weight_decay", "grad_clip_norm")
        unknown = set(adam) - set(keys)
        if unknown:
            raise UserError(f"adam_params: unknown fields {sorted(unknown)}")
        args = {k: adam[k] for k in keys if k in adam and adam[k] is not None}
        args["lr"] = args.pop("learning_rate")
        return self.submit_training(lambda: {"metrics": self.trainer.optim_step(model_id, **args)})

    # ----------------------------------------------------------------- weights
    def _dir(self, path: str) -> tuple[str, str, Path]:
        """(model_id, checkpoint name, directory) of a `tinker://MODEL/weights/NAME` path."""
        if not isinstance(path, str) or not path.startswith("tinker://"):
            raise UserError(f"path {path!r} is not a tinker:// path")
        parts = path.removeprefix("tinker://").split("/")
        if len(parts) != 3 or parts[1] not in ("weights", "sampler_weights") or not parts[2]:
            raise UserError(f"path {path!r} is not tinker://MODEL_ID/weights/NAME")
        if any(p in ("", ".", "..") for p in parts) or "\\" in path:
            raise UserError(f"path {path!r} names no checkpoint")
        return parts[0], parts[2], self.checkpoint_dir / parts[0] / parts[1] / parts[2]

    def _name(self, name, what: str) -> str:
        if not isinstance(name, str) or not name or "/" in name or name in (".", ".."):
            raise UserError(f"{what} must be a checkpoint name without '/', got {name!r}")
        return name

    def save_weights(self, body: dict) -> str:
        model_id = body.get("model_id")
        self.model(model_id)
        name = self._name(body.get("path") or f"step-{time.time_ns()}", "path")
        path = tinker_path(model_id, "weights", name)
        directory = self._dir(path)[2]
        if directory.exists() and not body.get("overwrite", False):
            raise UserError(f"checkpoint {path} exists (overwrite=True replaces it)")

        def run():
            self.trainer.save(model_id, directory)
            return {"type": "save_weights", "path": path}

        return self.submit_training(run)

    def load_weights(self, body: dict) -> str:
        path = body.get("path")
        _, _, directory = self._dir(path)
        optimizer = bool(body.get("optimizer", False))
        model_id = body.get("model_id")
        if model_id is None:  # NOTE: create-via-load: the checkpoint's rank, a new model
            self.session(body.get("session_id"))
            self.check_base(body.get("base_model"))
            rank = checkpoint_rank(directory)
            self.create_model(
                {
                    "session_id": body["session_id"],
                    "model_seq_id": body.get("model_seq_id"),
                    "lora_config": {"rank": rank},
                }
            )  # NOTE: queued before the load below
            model_id = f"{body['session_id']}:train:{body.get('model_seq_id')}"
        else:
            self.model(model_id)

        def run():
            self.trainer.load(model_id, directory, optimizer)
            return {"type": "load_weights", "path": path, "model_id": model_id}

        return self.submit_training(run)

    def save_weights_for_sampler(self, body: dict) -> str:
        model_id = body.get("model_id")
        m = self.model(model_id)
        name = body.get("path")
        if name is not None:
            self._name(name, "path")

        def run():
            target = self.sampler.publish(self.trainer, model_id)
            sid = f"samp-{uuid.uuid4().hex[:8]}"
            path = tinker_path(model_id, "sampler_weights", name or target.split("#")[-1])
            if name is not None:
                self.trainer.save(model_id, self._dir(path)[2], optimizer=False)
            self.samplers[sid] = {"target": target, "model_path": path, "session": m["session"]}
            self.saved_paths[path] = target
            return {"type": "save_weights_for_sampler", "path": path, "sampling_session_id": sid}

        return self.submit_training(run)

    def create_sampling_session(self, body: dict) -> dict:
        self.session(body.get("session_id"))
        model_path = body.get("model_path")
        if model_path is None:
            if body.get("base_model") is None:
                raise UserError("create_sampling_session needs model_path or base_model")
            self.check_base(body.get("base_model"))
            target = None
        else:
            target = self.saved_paths.get(model_path)
            if target is None:
                self._dir(model_path)
                raise UserError(
                    f"model_path {model_path!r} is not a sampler checkpoint of this server "
                    "(save_weights_for_sampler first)"
                )
        sid = f"samp-{uuid.uuid4().hex[:8]}"
        self.samplers[sid] = {"target": target, "model_path": model_path, "session": body["session_id"]}
        return {"type": "create_sampling_session", "sampling_session_id": sid}

    def get_sampler(self, sid: str) -> dict:
        s = self.samplers.get(sid)
        if s is None:
            raise UserError(f"unknown sampling session {sid!r}")
        return {"sampler_id": sid, "base_model": self.base_model, "model_path": s["model_path"]}

    # ---------------------------------------------------------------- sampling
    def asample(self, body: dict) -> dict:
        sid = body.get("sampling_session_id")
        if sid is not None:
            s = self.samplers.get(sid)
            if s is None:
                raise UserError(f"unknown sampling_session_id {sid!r}")
            target = s["target"]
        elif body.get("model_path") is not None:
            target = self.saved_paths.get(body["model_path"])
            if target is None:
                raise UserError(
                    f"model_path {body['model_path']!r} is not a sampler checkpoint of this server"
                )
        else:
            self.check_base(body.get("base_model"))
            if body.get("base_model") is None:
                raise UserError("asample needs sampling_session_id, model_path or base_model")
            target = None
        self.sampler.check_target(target)
        for unsupported in ("target_prompt_logprobs", "prompt_logprobs_last_n"):
            if body.get(unsupported) is not None:
                raise UserError(f"{unsupported} is not supported by this server")
        for unsupported in ("topk_sample_logprobs", "prompt_alt_tokens_k"):
            if body.get(unsupported):
                raise UserError(f"{unsupported} is not supported by this server")
        prompt = prompt_tokens(body, self.vocab)
        params = check_params(body, self.tokenizer, self.vocab)
        if self.max_context is not None and len(prompt) + (params.max_tokens or 0) > self.max_context:
            raise UserError(
                f"prompt ({len(prompt)} tokens) + max_tokens ({params.max_tokens}) exceeds the "
                f"context of {self.max_context}"
            )
        topk = body.get("topk_prompt_logprobs") or 0
        if isinstance(topk, bool) or not isinstance(topk, int) or not 0 <= topk <= 20:
            raise UserError(f"topk_prompt_logprobs must be an int in [0, 20], got {topk!r}")
        rid = self._new_future("proto")
        self._sample.put(SampleJob(rid, target, prompt, params, bool(body.get("prompt_logprobs")), topk))
        return {"request_id": rid, "sample_sequence_ids": [f"{rid}:{i}" for i in range(params.num_samples)]}
