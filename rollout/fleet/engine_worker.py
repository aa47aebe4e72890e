"""`EngineWorker`: one `RolloutEngine` inside a Ray actor, the unit a `RolloutFleet` places and restarts.

The class is plain Python (Ray is imported only where an actor runs it): `RolloutFleet` wraps it with
`ray.remote(max_restarts=..., max_concurrency=...)`. A threaded actor, so an update with `in_flight="keep"`
lands while a `generate` runs (between two engine steps, as in process). At start (the first time or after
Ray restarted a dead actor) it loads the fleet's current weights and version from the `WeightStore` before it
serves anything, so a replacement never answers with stale weights.

Generation answers are `GenerationOutput`s (token ids, logprobs, per-token versions): the fleet packs the
groups of every engine into one `RolloutBatch`, in the call's order.
"""

from __future__ import annotations

import os
import socket
import warnings
from collections.abc import Mapping, Sequence

import torch

from rollout.api.batch import RolloutBatch
from rollout.api.engine import RolloutEngine
from rollout.config import ContinuousBatchingConfig
from rollout.requests import GenerationOutput, RequestStatus


class WeightStore:
    """The fleet's current weights (one object-store reference, shared by every engine) and their version.

    `set([ref], version)` takes the reference inside a list, so Ray hands the reference, not the tensors."""

    def __init__(self) -> None:
        self.version = 0
        self.refs: list = []

    def set(self, refs: list, version: int) -> int:
        self.refs, self.version = list(refs), int(version)
        return self.version

    def latest(self) -> tuple[int, list]:
        return self.version, self.refs


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def tokenizer_in(source):
    """The tokenizer saved in directory `source`, or None (not a directory, or no tokenizer files in it)."""
    if not isinstance(source, (str, os.PathLike)) or not any(
            os.path.exists(os.path.join(source, f)) for f in TOKENIZER_FILES):
        return None  # NOTE: transformers would build an empty tokenizer (EOS 0) from the model's config alone
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(source))


def to_payload(state: Mapping[str, torch.Tensor]) -> dict[str, tuple]:
    """CPU tensors as (numpy array, torch dtype name) pairs for the object store: Ray reads numpy arrays without a
    copy (views of its shared memory), where it would unpickle tensors (3.5 s `put` + 2 s read for 100M fp32 here,
    against 0.2-1.2 s + 0.01 s). Dtypes numpy lacks (bfloat16, ...) travel as integers of the same width."""
    out = {}
    for name, t in state.items():
        try:
            array = t.numpy()
        except TypeError:
            array = t.view(_SAME_WIDTH[t.element_size()]).numpy()
        out[name] = (array, str(t.dtype).removeprefix("torch."))
    return out


_SAME_WIDTH = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def from_payload(payload: Mapping[str, tuple]) -> dict[str, torch.Tensor]:
    """The tensors of `to_payload` (read-only views of the object store's arrays, copied in by `update_weights`)."""
    with warnings.catch_warnings():  # NOTE: the arrays are read-only; the engine only reads them
        warnings.simplefilter("ignore", UserWarning)
        return {name: torch.from_numpy(array).view(getattr(torch, dtype)) for name, (array, dtype) in payload.items()}


def load_policy(source, dtype: str | None, device: str):
    """The policy and its tokenizer (or None) from a `save_pretrained` directory, or the module given."""
    tokenizer = None
    if isinstance(source, (str, os.PathLike)):
        from transformers import AutoModelForCausalLM

        kwargs = {} if dtype is None else {"dtype": dtype if dtype == "auto" else getattr(torch, dtype)}
        model = AutoModelForCausalLM.from_pretrained(str(source), **kwargs)
        tokenizer = tokenizer_in(source)
    else:
        model = source
        if dtype is not None:
            model = model.to(getattr(torch, dtype))
    model = model.to(device).eval()
    model.requires_grad_(False)
    return model, tokenizer


