"""New weights for the served engine: from a `save_pretrained` directory, or pushed by a trainer process
over `torch.distributed` (gloo on CPU, NCCL on GPU).

The push uses a group of its own built from a `TCPStore` (trainer rank 0; one server: rank 1; several
servers fed by one broadcast, `rollout.weights.broadcast`: ranks 1..N), never torch's default process group, so
the server holds no global distributed state. A chunk arrives tensor by tensor, or `packed` as one flat
buffer of one dtype (`rollout.weights.transfer`). Tensors are staged and
only copied into the engine when the update finishes, all or nothing: a failed push leaves the old
weights serving.
"""

from __future__ import annotations

import torch

from rollout.serve.protocol import APIError
from rollout.weights.checkpoint import load_checkpoint as read_checkpoint
from rollout.weights.in_place import strip_prefixes
from rollout.weights.transfer import check_names_shapes, new_group, unflatten

DTYPES = {name: getattr(torch, name) for name in ("float32", "float16", "bfloat16", "float64", "int64", "int32",
                                                   "int8", "uint8", "bool")}


def load_checkpoint(path: str) -> dict[str, torch.Tensor]:
    """`rollout.weights.checkpoint.load_checkpoint` with its errors in the server's shape (404 / 400 naming
    `model_path`)."""
    try:
        return read_checkpoint(path)
    except FileNotFoundError as e:
        raise APIError(str(e), "model_path", 404, "NotFoundError") from None
    except ValueError as e:
        raise APIError(str(e), "model_path") from None


def check_update(targets: dict[str, torch.Tensor], names: list, dtypes: list, shapes: list) -> list:
    """Validate the metadata of one pushed chunk against the engine's tensors; returns [(name, dtype, shape)]."""
    if not (isinstance(names, list) and isinstance(dtypes, list) and isinstance(shapes, list)):
        raise APIError("update_info needs lists 'names', 'dtype_names' and 'shapes'", "update_info")
    if not len(names) == len(dtypes) == len(shapes):
        raise APIError("update_info: 'names', 'dtype_names' and 'shapes' differ in length", "update_info")
    out = []
    for name, dname, shape in zip(names, dtypes, shapes, strict=True):
        if not isinstance(shape, list):
            raise APIError(f"update_info: {name!r} has shape {shape!r}, expected a list", "update_info")
        try:
            check_names_shapes(targets, [strip_prefixes(str(name))], [shape])
        except ValueError as e:
            raise APIError(f"update_info: {e}", "update_info") from None
        dtype = DTYPES.get(str(dname).removeprefix("torch."))
        if dtype is None:
            raise APIError(f"update_info: unknown dtype {dname!r} for {name!r}", "update_info")
        out.append((str(name), dtype, tuple(shape)))
    return out


class WeightReceiver:
    """The server's end (rank `rank_offset`, normally 1) of a trainer's weight broadcast group.

    Args:
        master_address, master_port: the trainer's `TCPStore` (rank 0 hosts it).
        rank_offset: this server's rank; world_size: ranks in the group (2: one trainer, one server).
        timeout_s: how long joining, and each tensor, may wait for the trainer.
        backend: "gloo" (tensors through the CPU) or "nccl" (into `device`, a CUDA device).
        device: where received tensors land (the engine's device with NCCL).
    """

    def __init__(self, master_address: str, master_port: int, rank_offset: int = 1, world_size: int = 2,
                 timeout_s: float = 120.0, backend: str = "gloo", device: torch.device | str = "cpu") -> None:
        self.store, self.group = new_group(master_address, master_port, int(rank_offset), int(world_size),
                                           timeout_s, backend, is_master=False)
        self.device = torch.device(device) if backend == "nccl" else torch.device("cpu")
        self.staged: dict[str, torch.Tensor] | None = None

    def start(self) -> None:
        self.staged = {}

    def receive(self, items: list) -> None:
        """Receive one chunk, in order, from rank 0's broadcasts."""
        if self.staged is None:
            raise RuntimeError("call /start_weight_update first")
        for name, dtype, shape in items:
            t = torch.empty(shape, dtype=dtype, device=self.device)
            self.group.broadcast(t, 0).wait()
            self.staged[name] = t

    def receive_packed(self, items: list) -> None:
        """Receive one chunk sent as a single flat buffer (packed by `rollout.weights.broadcast.WeightBroadcaster`, one
        dtype)."""
        if self.staged is None:
            raise RuntimeError("call /start_weight_update first")
        shapes = [shape for _, _, shape in items]
        flat = torch.empty(sum(int(torch.Size(s).numel()) for s in shapes), dtype=items[0][1], device=self.device)
        self.group.broadcast(flat, 0).wait()
        for (name, _, _), view in zip(items, unflatten(flat, shapes), strict=True):
            self.staged[name] = view

    def take(self) -> dict[str, torch.Tensor]:
        staged, self.staged = self.staged, None
        if staged is None:
            raise RuntimeError("no weight update in progress: call /start_weight_update first")
        return staged

