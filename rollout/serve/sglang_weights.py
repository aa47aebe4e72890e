"""SGLang's weight routes beyond `/update_weights_from_disk` (which `rollout.serve.control` serves):

- `POST /init_weights_update_group {master_address, master_port, rank_offset, world_size, group_name,
  backend}`: join the trainer's group as SGLang does (`init_custom_process_group`: a `tcp://` rendezvous on
  the trainer's store, rank 0 its host; the group's keys under `group_name`), so a trainer written for SGLang
  (slime, AReaL, verl) feeds this server unchanged. gloo on CPU; "nccl" only with the engine on CUDA.
- `POST /update_weights_from_distributed {names, dtypes, shapes, group_name, abort_all_requests?,
  weight_version?}`: receive each tensor, in order, from rank 0's `broadcast`, then load them all at once
  (all or nothing); with a name or shape the engine lacks the tensors are still received (the trainer is not
  left hanging) and dropped, and the answer is a 400 naming it.
- `POST /destroy_weights_update_group {group_name}`.
- `POST /update_weights_from_tensor {serialized_named_tensors: [base64], load_format?, abort_all_requests?,
  weight_version?}`: SGLang's `MultiprocessingSerializer` payload (torch's `ForkingPickler` of
  `[(name, tensor)]`, shared memory handles: same machine only), read by an unpickler that builds nothing
  but tensors, storages and containers.

`abort_all_requests: true` cancels the requests in flight; otherwise they finish under the old weights first
(the engine's `in_flight="wait"`). A `weight_version` names the new version in `meta_info` and the info
routes.
"""

from __future__ import annotations

import asyncio
import base64
import datetime
import io
import pickle
import threading
from typing import Annotated

import torch
import torch.distributed as dist
from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, Field

from rollout.engine.openmp import team_released_after
from rollout.serve.bridge import EngineBridge
from rollout.serve.protocol import APIError
from rollout.serve.sglang_routes import label_version
from rollout.serve.weights import DTYPES
from rollout.weights.in_place import strip_prefixes

router = APIRouter()


class InitGroupRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    master_address: Annotated[str, Field(min_length=1)]
    master_port: int | str
    rank_offset: int = 1
    world_size: int = 2
    group_name: str = "weight_update_group"
    backend: str = "nccl"  # NOTE: SGLang's default; a CPU engine needs "gloo"
    timeout_s: float = 120.0


class DistributedUpdateRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]
    group_name: str = "weight_update_group"
    abort_all_requests: bool = False
    weight_version: str | None = None
    flush_cache: bool = True  # NOTE: stale prefix KV is always dropped by the engine's update
    load_format: str | None = None


class DestroyGroupRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    group_name: str = "weight_update_group"


class TensorUpdateRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    serialized_named_tensors: Annotated[list[str | bytes], Field(min_length=1)]
    load_format: str | None = None
    abort_all_requests: bool = False
    weight_version: str | None = None
    flush_cache: bool = True


class Group:
    """This server's end of one SGLang-style weight group (rank `rank`; the trainer is rank 0)."""

    def __init__(self, req: InitGroupRequest, device: torch.device) -> None:
        timeout = datetime.timedelta(seconds=req.timeout_s)
        self.store = dist.TCPStore(req.master_address, int(req.master_port), req.world_size, is_master=False,
                                   timeout=timeout)
        # NOTE: torch's keys for a group built as SGLang's `init_custom_process_group` builds it: the
        # rendezvous store under `group_name`, then `_new_process_group_helper`'s `{group_name}/` and the
        # device's prefix
        prefixed = dist.PrefixStore(f"{req.group_name}/", dist.PrefixStore(req.group_name, self.store))
        if req.backend == "nccl":
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = timeout
            self.group = dist.ProcessGroupNCCL(dist.PrefixStore("cuda/", prefixed), req.rank_offset,
                                               req.world_size, options)
            self.device = device
        else:
            self.group = dist.ProcessGroupGloo(dist.PrefixStore("cpu/", prefixed), req.rank_offset,
                                               req.world_size, timeout)
            self.device = torch.device("cpu")
        self.lock = threading.Lock()  # NOTE: one update at a time: broadcasts must pair in order

    def receive(self, items: list[tuple[str, torch.dtype, list[int]]]) -> dict[str, torch.Tensor]:
        out = {}
        with self.lock:
            for name, dtype, shape in items:
                t = torch.empty(shape, dtype=dtype, device=self.device)
                self.group.broadcast(t, 0).wait()
                out[name] = t
        return out


