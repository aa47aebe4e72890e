"""rollout in-process under TRL's `AsyncGRPOTrainer` (`trl.experimental.async_grpo`, TRL 1.16): its
`rollout_worker=` and `weight_transfer=` protocols, with no vLLM server.

```python
from rollout.integrations.trl_async import InPlaceWeightTransfer, RolloutWorker
worker = RolloutWorker(model_name=MODEL_DIR, dataset=ds, reward_funcs=[reward], processing_class=tok,
                       num_generations=8, max_tokens=64, temperature=1.0)
trainer = AsyncGRPOTrainer(model=MODEL_DIR, reward_funcs=[reward], args=config, train_dataset=ds,
                           processing_class=tok, rollout_worker=worker,
                           weight_transfer=InPlaceWeightTransfer(worker))
```

- `RolloutWorker(**kw)` takes the keyword arguments TRL hands its own `AsyncRolloutWorker` (`model_name`: a
  local `save_pretrained` directory; `dataset`, `reward_funcs`, `processing_class`, `eos_token_ids`,
  `num_generations`, `max_tokens`, `temperature`, `top_p`, `top_k`, `min_p`, `repetition_penalty`,
  `queue_maxsize`, `chat_template_kwargs`, ...; the rest are accepted and unused) plus our own `engine`
  (a running `RolloutEngine` to use instead of loading `model_name`), `config`, `dtype`, `groups_per_call`
  and `seed`. A thread walks the dataset (epoch after epoch), generates each row's group of `num_generations`
  with one `RolloutEngine.generate` call per `groups_per_call` rows, scores the group with TRL's reward
  functions (called as TRL calls them: `prompts`, `completions` as assistant messages for conversational
  prompts, `completion_ids`, and the row's other columns), and puts one `RolloutSample` per completion on
  `rollout_buffer`: `input_ids` = prompt + completion, `completion_mask`, `old_log_probs` (the sampler's
  logprobs, 0 on the prompt), TRL's advantage `(r - mean) / (std + 1e-8)` (population std; a row every reward
  function scored None gets 0) and `model_version`: the trainer's version of the oldest weights any of its
  tokens came from.
- `InPlaceWeightTransfer(worker)`: `send_weights` writes the trainer's `(name, tensor)` stream into the
  worker's engine through `RolloutEngine.update_weights` (names checked, copied in place between two engine
  steps, the requests in flight finished under the old weights first); `pause` / `resume` need nothing.
- The trainer calls `stop()` at the end of training; the engine stays up (its weights are the trained
  policy's) until `worker.close()`.

Single-process trainers (no `accelerate launch`); the worker runs on the trainer's machine and threads.
"""

from __future__ import annotations

import logging
import math
import queue
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import torch

from rollout.api.chat import chat_template_ids, is_conversational
from rollout.api.engine import RolloutEngine
from rollout.config import ContinuousBatchingConfig
from rollout.sampling_params import SamplingParams

logger = logging.getLogger("rollout")


