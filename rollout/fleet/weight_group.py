"""The fleet's collective weight path: one torch.distributed group, the learner rank 0, engine actor i rank i + 1.

    group = LearnerGroup(backend="gloo", bucket_bytes=64 << 20, timeout_s=120)
    group.form(ray, [(0, actor0), (1, actor1)])          # each actor joins (`EngineWorker.join_weight_group`)
    refs = group.update(ray, state, version, in_flight)  # every member receives, rank 0 broadcasts bucket by bucket
    group.close()

The group is built from a `TCPStore` on the learner's node address (127.0.0.1 on a local cluster) with a free
port (`rollout.weights.transfer.new_group`: gloo on CPU, NCCL with CUDA tensors; torch's default group is never
touched). An update sends the plan (per bucket: dtype, names, shapes; tensors of one dtype flattened into at most
`bucket_bytes`, `rollout.weights.transfer.buckets`) with each member's remote call; the member checks the names
and shapes against its engine, enters its engine's update (between two steps, after its running requests when
`in_flight="wait"`), says so through the store, and only then does rank 0 broadcast: a member that refused the
plan, died or was replaced (a new process, not in the group) is seen before any byte is sent. Each member copies
every bucket into its weights as it arrives (one reused buffer per dtype, never the whole model twice).
The learner too holds at most one bucket (per dtype) beside the model. NCCL: written, only gloo is tested here.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator, Mapping

import torch

from rollout.weights.in_place import strip_prefixes
from rollout.weights.transfer import (
    buckets,
    check_names_shapes,
    free_port,
    named_tensors,
    new_group,
    pack_bucket,
    unflatten,
)

logger = logging.getLogger("rollout.fleet")

TRANSFERS = ("auto", "collective", "object_store")
DEFAULT_BUCKET_BYTES = 128 * 2**20


def resolve_transfer(mode: str, bundle: Mapping[str, float]) -> tuple[str, str | None]:
    """(path, backend) for `weight_transfer=mode`: "auto" is the collective path, NCCL when the engines have GPUs
    and the learner CUDA, else gloo (measured 2.7x faster than the object store on CPU, docs/fleets.md); the
    fleet falls back to the object store when an "auto" group cannot be formed."""
    if mode not in TRANSFERS:
        raise ValueError(f"weight_transfer must be one of {TRANSFERS}, got {mode!r}")
    if mode == "object_store":
        return "object_store", None
    gpus = bundle.get("GPU", 0) > 0 and torch.cuda.is_available()
    return "collective", "nccl" if gpus else "gloo"


def bucket_plan(state: Mapping[str, torch.Tensor], bucket_bytes: int) -> tuple[list[tuple], list[list[torch.Tensor]]]:
    """The plan every member receives ([(dtype name, names, shapes)] per bucket) and the buckets' tensors."""
    plan, tensors = [], []
    for bucket in buckets(state.items(), bucket_bytes):
        plan.append((str(bucket[0][1].dtype).removeprefix("torch."), [n for n, _ in bucket],
                     [tuple(t.shape) for _, t in bucket]))
        tensors.append([t for _, t in bucket])
    return plan, tensors


def learner_state(source) -> dict[str, torch.Tensor]:
    """`source`'s tensors (a module, wrapper prefixes cut; a state dict; (name, tensor) pairs), detached, where
    they are (the broadcast packs them onto the group's device a bucket at a time)."""
    return {strip_prefixes(n): t.detach() for n, t in named_tensors(source)}


def state_dict_of(source) -> dict[str, torch.Tensor]:
    """CPU tensors of `source` (an nn.Module, wrapper prefixes cut; a state dict; or (name, tensor) pairs), ready
    for the object store."""
    out = {}
    for name, value in named_tensors(source):
        if not isinstance(value, torch.Tensor):
            raise ValueError(f"weight {name!r} is a {type(value).__name__}, not a tensor")
        out[strip_prefixes(name)] = value.detach().to("cpu").contiguous()
    return out


class NotReady(TimeoutError):
    """Members (their indices in the update's list) that did not enter their engine's update in time: hung."""

    def __init__(self, late: list[int], message: str) -> None:
        super().__init__(message)
        self.late = late


