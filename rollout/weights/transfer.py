"""What both ends of a weight broadcast share: the process group (`new_group`, gloo or NCCL over a `TCPStore`)
and the buckets: tensors grouped by dtype into flat buffers of at most `bucket_bytes`, and back into views of
one flat buffer. The learner (`rollout.weights.broadcast`) packs, each rollout server (`rollout.serve.weights`)
unpacks, from the same metadata (names, dtypes, shapes) in the same order."""

from __future__ import annotations

import datetime
import socket
from collections.abc import Iterable, Iterator, Mapping, Sequence

import torch
import torch.distributed as dist


def named_tensors(model: torch.nn.Module | Mapping[str, torch.Tensor] | Iterable) -> Iterable[tuple[str, torch.Tensor]]:
    """(name, tensor) pairs of what a weight push sends: a module's state dict, a state dict, or the pairs."""
    if isinstance(model, torch.nn.Module):
        return model.state_dict().items()
    if isinstance(model, Mapping):
        return model.items()
    return model


def buckets(items: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Split `(name, tensor)` pairs into lists of one dtype each, of at most `bucket_bytes` (a larger tensor
    goes alone); a tensor shared by two names (tied weights) goes once, under its first name."""
    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
    open_: dict[torch.dtype, list[tuple[str, torch.Tensor]]] = {}
    sizes: dict[torch.dtype, int] = {}
    seen: set[tuple[int, torch.dtype, tuple[int, ...]]] = set()
    for name, tensor in items:
        key = (tensor.data_ptr(), tensor.dtype, tuple(tensor.shape))
        if key in seen:
            continue
        seen.add(key)
        nbytes = tensor.numel() * tensor.element_size()
        if open_.get(tensor.dtype) and sizes[tensor.dtype] + nbytes > bucket_bytes:
            yield open_.pop(tensor.dtype)
            sizes[tensor.dtype] = 0
        open_.setdefault(tensor.dtype, []).append((name, tensor))
        sizes[tensor.dtype] = sizes.get(tensor.dtype, 0) + nbytes
    yield from (b for b in open_.values() if b)


def pack_bucket(tensors: list[torch.Tensor], buffers: dict, device: torch.device) -> torch.Tensor:
    """One bucket as one flat tensor on `device`, the one packer of every weight wire (a broadcast to servers, the
    fleet's weight group): a lone contiguous tensor as it is (a view, no copy), else packed into a buffer per dtype
    kept in `buffers` across updates (a fresh one each time costs page faults: ~1 s of a ~2 s update of ~0.5 GB on
    a loaded CPU)."""
    if len(tensors) == 1 and tensors[0].is_contiguous() and tensors[0].device == device:
        return tensors[0].detach().reshape(-1)
    n = sum(t.numel() for t in tensors)
    buf = buffers.get(tensors[0].dtype)
    if buf is None or buf.numel() < n:
        buf = buffers[tensors[0].dtype] = torch.empty(n, dtype=tensors[0].dtype, device=device)
    out = buf[:n]
    torch.cat([t.detach().reshape(-1).to(device) for t in tensors], out=out)
    return out


def check_names_shapes(targets: Mapping[str, torch.Tensor], names: Sequence[str],
                       shapes: Sequence[Sequence[int]]) -> None:
    """The one name / shape check of a pushed chunk against the engine's tensors (`targets` by name, prefixes
    stripped by the caller): a ValueError naming the first unknown names or wrong shapes, before any tensor moves."""
    unknown = [n for n in names if n not in targets]
    wrong = [f"{n} has shape {list(s)}, expected {list(targets[n].shape)}" for n, s in zip(names, shapes, strict=True)
             if n in targets and tuple(targets[n].shape) != tuple(s)]
    if unknown or wrong:
        parts = ([f"unknown parameter names {unknown[:5]}"] if unknown else []) + wrong[:5]
        raise ValueError("weight update refused: " + "; ".join(parts))


def unflatten(flat: torch.Tensor, shapes: Sequence[Sequence[int]]) -> list[torch.Tensor]:
    """Views of `flat` with `shapes`, in order (the inverse of the sender packing them in order,
    `WeightBroadcaster`)."""
    sizes = [int(torch.Size(s).numel()) for s in shapes]
    if sum(sizes) != flat.numel():
        raise ValueError(f"the bucket holds {flat.numel()} elements, its shapes {sum(sizes)}")
    return [part.view(tuple(s)) for part, s in zip(flat.split(sizes), shapes, strict=True)]


BACKENDS = ("gloo", "nccl")


def free_port(host: str) -> int:
    """A TCP port free on `host` now (for the group's `TCPStore`)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def new_group(master_address: str, master_port: int, rank: int, world_size: int, timeout_s: float,
              backend: str = "gloo", is_master: bool = False) -> tuple[dist.TCPStore, dist.ProcessGroup]:
    """A process group of its own over a `TCPStore` (rank 0 hosts the store); torch's default group untouched.
    NOTE: both ends of a weight push build theirs here, so trainer and servers agree on the backend's setup."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    timeout = datetime.timedelta(seconds=timeout_s)
    store = dist.TCPStore(master_address, int(master_port), int(world_size), is_master=is_master, timeout=timeout)
    if backend == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        group = dist.ProcessGroupNCCL(store, rank, world_size, options)
    else:
        group = dist.ProcessGroupGloo(store, rank, world_size, timeout)
    return store, group  # NOTE: the store must outlive the group
