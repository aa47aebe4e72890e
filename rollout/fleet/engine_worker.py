"""`EngineWorker`: one `RolloutEngine` inside a Ray actor, the unit a `RolloutFleet` places and restarts.

The class is plain Python (Ray is imported only where an actor runs it): `RolloutFleet` wraps it with
`ray.remote(max_restarts=..., max_concurrency=...)`. A threaded actor, so an update with `in_flight="keep"`
lands while a `generate` runs (between two engine steps, as in process). At start (the first time or after
Ray restarted a dead actor) it loads the fleet's current weights and version from the `WeightStore` before it
serves anything, so a replacement never answers with stale weights. On the collective path it is a member of the
fleet's weight group (`rollout.fleet.weight_group`): `receive_weights` copies the broadcast buckets in as they
come; `export_weights` puts its own copy in the object store for a replacement (its weights came by broadcast).

Generation answers are `GenerationOutput`s (token ids, logprobs, per-token versions): the fleet packs the
groups of every engine into one `RolloutBatch`, in the call's order.
"""

from __future__ import annotations

import logging
import os
import socket
import warnings
from collections.abc import Mapping, Sequence

import torch

from rollout.api.batch import RolloutBatch
from rollout.api.engine import RolloutEngine
from rollout.config import ContinuousBatchingConfig
from rollout.requests import GenerationOutput, RequestStatus
from rollout.weights.in_place import strip_prefixes


class WeightStore:
    """The fleet's weight version, the latest object-store copy of its weights (one reference, shared by every
    engine) and that copy's version; after a broadcast update (no copy in the store), the engines holding it.

    `set([ref], version)` takes the reference inside a list, so Ray hands the reference, not the tensors."""

    def __init__(self) -> None:
        self.version = self.refs_version = 0
        self.refs: list = []
        self.holders: dict = {}  # engine index -> actor handle, of the engines on `version` (broadcast updates)

    def set(self, refs: list, version: int) -> int:
        self.refs, self.refs_version = list(refs), int(version)
        self.version = max(self.version, self.refs_version)
        return self.version

    def advance(self, version: int, holders: dict) -> int:
        """Version `version` reached `holders` by broadcast: a replacement copies it from one of them."""
        self.version, self.holders = int(version), dict(holders)
        return self.version

    def adopt(self, refs: list, version: int) -> list:
        """Keep a copy of the weights behind `[ref]` (an engine's `export_weights`) owned by this actor, so it
        outlives that engine; it becomes the store's copy of `version`. Returns [the new ref]."""
        import ray

        own = [ray.put(ray.get(refs[0]))]
        self.set(own, version)
        return own

    def latest(self) -> tuple[int, list]:
        """The object-store copy's (version, [ref])."""
        return self.refs_version, self.refs

    def current(self) -> tuple[int, dict]:
        return self.version, self.holders


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
            top_ids=batch.top_ids[row, :k].tolist() if batch.top_ids is not None else None,
            sampling_masks=batch.sampling_masks[row] if batch.sampling_masks is not None else None))
    return outs


def copy_from(ray, holders: dict, version: int):
    """An object-store copy of weights `version` from the first of `holders` (actors) that has it, or None."""
    for actor in holders.values():
        try:
            (ref,) = ray.get(actor.export_weights.remote(version), timeout=300)
            return ref
        except Exception as err:  # NOTE: dead too, or on another version: ask the next one
            logging.getLogger("rollout.fleet").warning("no copy of weights v%d from %s: %s", version, actor, err)
            continue
    return None