class LearnerGroup:
    """Rank 0 of the fleet's weight group (see the module docstring).

    Args:
        backend: "gloo" (CPU tensors) or "nccl" (CUDA tensors, every engine on a GPU other than the learner's).
        bucket_bytes: the largest flat buffer one broadcast sends (a larger tensor goes alone).
        timeout_s: the group's own timeout: joining it, and each broadcast.
        ready_timeout_s: how long rank 0 waits for every member to enter its engine's update (its running
            requests finishing first under "wait").
    """

    def __init__(self, backend: str = "gloo", bucket_bytes: int = DEFAULT_BUCKET_BYTES, timeout_s: float = 120.0,
                 ready_timeout_s: float = 600.0) -> None:
        if bucket_bytes < 1:
            raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
        self.backend, self.bucket_bytes, self.timeout_s, self.ready_timeout_s = (backend, bucket_bytes, timeout_s,
                                                                                  ready_timeout_s)
        self.device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
        self.group = self.store = None
        self.members: list[tuple[int, int]] = []  # (engine index, pid) per rank 1..N
        self.token = ""  # the current group's name: a member of an older group refuses it
        self.formed = 0  # groups formed so far
        self.restarts = 0  # the fleet's engine restarts when the group was formed
        self.buffers: dict[torch.dtype, torch.Tensor] = {}

    @property
    def ready(self) -> bool:
        return self.group is not None

    def form(self, ray, members: list[tuple[int, object]], address: str) -> None:
        """A new group over `members` ((engine index, actor) each, rank i + 1), leaving any earlier one."""
        self.close()
        port = free_port(address)
        token = f"{address}:{port}"
        world = len(members) + 1
        info = {"address": address, "port": port, "world_size": world, "timeout_s": self.timeout_s,
                "backend": self.backend, "token": token}
        joins = [actor.join_weight_group.remote({**info, "rank": i + 1}) for i, (_, actor) in enumerate(members)]
        store, group = new_group(address, port, 0, world, self.timeout_s, self.backend, is_master=True)
        pids = ray.get(joins, timeout=self.timeout_s)
        self.store, self.group, self.token = store, group, token
        self.members = [(k, pid) for (k, _), pid in zip(members, pids, strict=True)]
        self.formed += 1
        logger.info("weight group formed: learner rank 0, %d engine(s) (%s, %s)", len(members), self.backend, token)

    def update(self, ray, actors: list, state: Mapping[str, torch.Tensor], version: int, in_flight: str) -> list:
        """Broadcast `state` to every member (`actors`, in rank order); returns their calls' refs (each answers the
        new version). Raises (the group is then closed) when a member fails before or during the broadcast."""
        plan, tensors = bucket_plan(state, self.bucket_bytes)
        refs = [a.receive_weights.remote(self.token, plan, version, in_flight) for a in actors]
        try:
            keys = [f"enter/{version}/{rank}" for rank in range(1, len(actors) + 1)]
            deadline = time.monotonic() + self.ready_timeout_s
            while not self.store.check(keys):  # NOTE: a member failed, or is still draining its requests
                done, _ = ray.wait(refs, num_returns=1, timeout=0.01)
                if done:
                    ray.get(done[0])  # raises the member's error
                    raise RuntimeError("an engine answered a weight update before it was sent")
                if time.monotonic() > deadline:
                    late = [i for i, key in enumerate(keys) if not self.store.check([key])]
                    raise NotReady(late, f"engine(s) not ready for the update within {self.ready_timeout_s:.0f} s")
            for bucket in tensors:
                self.group.broadcast(self.flat(bucket), 0).wait()
            if self.device.type == "cuda":  # NOTE: NCCL's wait orders streams only: sent before the trainer steps
                torch.cuda.synchronize(self.device)
        except BaseException:
            self.close()  # NOTE: the members' receives fail at once (their peer's sockets close) and unwind
            raise
        return refs

    def flat(self, tensors: list[torch.Tensor]) -> torch.Tensor:
        """The bucket as one flat tensor on the group's device (`rollout.weights.transfer.pack_bucket`)."""
        return pack_bucket(tensors, self.buffers, self.device)

    def close(self) -> None:
        """Leave the group (its members leave theirs when they join the next one, or with their process)."""
        group, self.group, self.store, self.members, self.token = self.group, None, None, [], ""
        self.buffers.clear()
        if group is not None and self.backend == "nccl":
            group.abort()  # NOTE: NCCL communicators are not freed by the garbage collector alone