def _groups(request: Request) -> dict[str, Group]:
    state = request.app.state
    if not hasattr(state, "sglang_groups"):
        state.sglang_groups = {}
    return state.sglang_groups


@router.post("/init_weights_update_group")
async def init_weights_update_group(req: InitGroupRequest, request: Request) -> dict:
    bridge: EngineBridge = request.app.state.bridge
    if req.backend not in ("gloo", "nccl"):
        raise APIError(f"backend must be 'gloo' or 'nccl', got {req.backend!r}", "backend")
    if req.backend == "nccl" and bridge.engine.device.type != "cuda":
        raise APIError(f"backend 'nccl' needs the engine on a CUDA device; this one runs on "
                       f"{bridge.engine.device.type} (use 'gloo')", "backend")
    if not 1 <= req.rank_offset < req.world_size:
        raise APIError(f"rank_offset {req.rank_offset} outside [1, world_size {req.world_size})",
                       "rank_offset")
    if req.group_name in _groups(request):
        raise APIError(f"group {req.group_name!r} exists: /destroy_weights_update_group first", "group_name")
    try:
        group = await asyncio.to_thread(Group, req, bridge.engine.device)
    except Exception as e:
        raise APIError(f"could not join the trainer's group: {type(e).__name__}: {e}",
                       "master_address") from None
    _groups(request)[req.group_name] = group
    return {"success": True, "message": f"joined {req.group_name!r} as rank {req.rank_offset}"}


@router.post("/destroy_weights_update_group")
async def destroy_weights_update_group(req: DestroyGroupRequest, request: Request) -> dict:
    group = _groups(request).pop(req.group_name, None)
    if group is None:
        raise APIError(f"no weight update group {req.group_name!r}", "group_name")
    return {"success": True, "message": f"left {req.group_name!r}"}


@router.post("/update_weights_from_distributed")
async def update_weights_from_distributed(req: DistributedUpdateRequest, request: Request) -> dict:
    bridge: EngineBridge = request.app.state.bridge
    group = _groups(request).get(req.group_name)
    if group is None:
        raise APIError(f"no weight update group {req.group_name!r}: /init_weights_update_group first",
                       "group_name")
    if not len(req.names) == len(req.dtypes) == len(req.shapes):
        raise APIError("names, dtypes and shapes differ in length", "names")
    items = []
    for name, dname, shape in zip(req.names, req.dtypes, req.shapes, strict=True):
        dtype = DTYPES.get(str(dname).removeprefix("torch."))
        if dtype is None:
            raise APIError(f"unknown dtype {dname!r} for {name!r}", "dtypes")
        items.append((name, dtype, shape))
    problem = _mismatch(bridge.weight_targets(), [(n, s) for n, _, s in items])
    try:  # NOTE: received even when refused: rank 0 broadcasts regardless, and the group stays in step
        tensors = await asyncio.to_thread(_released(group.receive), items)
    except Exception as e:
        raise APIError(f"weight broadcast failed, old weights kept: {type(e).__name__}: {e}", None, 500,
                       "server_error") from None
    if problem is not None:
        raise APIError(f"{problem}; the tensors were received and dropped, the old weights keep serving",
                       "names")
    version = await _load(bridge, tensors, req.abort_all_requests, "names")
    label_version(request, version, req.weight_version)
    return {"success": True, "message": f"loaded {len(tensors)} tensors", "weight_version": version}


@router.post("/update_weights_from_tensor")
async def update_weights_from_tensor(req: TensorUpdateRequest, request: Request) -> dict:
    bridge: EngineBridge = request.app.state.bridge
    if req.load_format not in (None, "direct"):
        raise APIError(f"load_format {req.load_format!r} is not supported (send [(name, tensor)] with "
                       "load_format null or 'direct')", "load_format")
    # NOTE: one entry per tensor-parallel rank in SGLang, each the full tensors: rank 0's serves the engine
    pairs = await asyncio.to_thread(_released(deserialize), req.serialized_named_tensors[0])
    version = await _load(bridge, dict(pairs), req.abort_all_requests, "serialized_named_tensors")
    label_version(request, version, req.weight_version)
    return {"success": True, "message": f"loaded {len(pairs)} tensors", "weight_version": version}