class EngineWorker:
    """One engine of a fleet (run as a Ray actor).

    Args:
        source: a `save_pretrained` directory, or the policy module itself (from the object store).
        tokenizer: the tokenizer (default: the directory's); used for stop ids only, prompts arrive as ids.
        engine_config, generation_config: the `RolloutEngine`'s.
        store: the fleet's `WeightStore` actor, or its name (None: keep the initial weights).
        num_threads: torch threads of this engine (its CPU share).
        dtype: cast the policy ("bfloat16", ...; None: as loaded).
        engine_index: this engine's index in the fleet (a replacement copies broadcast weights from another).
    """

    def __init__(self, source, tokenizer=None, engine_config: ContinuousBatchingConfig | None = None,
                 generation_config=None, store=None, num_threads: int | None = None, dtype: str | None = None,
                 engine_index: int | None = None) -> None:
        if num_threads is not None:
            torch.set_num_threads(num_threads)
        device = "cuda" if torch.cuda.is_available() else "cpu"
        model, own_tokenizer = load_policy(source, dtype, device)
        self.engine = RolloutEngine(model, tokenizer=tokenizer or own_tokenizer, config=engine_config,
                                    generation_config=generation_config)
        self.restored_version = 0
        self.member = None  # the weight group's end (rollout.fleet.weight_group.GroupMember), when joined
        if store is not None:
            import ray

            store = ray.get_actor(store) if isinstance(store, str) else store  # NOTE: RolloutFleet names its store
            version, refs = ray.get(store.latest.remote())
            current, holders = ray.get(store.current.remote())
            if current != version:  # NOTE: the latest update came by broadcast: copy it from an engine holding it
                ref = copy_from(ray, {j: a for j, a in holders.items() if j != engine_index}, current)
                if ref is not None:
                    version, refs = current, ray.get(store.adopt.remote([ref], current))
            if refs:  # NOTE: a replacement (or a late joiner) starts on the fleet's current weights
                self.engine.update_weights(from_payload(ray.get(refs[0])), version=version)
                self.restored_version = version

    def ready(self) -> dict:
        """This actor's process id and the weight version it holds (the fleet waits on it, with a deadline)."""
        return {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "version": self.engine.policy_version,
            "restored": self.restored_version,
        }

    def generate(self, prompts: list[list[int]], sampling: list, group_size: int,
                 first_group: int) -> list[GenerationOutput]:
        """The groups of `prompts` (group i is the call's group `first_group + i`, seeded as such), one
        `SamplingParams` each."""
        batch = self.engine.generate(prompts, sampling=sampling, group_size=group_size, prompt_index=first_group)
        return outputs_of(batch, prompts, group_size)

    def score(self, prompts: list[list[int]], completions: list[list[int]], kwargs: dict):
        return self.engine.score(prompts, completions, **kwargs)

    def update_weights(self, payload: dict, version: int, in_flight: str) -> int:
        """Copy the weights in (`payload`: `to_payload`'s, resolved by Ray from the one object-store copy) and take
        the fleet's `version`."""
        # NOTE: the fleet's count, the same on every engine
        return self.engine.update_weights(from_payload(payload), in_flight=in_flight, version=version)

    def join_weight_group(self, info: dict) -> int:
        """Join the fleet's (new) weight group as rank `info["rank"]`, leaving an older one; returns this pid."""
        from rollout.fleet.weight_group import GroupMember

        if self.member is not None:
            self.member.close()
            self.member = None
        self.member = GroupMember(info, next(self.engine.model.parameters()).device)
        return os.getpid()

    def receive_weights(self, token: str, plan: list, version: int, in_flight: str) -> int:
        """Receive the buckets of `plan` from rank 0 of weight group `token` into the engine (as `update_weights`,
        under `in_flight`), and take the fleet's `version`."""
        if self.member is None:
            raise RuntimeError("this engine is in no weight group (a replacement): the group is stale")
        targets = {strip_prefixes(n): t for n, t in self.engine.model.state_dict(keep_vars=True).items()}
        self.member.check(token, plan, targets)
        return self.engine.update_weights(self.member.receive(plan, version), in_flight=in_flight, version=version)

    def export_weights(self, version: int) -> list:
        """This engine's weights put in the object store ([ref], so Ray hands the reference), when it holds
        `version`: a replacement's copy when the latest update came by broadcast."""
        import ray

        if self.engine.policy_version != version:
            raise RuntimeError(f"this engine holds v{self.engine.policy_version}, not v{version}")
        state = {
            strip_prefixes(n): t.detach().to("cpu").contiguous() for n, t in self.engine.model.state_dict().items()
        }
        return [ray.put(to_payload(state))]  # NOTE: `WeightStore.adopt` makes it outlive this engine

    def sleep(self) -> int:
        return self.engine.sleep()

    def wake(self) -> int:
        return self.engine.wake()

    def exit(self, code: int = 1) -> None:
        """Die at once (tests of the fleet's recovery): Ray sees a crashed actor and restarts it."""
        os._exit(code)
