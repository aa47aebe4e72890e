"""The sampling side of the Tinker service: `asample` through one `RolloutEngine`, adapters in memory.

`Sampler.publish` (the SDK's `save_weights_for_sampler`) pushes a training client's adapter into the engine
under a new name (`add_lora`: the adapter's tensors only, the base shared by every client), so a sampling
client made from one save keeps sampling those weights; the oldest saves of a model are unloaded past
`keep` (a sampling session whose adapter was unloaded gets an error naming it). Sampling runs the engine's
`generate` (n samples as one group, seeds, temperature / top-k / top-p, stop token ids), prompt logprobs its
`score` (teacher forcing of the prompt after its first token, top-k too).

In batch-invariant mode the engine's LoRA slots are off (`rollout.api.lora`), so each training client gets
an engine of its own, built with `batch_invariant=True` on a `PeftModel` copy holding its adapter (PEFT's own
layers, every linear through the invariant ops, as the trainer's `InvariantForward` runs them); `publish`
copies the adapter's tensors into it (`update_weights` with them by name: the latest save only, earlier
sampling sessions of that
model see it too).
"""

from __future__ import annotations

import copy
import threading
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

from rollout.sampling_params import SamplingParams
from rollout.tinker.wire import Sequence, UserError, sample_response

MASK_LOGPROB = -99999.0  # NOTE: the SDK's TopkLogprobs sentinel of a position with no logprobs


@dataclass
class Params:
    """An `asample`'s sampling fields, checked."""

    num_samples: int
    max_tokens: int | None
    temperature: float
    top_k: int | None
    top_p: float
    seed: int | None
    stop_ids: list[int] | None

    def sampling(self) -> SamplingParams:
        """The engine's `SamplingParams`: `stop=[]` (Tinker: no stop token at all) is `ignore_eos`; other stop
        ids stop besides the model's EOS."""
        return SamplingParams(
            temperature=self.temperature,
            top_k=self.top_k or 0,
            top_p=self.top_p,
            seed=self.seed,
            max_tokens=self.max_tokens,
            stop_token_ids=self.stop_ids or (),
            ignore_eos=self.stop_ids == [],
        )

    def batch_key(self, target) -> tuple:
        """Requests with equal keys run in one `generate` call (no seed: a seeded one runs alone)."""
        stop = tuple(self.stop_ids) if self.stop_ids is not None else None
        return (target, self.num_samples, self.max_tokens, self.top_k, self.top_p, stop)


def check_params(body: dict, tokenizer, vocab: int) -> Params:
    """`Params` from a `SampleRequest` JSON body; UserError naming a bad field."""
    sp = body.get("sampling_params")
    if not isinstance(sp, dict):
        raise UserError("sampling_params is required (an object)")
    n = body.get("num_samples", 1)
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise UserError(f"num_samples must be a positive int, got {n!r}")
    max_tokens = sp.get("max_tokens")
    if max_tokens is not None and (
        isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1
    ):
        raise UserError(f"sampling_params.max_tokens must be a positive int, got {max_tokens!r}")
    temperature = sp.get("temperature", 1.0)
    if (
        isinstance(temperature, bool)
        or not isinstance(temperature, (int, float))
        or not 0 <= temperature < 1e4
    ):
        raise UserError(f"sampling_params.temperature must be a number >= 0, got {temperature!r}")
    top_k = sp.get("top_k", -1)
    if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k == 0 or top_k < -1:
        raise UserError(f"sampling_params.top_k must be -1 (off) or a positive int, got {top_k!r}")
    top_p = sp.get("top_p", 1.0)
    if isinstance(top_p, bool) or not isinstance(top_p, (int, float)) or not 0 < top_p <= 1:
        raise UserError(f"sampling_params.top_p must be in (0, 1], got {top_p!r}")
    seed = sp.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise UserError(f"sampling_params.seed must be an int, got {seed!r}")
    return Params(
        n,
        max_tokens,
        float(temperature),
        None if top_k == -1 else top_k,
        float(top_p),
        seed,
        stop_ids(sp.get("stop"), tokenizer, vocab),
    )


def stop_ids(stop, tokenizer, vocab: int) -> list[int] | None:
    """Stop token ids of `SamplingParams.stop`: ids as they are, a string that is one token as its id."""
    if stop is None:
        return None
    items = [stop] if isinstance(stop, str) else stop
    if not isinstance(items, list):
        raise UserError(f"sampling_params.stop must be a string or a list, got {stop!r}")
    out = []
    for s in items:
        if isinstance(s, int) and not isinstance(s, bool):
            if not 0 <= s < vocab:
                raise UserError(f"sampling_params.stop: token id {s} is outside [0, {vocab})")
            out.append(s)
        elif isinstance(s, str):
            ids = tokenizer.encode(s, add_special_tokens=False) if tokenizer is not None else []
            if len(ids) != 1:
                raise UserError(
                    f"sampling_params.stop: {s!r} is {len(ids)} tokens; only stop strings of one "
                    "token (or token ids) are supported"
                )
            out.append(ids[0])
        else:
            raise UserError(f"sampling_params.stop: {s!r} is neither a token id nor a string")
    return out


