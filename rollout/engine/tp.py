"""Tensor parallelism: one engine per rank on a model sharded with `DistributedConfig(tp_size=N)`.

Every rank of a tensor-parallel group runs the same step on its own shards (its attention heads, its KV
heads: the paged cache is sized per shard), so every rank must make the same decisions. Rank 0 of the
group leads; `TensorParallelGroup` ties the others to it over a CPU (gloo) group whose collectives are
bounded by `ContinuousBatchingConfig.cpu_group_timeout`:

- at construction the ranks agree on the engine config (ValueError naming the fields that differ) and
  on the memory plan (the smallest page count, step budget and CPU offload pages of all ranks);
- every round (`exchange`) rank 0 sends the commands it took from its inbox (submissions, cancellations,
  pauses), its stop mode and whether it steps; the other ranks apply those instead of their own inbox, so
  submissions and cancellations made on rank 0 reach every rank, and each rank's scheduler (deterministic
  given the same inputs) makes the same schedule;
- every step (`agree_sampled`) rank 0's sampled tokens and logprobs replace the others', so unseeded
  sampling is one stream for all ranks; the ranks also check they scheduled the same rows;
- rank 0 sends an empty message when idle (every quarter of the timeout), so a follower waiting for the
  next round only times out when rank 0 really stopped answering;
- a follower applies a round only once its own `update_weights` / `reset_prefix_cache` calls caught up
  with rank 0's (policy version and flush count travel with each message), so the shards of one forward
  always hold the same weights and every rank drops its prefix cache at the same point (a pure follower,
  `rollout serve`'s other ranks, replays rank 0's flushes instead: `replay_flushes`).

A collective that times out raises `TensorParallelTimeout` naming the group, the timeout and what was
being exchanged; the group is then broken and every later exchange raises at once.

Results are delivered on every rank: a follower's outbox receives rank 0's requests (same ids; automatic
ids are deterministic, so ranks running the same code get the same ids). A follower's own submissions only
say which of those results it waits for (its inbox drops its own commands).
Every rank must build its engine (collective) and start it, and make the same `update_weights` /
`reset_prefix_cache` / `sleep` calls; the model's own all-reduces run on transformers' process group, whose
timeout (not `cpu_group_timeout`) bounds a rank that dies inside a forward.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import time
import weakref
from datetime import timedelta

import torch
import torch.distributed as dist

from rollout.config import ContinuousBatchingConfig
from rollout.model.model_facts import text_config

# NOTE: gloo needs a finite timeout; "None" (no bound) is a year.
NO_TIMEOUT_S = 365 * 24 * 3600.0


def _destroy_group(group) -> None:
    with contextlib.suppress(Exception):  # NOTE: at exit the default group may be gone already
        if dist.is_initialized():
            dist.destroy_process_group(group)


class TensorParallelTimeout(RuntimeError):
    """A rank of the tensor-parallel CPU group did not answer within `cpu_group_timeout`."""


def tp_size_of(model: torch.nn.Module) -> int:
    """The tensor-parallel size a model was loaded with (`DistributedConfig(tp_size=N)`), 1 if none."""
    return int(getattr(model, "_tp_size", None) or getattr(model, "tp_size", None) or 1)


def check_tp_model(model: torch.nn.Module, tp_size: int) -> None:
    """ValueError naming the setting when a sharded model cannot run in the paged engine."""
    if getattr(model, "hf_device_map", None) is not None:
        raise ValueError("device_map and distributed_config are mutually exclusive: tensor parallelism shards every "
                         "module across the ranks while device_map places whole modules on devices; load with one")
    if not dist.is_available() or not dist.is_initialized():
        raise ValueError(f"the model was loaded with tp_size={tp_size} but torch.distributed is not initialised "
                         "(launch with torchrun --nproc-per-node N)")
    tc = text_config(model)
    heads = tc.num_attention_heads
    kv_heads = getattr(tc, "num_key_value_heads", None) or heads
    for name, value in (("num_key_value_heads", kv_heads), ("num_attention_heads", heads)):
        if value % tp_size:
            raise ValueError(f"tp_size={tp_size} must divide the model's {name} ({value}): each rank's paged KV "
                             f"cache holds {name}/tp_size heads; pick --nproc-per-node among the divisors of {value}")


def tp_ranks(model: torch.nn.Module) -> list[int]:
    """The global ranks of this rank's tensor-parallel group (the model's device mesh)."""
    mesh = getattr(model, "_device_mesh", None) or getattr(model, "device_mesh", None)
    if mesh is None:
        return list(range(dist.get_world_size()))
    names = getattr(mesh, "mesh_dim_names", None) or ()
    sub = mesh["tp"] if "tp" in names and len(names) > 1 else mesh
    return sorted(dist.get_process_group_ranks(sub.get_group()))


def config_fields(config: ContinuousBatchingConfig) -> dict:
    return {f.name: repr(getattr(config, f.name)) for f in dataclasses.fields(config)}


@dataclasses.dataclass(slots=True)
class Round:
    """What rank 0 sends each round: its commands (("add", Request), ("cancel", id), ...), its stop mode,
    whether it steps, and the weight state the step needs (policy version, prefix-cache flushes)."""

    commands: list
    stop_mode: str | None
    stepping: bool
    version: int
    flushes: int
    loads: dict = dataclasses.field(default_factory=dict)  # NOTE: version -> checkpoint of the updates since


class TensorParallelGroup:
    """The ranks of one tensor-parallel group, tied to rank 0 over a CPU gloo group (module docstring).

    Construction is collective over the default process group (every rank builds its engine).

    Args:
        model: the sharded model (`DistributedConfig(tp_size=N)`).
        config: this rank's engine config (every rank must pass an equal one).
    """

    def __init__(self, model: torch.nn.Module, config: ContinuousBatchingConfig) -> None:
        self.size = tp_size_of(model)
        check_tp_model(model, self.size)
        self.timeout_s = config.cpu_group_timeout
        timeout = timedelta(seconds=self.timeout_s or NO_TIMEOUT_S)
        # NOTE: new_group is collective over the whole world, so every rank creates every TP group, in order.
        mine = tp_ranks(model)
        layouts: list = [None] * dist.get_world_size()
        dist.all_gather_object(layouts, mine)
        self.group = None
        for ranks in sorted({tuple(r) for r in layouts}):
            group = dist.new_group(list(ranks), backend="gloo", timeout=timeout)
            if list(ranks) == mine:
                self.group = group
        # NOTE: each gloo group holds sockets and threads: freed with this object (its engine core)
        weakref.finalize(self, _destroy_group, self.group)
        self.rank = dist.get_rank(self.group)
        self.leader = self.rank == 0
        self.lock = threading.RLock()  # NOTE: one round at a time, in message order (see `exchange`)
        self.broken: str | None = None
        self.flushes = 0  # reset_prefix_cache calls of this rank's core (rollout.engine.core)
        # NOTE: a pure follower (`rollout serve`'s other ranks: no code of their own calls the engine) replays
        # rank 0's prefix flushes instead of waiting for its own
        self.replay_flushes = False
        # NOTE: rank 0 of `rollout serve`: the checkpoint each weight version was loaded from (`record_load`); a
        # pure follower given `replay_loads` (path -> state dict) loads the same checkpoint into its own shards
        self.loads: dict[int, str] = {}
        self.replay_loads = None
        self.heartbeat_s = (self.timeout_s or 120.0) / 4
        self._last_sent = time.monotonic()
        self._weights_state = (0, 0)  # (policy version, flushes) of rank 0's previous round
        self._agree_config(config)

    # ------------------------------------------------------------ collectives
    def gather(self, obj, what: str) -> list:
        """`all_gather_object` over the group, bounded by the timeout (TensorParallelTimeout names `what`)."""
        if self.broken is not None:
            raise TensorParallelTimeout(self.broken)
        out: list = [None] * self.size
        try:
            dist.all_gather_object(out, obj, group=self.group)
        except Exception as e:  # NOTE: gloo raises RuntimeError / DistBackendError on a timeout or a dead peer
            self.broken = (f"tensor parallelism: rank {self.rank} of {self.size} waited past cpu_group_timeout="
                           f"{self.timeout_s} s for the other ranks while {what} (a rank is stuck or gone): "
                           f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
            raise TensorParallelTimeout(self.broken) from e
        return out

    def _agree_config(self, config: ContinuousBatchingConfig) -> None:
        fields = self.gather(config_fields(config), "comparing engine configs")
        differ = sorted(k for k in fields[0] if any(f.get(k) != fields[0][k] for f in fields))
        if differ:
            raise ValueError(f"tensor-parallel ranks disagree on the engine config: {', '.join(differ)} "
                             f"({', '.join(f'{k}={[f[k] for f in fields]}' for k in differ)}); pass the same "
                             "ContinuousBatchingConfig on every rank")

    def agree_min(self, *sizes: int) -> tuple[int, ...]:
        """The smallest of each size over all ranks (pages, step budget, offload pages: each rank sized its
        own from its free memory, and the schedules depend on them)."""
        plans = self.gather(sizes, "agreeing on the KV cache size")
        return tuple(min(p[i] for p in plans) for i in range(len(sizes)))

    # ------------------------------------------------------------------ rounds
    def wants_round(self) -> bool:
        """For the manager's background thread: a follower always waits for rank 0's next round; rank 0
        runs one when a heartbeat is due."""
        return not self.leader or time.monotonic() - self._last_sent >= self.heartbeat_s

    def idle_wait_s(self) -> float:
        """How long the idle background thread may sleep: until rank 0's next heartbeat (a follower only
        idles while a caller drives, and is woken when it stops)."""
        return max(0.01, self.heartbeat_s - (time.monotonic() - self._last_sent)) if self.leader else 30.0

    def exchange(self, commands: list, stop_mode: str | None, stepping: bool, core, outbox) -> tuple:
        """Rank 0: send this round (or nothing, when it has nothing to do and no heartbeat is due). Others:
        wait for rank 0's round and return it in place of their own; its new requests become live in
        `outbox`. Call holding `self.lock`, not the step lock (a follower waits here for its own
        `update_weights`). Returns `(commands, stop_mode, stepping)`."""
        if self.leader:
            if not commands and not stepping and stop_mode is None and not self.wants_round():
                return commands, stop_mode, stepping
            loads = {v: p for v, p in self.loads.items() if v > self._weights_state[0]}
            message = Round(commands, stop_mode, stepping, core.policy_version, self.flushes, loads)
            self.gather(message, "sending the round's requests")
            self._last_sent = time.monotonic()
            if self._weights_moved(message):  # NOTE: step only once every rank's weights caught up
                errors = [e for e in self.gather(None, "waiting for the other ranks' update_weights") if e]
                if errors:
                    self.broken = errors[0]
                    raise TensorParallelTimeout(self.broken)
            return commands, stop_mode, stepping
        message = self.gather(None, "waiting for rank 0's next round")[0]
        if self._weights_moved(message):
            error = self._catch_up(message, core)
            self.gather(error, "telling rank 0 this rank's weights caught up")
            if error is not None:
                self.broken = error
                raise TensorParallelTimeout(error)
        with outbox.cv:  # NOTE: this rank's own submission of the same id may come before or after
            outbox.expect([arg for kind, arg in message.commands if kind == "add"])
        return message.commands, message.stop_mode, message.stepping

    def _weights_moved(self, message: Round) -> bool:
        """Whether rank 0's policy version or flush count changed since its previous round."""
        state = (message.version, message.flushes)
        moved, self._weights_state = state != self._weights_state, state
        return moved

    def record_load(self, version: int, path: str) -> None:
        """Rank 0: weight `version` is (about to be) the checkpoint at `path`; the followers replaying loads load it
        too before the first round at that version."""
        with self.lock:
            self.loads = {v: p for v, p in self.loads.items() if v >= self._weights_state[0]}
            self.loads[version] = path

    def forget_load(self, version: int) -> None:
        """Rank 0: the update recorded for `version` did not happen (it was refused before any copy)."""
        with self.lock:
            self.loads.pop(version, None)

    def _replay_load(self, core, path: str) -> None:
        """A follower: what rank 0's update from `path` did (rollout.api.engine `_swap_weights`), on its shards."""
        from rollout.weights.in_place import copy_weights

        try:
            copy_weights(core.view, self.replay_loads(path))
        finally:
            core.reset_prefix_cache()  # NOTE: counts itself in self.flushes, as rank 0's did
        core.policy_version += 1

    def _catch_up(self, message: Round, core) -> str | None:
        """Wait until this rank's weights and prefix flushes are where rank 0's were; the error, if they do not
        within 0.8 x the timeout (so that rank 0, waiting for the answer, hears it before its own timeout)."""
        while self.replay_loads is not None and core.policy_version + 1 in message.loads:
            try:
                self._replay_load(core, message.loads[core.policy_version + 1])
            except Exception as e:  # NOTE: rank 0 loaded it; a follower that cannot is out of step: say so
                return (f"tensor parallelism: rank {self.rank} could not load weight version {core.policy_version + 1} "
                        f"from {message.loads[core.policy_version + 1]}: {type(e).__name__}: {e}")
        while self.replay_flushes and self.flushes < message.flushes:
            core.reset_prefix_cache()  # NOTE: counts itself in self.flushes
        deadline = time.monotonic() + 0.8 * (self.timeout_s or NO_TIMEOUT_S)
        while core.policy_version < message.version or self.flushes < message.flushes:
            if time.monotonic() > deadline:
                return (f"tensor parallelism: rank {self.rank} is at policy version {core.policy_version} "
                        f"({self.flushes} prefix flushes) but rank 0 is at {message.version} ({message.flushes}) "
                        f"and rank {self.rank} did not catch up within 0.8 x cpu_group_timeout={self.timeout_s} s: "
                        "call update_weights / reset_prefix_cache / sleep on every rank")
            time.sleep(0.002)
        return None

    def agree_sampled(self, result, request_ids: list[str]):
        """Rank 0's sampled tokens (and logprobs) for every rank; RuntimeError if the ranks scheduled
        different rows (their schedules diverged)."""
        gathered = self.gather((request_ids, result if self.leader else None), "sharing the sampled tokens")
        if any(ids != gathered[0][0] for ids, _ in gathered):
            self.broken = ("tensor parallelism: the ranks' schedules diverged (rank 0 sampled "
                           f"{gathered[0][0][:4]}..., rank {self.rank} {request_ids[:4]}...)")
            raise RuntimeError(self.broken)
        return gathered[0][1]


class AgreedSampler:
    """A sampler whose output is rank 0's on every rank (wraps `rollout.sampling.sampler.Sampler`)."""

    def __init__(self, sampler, group: TensorParallelGroup) -> None:
        self.inner = sampler
        self.group = group

    def __call__(self, logits, params, request_ids, logprobs_mode, requests=None, top_mode=None):
        result = self.inner(logits, params, request_ids, logprobs_mode, requests=requests, top_mode=top_mode)
        return self.group.agree_sampled(result, list(request_ids))

    def __getattr__(self, name: str):
        if name == "inner":  # NOTE: not set yet (a copy): no recursion
            raise AttributeError(name)
        return getattr(self.inner, name)