def _mismatch(targets: dict[str, torch.Tensor], items: list[tuple[str, list[int]]]) -> str | None:
    for name, shape in items:
        target = targets.get(strip_prefixes(name))
        if target is None:
            return f"unknown parameter name {name!r}"
        if list(target.shape) != list(shape):
            return f"{name!r} has shape {list(shape)}, expected {list(target.shape)}"
    return None


async def _load(bridge: EngineBridge, tensors: dict, abort: bool, param: str) -> int:
    try:
        return await asyncio.to_thread(bridge.update_weights, tensors, "abort" if abort else "wait")
    except ValueError as e:  # NOTE: names or shapes that do not match; nothing was copied
        raise APIError(f"{param}: {e}", param) from None


def _released(fn):
    def run(*args):
        with team_released_after():
            return fn(*args)

    return run


# ------------------------------------------------------------------------ SGLang's tensor serialization
ALLOWED = {
    ("torch.multiprocessing.reductions", "rebuild_tensor"),
    ("torch.multiprocessing.reductions", "rebuild_storage_fd"),
    ("torch.multiprocessing.reductions", "rebuild_storage_filename"),
    ("torch.multiprocessing.reductions", "rebuild_storage_empty"),
    ("torch.multiprocessing.reductions", "rebuild_typed_storage"),
    ("torch.multiprocessing.reductions", "rebuild_cuda_tensor"),
    ("torch.multiprocessing.reductions", "rebuild_nested_tensor"),
    ("torch._utils", "_rebuild_tensor_v2"),
    ("torch.storage", "UntypedStorage"),
    ("torch.storage", "TypedStorage"),
    ("torch", "UntypedStorage"),
    ("torch", "Tensor"),
    ("torch.nn.parameter", "Parameter"),
    ("torch", "Size"),
    ("torch", "device"),
    ("multiprocessing.resource_sharer", "DupFd"),
    ("collections", "OrderedDict"),
    ("builtins", "tuple"),
    ("builtins", "list"),
}


class TensorUnpickler(pickle.Unpickler):
    """Builds tensors, their storages and plain containers; any other global is refused (a pickle from the
    network must not run code)."""

    def find_class(self, module: str, name: str):
        dtype = module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
        if (module, name) in ALLOWED or dtype:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not a tensor part")


def deserialize(data: str | bytes) -> list[tuple[str, torch.Tensor]]:
    """SGLang's `MultiprocessingSerializer.deserialize` of `[(name, tensor)]` (base64 text or bytes);
    APIError naming `serialized_named_tensors` for anything else."""
    param = "serialized_named_tensors"
    try:
        raw = base64.b64decode(data, validate=True) if isinstance(data, str) else data
        obj = TensorUnpickler(io.BytesIO(raw)).load()
    except Exception as e:
        raise APIError(f"{param}: not a serialized list of (name, tensor): {type(e).__name__}: {e}",
                       param) from None
    if isinstance(obj, dict):
        obj = list(obj.items())
    pair = lambda p: (isinstance(p, (list, tuple)) and len(p) == 2 and isinstance(p[0], str)  # noqa: E731
                      and isinstance(p[1], torch.Tensor))
    if not isinstance(obj, (list, tuple)) or not all(pair(p) for p in obj):
        raise APIError(f"{param}: expected a list of (name, tensor) pairs", param)
    return [(n, t) for n, t in obj]


def serialize(named_tensors: list[tuple[str, torch.Tensor]]) -> str:
    """The `update_weights_from_tensor` payload entry for `named_tensors` (SGLang's encoding), for callers in
    this process or its children (shared memory handles)."""
    from multiprocessing.reduction import ForkingPickler

    buf = io.BytesIO()
    ForkingPickler(buf).dump(list(named_tensors))
    return base64.b64encode(buf.getvalue()).decode("ascii")