class RolloutWorker:
    """TRL's rollout-worker protocol (`rollout_buffer`, `metrics_queue`, `start`, `stop`,
    `update_model_version`, `check_health`) over a `RolloutEngine` in this process."""

    def __init__(
        self,
        *,
        model_name: str | None = None,
        dataset=None,
        reward_funcs: Sequence[Callable] = (),
        processing_class=None,
        eos_token_ids: Sequence[int] | None = None,
        num_generations: int = 8,
        max_tokens: int = 32,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = 0,
        min_p: float | None = None,
        repetition_penalty: float = 1.0,
        queue_maxsize: int = 0,
        chat_template_kwargs: dict | None = None,
        engine: RolloutEngine | None = None,
        config: ContinuousBatchingConfig | None = None,
        dtype: str = "float32",
        groups_per_call: int = 1,
        seed: int | None = 0,
        **_unused: Any,
    ) -> None:
        if dataset is None or len(dataset) == 0:
            raise ValueError("RolloutWorker needs a non-empty dataset with a 'prompt' column")
        if not reward_funcs:
            raise ValueError("RolloutWorker needs at least one reward function")
        if num_generations < 2:
            raise ValueError(
                f"num_generations must be >= 2 (a group's advantages need two), got {num_generations}"
            )
        self.dataset, self.reward_funcs = dataset, list(reward_funcs)
        self.tokenizer = processing_class
        self.num_generations, self.max_tokens, self.groups_per_call = (
            num_generations,
            max_tokens,
            groups_per_call,
        )
        self.chat_template_kwargs = dict(chat_template_kwargs or {})
        self.sampling = {"temps": temperature, "top_p": top_p, "top_k": top_k or None}
        self.processors = {
            k: v
            for k, v in (("min_p", min_p), ("repetition_penalty", repetition_penalty))
            if v is not None and v != {"min_p": 0.0, "repetition_penalty": 1.0}[k]
        }
        self.seed = seed
        self.stop_ids = sorted(set(eos_token_ids or ()))
        self.engine = (
            engine if engine is not None else _load_engine(model_name, processing_class, config, dtype)
        )
        self.owns_engine = engine is None
        self.rollout_buffer: queue.Queue = queue.Queue(maxsize=queue_maxsize)
        self.metrics_queue: queue.Queue = queue.Queue()
        self.model_version = 0
        self.versions: dict[int, int] = {self.engine.policy_version: 0}  # engine version -> trainer version
        self.heartbeat = time.monotonic()
        self.error: BaseException | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._group = 0

    # ------------------------------------------------------------------ TRL's protocol
    def start(self) -> None:
        if self._thread is not None:
            return
        self._thread = threading.Thread(target=self._run, name="rollout-trl-worker", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        while True:  # NOTE: a put blocked on a full buffer would keep the thread alive
            try:
                self.rollout_buffer.get_nowait()
            except queue.Empty:
                break
        if self._thread is not None:
            self._thread.join(60)

    def close(self) -> None:
        """Stop, and close the engine this worker loaded (one passed as `engine=` stays open: its owner's)."""
        self.stop()
        if self.owns_engine:
            self.engine.close()

    def update_model_version(self, model_version: int) -> None:
        self.model_version = int(model_version)
        self.versions[self.engine.policy_version] = self.model_version

    def check_health(self, stale_after_s: float) -> None:
        if self.error is not None:
            raise RuntimeError(
                f"the rollout worker failed: {type(self.error).__name__}: {self.error}"
            ) from self.error
        if self._thread is not None and not self._thread.is_alive() and not self._stop.is_set():
            raise RuntimeError("the rollout worker thread stopped")
        if time.monotonic() - self.heartbeat > stale_after_s:
            raise RuntimeError(f"the rollout worker produced nothing for {stale_after_s} s")

    # ------------------------------------------------------------------ the loop
    def _rows(self) -> Iterator[dict]:
        while not self._stop.is_set():
            yield from self.dataset

    def _run(self) -> None:
        try:
            rows = self._rows()
            while not self._stop.is_set():
                batch = [next(rows) for _ in range(self.groups_per_call)]
                for sample in self._generate(batch):
                    while not self._stop.is_set():
                        try:
                            self.rollout_buffer.put(sample, timeout=0.2)
                            break
                        except queue.Full:
                            self.heartbeat = time.monotonic()  # NOTE: waiting on the trainer is not a stall
                self.heartbeat = time.monotonic()
        except BaseException as e:  # noqa: BLE001 (reported through check_health, as TRL's worker does)
            logger.exception("the rollout worker failed")
            self.error = e

    def _prompt_ids(self, prompt) -> list[int]:
        if is_conversational(prompt):
            return list(
                chat_template_ids(
                    self.tokenizer, prompt, add_generation_prompt=True, **self.chat_template_kwargs
                )
            )
        return list(self.tokenizer(prompt, add_special_tokens=False)["input_ids"])

    def _generate(self, rows: list[dict]) -> list:
        from trl.experimental.async_grpo.async_rollout_worker import RolloutSample

        prompts = [self._prompt_ids(row["prompt"]) for row in rows]
        seed = None if self.seed is None else self.seed + self._group
        batch = self.engine.generate(
            prompts,
            group_size=self.num_generations,
            max_new_tokens=self.max_tokens,
            seed=seed,
            **self.sampling,
            sampling=SamplingParams(stop_token_ids=self.stop_ids or None, **self.processors),
        )
        samples, g = [], self.num_generations
        for i, row in enumerate(rows):
            group_id, self._group = self._group, self._group + 1
            lo = i * g
            ids = [
                batch.completion_ids[lo + j][batch.completion_mask[lo + j].bool()].tolist() for j in range(g)
            ]
            texts = [self.tokenizer.decode(t, skip_special_tokens=True) for t in ids]
            chat = is_conversational(row["prompt"])
            completions = [[{"role": "assistant", "content": t}] for t in texts] if chat else texts
            rewards = self._rewards(row, completions, ids)
            advantages, scored = _advantages(rewards)
            version = self._trainer_version(batch, lo, g)
            metrics = {
                "reward": float("nan") if not scored.size else float(scored.mean()),
                "reward_std": float("nan") if not scored.size else float(scored.std()),
            }
            for j in range(g):
                lps = batch.logprobs[lo + j][: len(ids[j])].tolist()
                p = prompts[i]
                samples.append(
                    RolloutSample(
                        prompt=row["prompt"],
                        completion=completions[j],
                        input_ids=_np(p + ids[j], "int64"),
                        completion_mask=_np([0] * len(p) + [1] * len(ids[j]), "int64"),
                        old_log_probs=_np([0.0] * len(p) + lps, "float32"),
                        advantage=float(advantages[j]),
                        model_version=version,
                        group_id=group_id,
                        metrics={**metrics, "reward": float(rewards[j])},
                        enqueued_at=time.time(),
                    )
                )
        self.metrics_queue.put({"rollout/groups": float(len(rows))})
        return samples

    def _rewards(self, row: dict, completions: list, ids: list[list[int]]) -> list[float]:
        g = self.num_generations
        extra = {k: [v] * g for k, v in row.items() if k not in ("prompt", "completion", "completion_ids")}
        columns = []
        for fn in self.reward_funcs:
            out = fn(prompts=[row["prompt"]] * g, completions=completions, completion_ids=ids, **extra)
            columns.append([math.nan if r is None else float(r) for r in out])
        return [
            math.nan
            if all(math.isnan(c[j]) for c in columns)
            else sum(c[j] for c in columns if not math.isnan(c[j]))
            for j in range(g)
        ]

    def _trainer_version(self, batch, lo: int, g: int) -> int:
        """The trainer's version of the oldest weights that sampled any token of the group."""
        versions = getattr(batch, "versions", None)
        if versions is None:
            return self.model_version
        oldest = min(int(v) for j in range(g) for v in versions[lo + j][batch.completion_mask[lo + j].bool()])
        known = [k for k in self.versions if k <= oldest]
        return self.versions[max(known)] if known else self.model_version


class InPlaceWeightTransfer:
    """TRL's weight-transfer protocol: the trainer's `(name, tensor)` stream copied into `worker`'s engine."""

    def __init__(self, worker: RolloutWorker) -> None:
        self.worker = worker
        self.sent = 0  # updates applied

    def init_weight_transfer(self) -> None:
        return None

    def pause(self) -> None:
        return None  # NOTE: the update itself waits for the requests in flight (in_flight="wait")

    def send_weights(self, iterator: Iterable[tuple[str, torch.Tensor]]) -> None:
        self.worker.engine.update_weights(((n, t.detach()) for n, t in iterator), in_flight="wait")
        self.sent += 1

    def resume(self) -> None:
        return None

    def destroy(self) -> None:
        return None


def _advantages(rewards: list[float]):
    import numpy as np

    r = np.asarray(rewards, dtype=float)
    ok = ~np.isnan(r)
    adv = np.zeros_like(r)
    if ok.any():
        adv[ok] = (r[ok] - r[ok].mean()) / (r[ok].std() + 1e-8)
    return adv, r[ok]


def _np(values: list, dtype: str):
    import numpy as np

    return np.asarray(values, dtype=dtype)


def _load_engine(
    model_name: str | None, tokenizer, config: ContinuousBatchingConfig | None, dtype: str
) -> RolloutEngine:
    if model_name is None:
        raise ValueError("RolloutWorker needs model_name (a local save_pretrained directory) or engine=")
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_name, dtype=getattr(torch, dtype))
    model.eval()
    return RolloutEngine(model, tokenizer=tokenizer, config=config or ContinuousBatchingConfig())
