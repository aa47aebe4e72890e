"""The engine's weights: detecting in-place changes (version counters) and copying new weights in.

The engine runs the trainer's own parameters through its engine view, so an optimizer
step is seen at once; `weights_version` tells the core that prefix KV computed before it is stale.
`copy_weights` is `RolloutEngine.update_weights`' copy from another module, state dict or stream.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch
from torch.distributed.tensor import DTensor, distribute_tensor

WRAPPER_PREFIXES = ("module.", "_orig_mod.", "_fsdp_wrapped_module.")


def versioned_tensors(model: torch.nn.Module) -> list[torch.Tensor]:
    """The parameters and buffers whose version counters reveal in-place changes (inference tensors have none)."""
    out = []
    for t in (*model.parameters(), *model.buffers()):
        try:
            _ = t._version
        except RuntimeError:
            continue
        out.append(t)
    return out


def weights_version(tensors: list[torch.Tensor]) -> int:
    # NOTE: every in-place op bumps its tensor's counter and none goes down, so the sum moves iff one did.
    # Writes through `.data` bypass the counters: those need `update_weights`.
    return sum(t._version for t in tensors)


def copy_weights(view: torch.nn.Module, source) -> int:
    """Copy `source` (an nn.Module, wrappers unwrapped; a state dict; or an iterable of (name, tensor)) into
    the engine view's tensors in place, cast to their dtypes; returns how many tensors were copied (0 when
    they already are the same storage). ValueError naming unknown names or mismatching shapes: a mapping is
    checked whole before anything is copied."""
    module = _unwrap(source) if isinstance(source, torch.nn.Module) else None
    # NOTE: copy into the tensors the engine runs, its view's. Built on the trainer's model they are the
    # trainer's own tensors (same data_ptr: nothing is copied), unless the trainer has since replaced
    # its parameters (e.g. `load_state_dict(..., assign=True)`): then they are copied like any source.
    targets = dict(view.named_parameters(remove_duplicate=False))
    targets.update(dict(view.named_buffers(remove_duplicate=False)))
    if module is not None:
        source = module.state_dict()
    if isinstance(source, Mapping):
        # NOTE: check a whole dict before copying anything, so that a rejected update changes nothing
        # (a stream is copied as it comes, never held in memory at once).
        unknown = [name for name, value in source.items() if _target_of(targets, name, value) is None]
        if unknown:
            raise ValueError(_unknown_names(unknown))
        items: Iterable = source.items()
    else:
        items = source
    copied, unknown = 0, []
    done: set[tuple[int, int]] = set()  # (target, value) storages: a tied weight is copied once
    with torch.no_grad():
        for name, value in items:
            target = _target_of(targets, name, value)
            if target is None:
                unknown.append(name)
                continue
            target, value = local_pair(target, value)
            pair = (target.data_ptr(), value.data_ptr())
            if pair[0] != pair[1] and pair not in done:
                target.copy_(value)
                done.add(pair)
                copied += 1
    if unknown:
        raise ValueError(_unknown_names(unknown))
    return copied


def local_pair(target: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`(destination, source)` as plain tensors: a tensor-parallel parameter (a DTensor, `rollout.engine.tp`) is
    written through its local shard, from the same shard of a full tensor (sliced per the parameter's
    placements, no communication) or of another sharded tensor (redistributed to the same placements)."""
    if not isinstance(target, DTensor):
        return target, value.full_tensor() if isinstance(value, DTensor) else value
    if isinstance(value, DTensor):
        if value.placements != target.placements:
            value = value.redistribute(target.device_mesh, target.placements)
        return target.to_local(), value.to_local()
    shard = distribute_tensor(
        value.detach().to(target.device), target.device_mesh, target.placements, src_data_rank=None
    )
    return target.to_local(), shard.to_local()


def _target_of(targets: dict[str, torch.Tensor], name: str, value: torch.Tensor) -> torch.Tensor | None:
    """The engine tensor `name` (wrapper prefixes stripped) updates, None if unknown; ValueError on a
    shape mismatch."""
    target = targets.get(strip_prefixes(name))
    if target is not None and target.shape != value.shape:
        raise ValueError(f"update_weights: {name} has shape {tuple(value.shape)}, expected {tuple(target.shape)}")
    return target


def _unknown_names(names: list[str]) -> str:
    return f"update_weights: unknown parameter names {names[:5]}{'...' if len(names) > 5 else ''}"


def _unwrap(module: torch.nn.Module) -> torch.nn.Module:
    while True:
        inner = getattr(module, "module", None) or getattr(module, "_orig_mod", None)
        if not isinstance(inner, torch.nn.Module):
            return module
        module = inner


def strip_prefixes(name: str) -> str:
    changed = True
    while changed:
        changed = False
        for prefix in WRAPPER_PREFIXES:
            if name.startswith(prefix):
                name = name[len(prefix):]
                changed = True
    return name
