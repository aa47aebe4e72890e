"""New weights for the served engine: from a `save_pretrained` directory, or pushed by a trainer process
over `torch.distributed` (gloo on CPU, NCCL on GPU).

The push uses a two-rank group of its own (trainer rank 0, server rank 1) built from a `TCPStore`, never
torch's default process group, so the server holds no global distributed state. Tensors are staged and
only copied into the engine when the update finishes, all or nothing: a failed push leaves the old
weights serving.
"""

from __future__ import annotations

import datetime
from pathlib import Path

import torch
import torch.distributed as dist

from ..weights import strip_prefixes
from .protocol import APIError

DTYPES = {name: getattr(torch, name) for name in ("float32", "float16", "bfloat16", "float64", "int64", "int32",
                                                   "int8", "uint8", "bool")}


def load_checkpoint(path: str) -> dict[str, torch.Tensor]:
    """The tensors of a `save_pretrained` directory (safetensors shards, or pytorch_model*.bin)."""
    root = Path(path)
    if not root.is_dir():
        raise APIError(f"model_path {path!r} is not a directory", "model_path", 404, "NotFoundError")
    shards = sorted(root.glob("*.safetensors"))
    tensors: dict[str, torch.Tensor] = {}
    try:
        if shards:
            from safetensors.torch import load_file

            for shard in shards:
                tensors.update(load_file(str(shard)))
        else:
            bins = sorted(root.glob("pytorch_model*.bin"))
            if not bins:
                raise APIError(f"model_path {path!r} holds no *.safetensors or pytorch_model*.bin", "model_path",
                               404, "NotFoundError")
            for shard in bins:
                tensors.update(torch.load(shard, map_location="cpu", weights_only=True))
    except APIError:
        raise
    except Exception as e:
        raise APIError(f"model_path {path!r}: cannot read the checkpoint: {type(e).__name__}: {e}",
                       "model_path") from None
    return tensors


def check_update(targets: dict[str, torch.Tensor], names: list, dtypes: list, shapes: list) -> list:
    """Validate the metadata of one pushed chunk against the engine's tensors; returns [(name, dtype, shape)]."""
    if not (isinstance(names, list) and isinstance(dtypes, list) and isinstance(shapes, list)):
        raise APIError("update_info needs lists 'names', 'dtype_names' and 'shapes'", "update_info")
    if not len(names) == len(dtypes) == len(shapes):
        raise APIError("update_info: 'names', 'dtype_names' and 'shapes' differ in length", "update_info")
    out = []
    for name, dname, shape in zip(names, dtypes, shapes, strict=True):
        target = targets.get(strip_prefixes(str(name)))
        if target is None:
            raise APIError(f"update_info: unknown parameter name {name!r}", "update_info")
        dtype = DTYPES.get(str(dname).removeprefix("torch."))
        if dtype is None:
            raise APIError(f"update_info: unknown dtype {dname!r} for {name!r}", "update_info")
        if not isinstance(shape, list) or list(target.shape) != shape:
            raise APIError(f"update_info: {name!r} has shape {shape}, expected {list(target.shape)}", "update_info")
        out.append((str(name), dtype, tuple(shape)))
    return out


class WeightReceiver:
    """The server's end (rank `rank_offset`, normally 1) of a trainer's weight broadcast group.

    Args:
        master_address, master_port: the trainer's `TCPStore` (rank 0 hosts it).
        rank_offset: this server's rank; world_size: ranks in the group (2: one trainer, one server).
        timeout_s: how long joining, and each tensor, may wait for the trainer.
    """

    def __init__(self, master_address: str, master_port: int, rank_offset: int = 1, world_size: int = 2,
                 timeout_s: float = 120.0) -> None:
        timeout = datetime.timedelta(seconds=timeout_s)
        self.store = dist.TCPStore(master_address, int(master_port), int(world_size), is_master=False,
                                   timeout=timeout)
        self.group = dist.ProcessGroupGloo(self.store, int(rank_offset), int(world_size), timeout)
        self.staged: dict[str, torch.Tensor] | None = None

    def start(self) -> None:
        self.staged = {}

    def receive(self, items: list) -> None:
        """Receive one chunk, in order, from rank 0's broadcasts."""
        if self.staged is None:
            raise RuntimeError("call /start_weight_update first")
        for name, dtype, shape in items:
            t = torch.empty(shape, dtype=dtype)
            self.group.broadcast(t, 0).wait()
            self.staged[name] = t

    def take(self) -> dict[str, torch.Tensor]:
        staged, self.staged = self.staged, None
        if staged is None:
            raise RuntimeError("no weight update in progress: call /start_weight_update first")
        return staged