def prompt_tokens(body: dict, vocab: int) -> list[int]:
    prompt = body.get("prompt")
    if not isinstance(prompt, dict) or not isinstance(prompt.get("chunks"), list):
        raise UserError("prompt must be a ModelInput ({'chunks': [...]})")
    tokens: list[int] = []
    for i, chunk in enumerate(prompt["chunks"]):
        if not isinstance(chunk, dict) or chunk.get("type", "encoded_text") != "encoded_text":
            raise UserError(f"prompt.chunks[{i}]: only encoded_text chunks are supported")
        ids = chunk.get("tokens")
        if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise UserError(f"prompt.chunks[{i}].tokens must be a list of ints")
        tokens.extend(ids)
    if not tokens:
        raise UserError("prompt is empty")
    if min(tokens) < 0 or max(tokens) >= vocab:
        raise UserError(f"prompt has token ids outside [0, {vocab})")
    return tokens


class Sampler:
    """Args: engine: the shared `RolloutEngine` on the base model; keep: saves of one model kept loaded;
    invariant: build one batch-invariant engine per training client (`make_engine(model)`)."""

    def __init__(self, engine, keep: int = 2, invariant: bool = False, make_engine=None) -> None:
        self.engine, self.keep, self.invariant, self.make_engine = engine, keep, invariant, make_engine
        self.loaded: OrderedDict[str, str] = OrderedDict()  # adapter name -> model_id, oldest first
        self.removed: set[str] = set()
        self.saves: dict[str, int] = {}
        self.own: dict[str, tuple] = {}  # model_id -> (engine, PeftModel) in invariant mode
        self.lock = threading.Lock()

    # ---------------------------------------------------------------- adapters
    def publish(self, trainer, model_id: str) -> str:
        """Push `model_id`'s adapter (as it is now) for sampling; returns the target `sample` takes."""
        k = self.saves[model_id] = self.saves.get(model_id, 0) + 1
        if self.invariant:
            return self._publish_invariant(trainer, model_id)
        name = f"{model_id}#{k}"
        sd, config = trainer.state_dict(model_id), trainer.lora_config(model_id)
        with self.lock:
            mine = [n for n, m in self.loaded.items() if m == model_id]
            for old in mine[: max(0, len(mine) - self.keep + 1)]:
                self._unload(old)
            while True:
                try:
                    self.engine.add_lora(name, sd, config=config)
                    break
                except ValueError as e:
                    if "full" not in str(e) or not self.loaded:
                        raise
                    self._unload(next(iter(self.loaded)))  # NOTE: the table is full: the oldest save goes
            self.loaded[name] = model_id
        return name

    def _unload(self, name: str) -> None:
        self.engine.remove_lora(name)
        del self.loaded[name]
        self.removed.add(name)

    def _publish_invariant(self, trainer, model_id: str) -> str:
        from peft import get_peft_model, set_peft_model_state_dict

        if model_id not in self.own:
            sd = trainer.state_dict(model_id)
            adapter = trainer.get(model_id)
            peft = get_peft_model(
                copy.deepcopy(trainer.base_model_copy()),
                copy.deepcopy(trainer.lora_config(model_id)),
                adapter_name=adapter.name,
            ).eval()
            set_peft_model_state_dict(peft, sd, adapter_name=adapter.name)
            self.own[model_id] = (self.make_engine(peft), peft)
        else:  # NOTE: copied in between two steps (the engine's lock), never under a running generate
            self.own[model_id][0].update_weights(trainer.adapter_tensors(model_id))
        return f"{model_id}#own"

    def check_target(self, target: str | None) -> None:
        if target is None or target in self.loaded or target.endswith("#own"):
            return
        if target in self.removed:
            raise UserError(
                f"sampler weights {target!r} were unloaded (only the latest {self.keep} saves of a "
                "model stay loaded): save_weights_for_sampler again"
            )
        raise UserError(f"unknown sampler weights {target!r}")

    def _engine(self, target: str | None):
        if target is not None and target.endswith("#own"):
            return self.own[target.removesuffix("#own")][0], None
        return self.engine, target

    # ---------------------------------------------------------------- sampling
    def sample(self, target: str | None, prompts: list[list[int]], params: Params) -> list[list[Sequence]]:
        """`params.num_samples` sequences for each prompt (one `generate` call)."""
        self.check_target(target)
        engine, lora = self._engine(target)
        batch = engine.generate(prompts, sampling=params.sampling(), group_size=params.num_samples, lora=lora)
        out: list[list[Sequence]] = [[] for _ in prompts]
        for row in range(len(batch)):
            m = batch.completion_mask[row].bool()
            reason = "length" if batch.finish_reasons[row] == "length" else "stop"
            out[row // params.num_samples].append(
                Sequence(batch.completion_ids[row][m].tolist(), batch.logprobs[row][m].tolist(), reason)
            )
        return out

    def prompt_logprobs(self, target: str | None, prompt: list[int], topk: int):
        """(logprobs [len(prompt)] with NaN first, top-k (ids, logprobs) [len(prompt), k] or None)."""
        self.check_target(target)
        engine, lora = self._engine(target)
        n = len(prompt)
        logprobs = np.full(n, np.nan, dtype=np.float32)
        top = None
        if topk:
            top = (np.zeros((n, topk), dtype=np.int32), np.full((n, topk), MASK_LOGPROB, dtype=np.float32))
        if n > 1:
            scored = engine.score([prompt[:1]], [prompt[1:]], top_logprobs=topk, lora=lora)
            logprobs[1:] = scored.logprobs[0, : n - 1].numpy()
            if topk:
                top[0][1:] = scored.top_ids[0, : n - 1].numpy()
                top[1][1:] = scored.top_logprobs[0, : n - 1].numpy()
        return logprobs, top

    def response(self, sequences: list[Sequence], logprobs=None, top=None) -> bytes:
        return sample_response(sequences, None if logprobs is None else logprobs.tolist(), top)

    def close(self) -> None:
        for engine, _ in self.own.values():
            engine.close()