class GroupMember:
    """An engine actor's end of the weight group (rank `info["rank"]`), receiving into `device`."""

    def __init__(self, info: Mapping, device: torch.device) -> None:
        self.token, self.rank = str(info["token"]), int(info["rank"])
        self.store, self.group = new_group(info["address"], int(info["port"]), self.rank, int(info["world_size"]),
                                           float(info["timeout_s"]), info["backend"], is_master=False)
        self.device = device if info["backend"] == "nccl" else torch.device("cpu")
        self.buffers: dict[torch.dtype, torch.Tensor] = {}

    def check(self, token: str, plan: list, targets: Mapping[str, torch.Tensor]) -> None:
        """Refuse an update of another group, or a plan whose names or shapes this engine lacks."""
        if token != self.token:
            raise RuntimeError(f"weight group {token!r} is not this engine's ({self.token!r}): the group is stale")
        check_names_shapes(targets, [n for _, names, _ in plan for n in names],
                           [s for _, _, shapes in plan for s in shapes])

    def receive(self, plan: list, version: int) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, tensor) pairs of the plan's buckets as they arrive, each a view of a reused buffer: the caller
        copies each before asking for the next (`copy_weights` does). Tells rank 0 it is ready first."""
        self.store.set(f"enter/{version}/{self.rank}", "1")
        for dtype_name, names, shapes in plan:
            dtype = getattr(torch, dtype_name)
            n = sum(int(torch.Size(s).numel()) for s in shapes)
            buf = self.buffers.get(dtype)
            if buf is None or buf.numel() < n:
                buf = self.buffers[dtype] = torch.empty(n, dtype=dtype, device=self.device)
            flat = buf[:n]
            self.group.broadcast(flat, 0).wait()
            yield from zip(names, unflatten(flat, shapes), strict=True)
        if self.device.type == "cuda":  # NOTE: every bucket in before the engine reports the new version
            torch.cuda.synchronize(self.device)

    def close(self) -> None:
        group, self.group, self.store = self.group, None, None
        self.buffers.clear()
        if group is not None and hasattr(group, "abort") and self.device.type == "cuda":
            group.abort()


def collective_update(fleet, source, version: int, in_flight: str) -> str:
    """`fleet`'s update over its weight group (formed again first when its members changed): "collective", or
    "object_store" when an engine is recovering or a member failed (one warning line; the group is rebuilt
    at the next update)."""
    ray, health, group = fleet.ray, fleet.health, fleet.weight_group
    health.poll()
    with health.lock:
        targets = [k for k in health.alive() if k not in health.recovering]
        recovering = sorted(health.recovering)
    if recovering:
        group.close()
        logger.warning("weights v%d through the object store: engine(s) %s recovering (the weight group is "
                       "rebuilt at the next update)", version, recovering)
        return "object_store"
    try:
        if not group.ready or [k for k, _ in group.members] != targets or group.restarts != health.restarts:
            group.form(ray, [(k, fleet.actors[k]) for k in targets], fleet.group_address)
            group.restarts = health.restarts  # NOTE: an engine restarted since is a new process: form again
        refs = group.update(ray, [fleet.actors[k] for k in targets], learner_state(source), version, in_flight)
        got = ray.get(refs, timeout=fleet.request_timeout_s)
    except Exception as err:
        group.close()
        for i in getattr(err, "late", []):  # NOTE: hung engines: killed (Ray restarts them), as a late shard's
            health.failed(targets[i], f"not ready for weight update v{version}", 0, "group", kill=True)
        logger.warning(
            "weights v%d through the object store: the weight group failed (%s: %s); it is rebuilt at the next update",
            version,
            type(err).__name__,
            (str(err).splitlines() or [""])[0][:200],
        )
        return "object_store"
    if any(g != version for g in got):
        raise RuntimeError(f"engines report versions {got} after update {version}")
    # NOTE: no copy in the object store: a replacement copies a survivor's (EngineWorker at start, EngineHealth.copy_of)
    ray.get(fleet.store.advance.remote(version, {k: fleet.actors[k] for k in targets}), timeout=fleet.start_timeout_s)
    health.current = (None, version)
    return "collective"