def outputs_of(batch: RolloutBatch, prompts: Sequence[Sequence[int]], group_size: int) -> list[GenerationOutput]:
    """The rows of `batch` back as `GenerationOutput`s (padding cut), for the fleet to pack with other shards."""
    outs = []
    for row in range(len(batch)):
        k = int(batch.completion_mask[row].sum())
        versions = batch.versions[row, :k].tolist() if batch.versions is not None else None
        outs.append(GenerationOutput(
            request_id=f"fleet_{row}", prompt_ids=list(prompts[row // group_size]),
            generated_tokens=batch.completion_ids[row, :k].tolist(), logprobs=batch.logprobs[row, :k].tolist(),
            status=RequestStatus.FINISHED, finish_reason=batch.finish_reasons[row],
            policy_version=min(versions) if versions else batch.policy_version, versions=versions,
            top_logprobs=batch.top_logprobs[row, :k].tolist() if batch.top_logprobs is not None else None,
            top_ids=batch.top_ids[row, :k].tolist() if batch.top_ids is not None else None))
    return outs


class EngineWorker:
    """One engine of a fleet (run as a Ray actor).

    Args:
        source: a `save_pretrained` directory, or the policy module itself (from the object store).
        tokenizer: the tokenizer (default: the directory's); used for stop ids only, prompts arrive as ids.
        engine_config, generation_config: the `RolloutEngine`'s.
        store: the fleet's `WeightStore` actor (None: keep the initial weights).
        num_threads: torch threads of this engine (its CPU share).
        dtype: cast the policy ("bfloat16", ...; None: as loaded).
    """

    def __init__(self, source, tokenizer=None, engine_config: ContinuousBatchingConfig | None = None,
                 generation_config=None, store=None, num_threads: int | None = None, dtype: str | None = None) -> None:
        if num_threads is not None:
            torch.set_num_threads(num_threads)
        device = "cuda" if torch.cuda.is_available() else "cpu"
        model, own_tokenizer = load_policy(source, dtype, device)
        self.engine = RolloutEngine(model, tokenizer=tokenizer or own_tokenizer, config=engine_config,
                                    generation_config=generation_config)
        self.restored_version = 0
        if store is not None:
            import ray

            version, refs = ray.get(store.latest.remote())
            if refs:  # NOTE: a replacement (or a late joiner) starts on the fleet's current weights
                self.engine.update_weights(from_payload(ray.get(refs[0])))
                self.engine.manager.core.policy_version = version
                self.restored_version = version

    def ready(self) -> dict:
        """This actor's process id and the weight version it holds (the fleet waits on it, with a deadline)."""
        return {"pid": os.getpid(), "host": socket.gethostname(), "version": self.engine.policy_version, "restored": self.restored_version}

    def generate(self, prompts: list[list[int]], temps: list[float], group_size: int, seed: int | None,
                 first_group: int, kwargs: dict) -> list[GenerationOutput]:
        """The groups of `prompts` (group i is the call's group `first_group + i`, seeded as such)."""
        batch = self.engine.generate(prompts, temps=temps, group_size=group_size, seed=seed,
                                     prompt_index=first_group, **kwargs)
        return outputs_of(batch, prompts, group_size)

    def score(self, prompts: list[list[int]], completions: list[list[int]], kwargs: dict):
        return self.engine.score(prompts, completions, **kwargs)

    def update_weights(self, payload: dict, version: int, in_flight: str) -> int:
        """Copy the weights in (`payload`: `to_payload`'s, resolved by Ray from the one object-store copy) and take
        the fleet's `version`."""
        self.engine.update_weights(from_payload(payload), in_flight=in_flight)
        self.engine.manager.core.policy_version = version  # NOTE: the fleet's count, the same on every engine
        return self.engine.policy_version

    def sleep(self) -> int:
        return self.engine.sleep()

    def wake(self) -> int:
        return self.engine.wake()

    def exit(self, code: int = 1) -> None:
        """Die at once (tests of the fleet's recovery): Ray sees a crashed actor and restarts it."""
        os._exit(code)
