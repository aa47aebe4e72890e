"""Trainer checkpoints on disk: the `checkpoint-{step}` directories, and the sharded (FSDP2) model and
optimizer state inside one.

A checkpoint directory holds `accelerator.save_state`'s files (scheduler, RNG; model and optimizer too when
unsharded) and `trainer_state.json` (the step). Under FSDP the model and optimizer are one
`torch.distributed.checkpoint` (DCP) checkpoint in `fsdp/`, each rank writing its own shards (no full gather);
it loads back onto the same number of ranks or, through DCP's resharding, onto another. A full state dict for
other tools: `torch.distributed.checkpoint.format_utils.dcp_to_torch_save(path/fsdp, file)`.
"""

from __future__ import annotations

import os

import torch

STATE_FILE = "trainer_state.json"
SHARDED_DIR = "fsdp"


def checkpoints(output_dir: str) -> list[str]:
    """The `checkpoint-{step}` directories under `output_dir` that hold a trainer state, oldest first."""
    if not os.path.isdir(output_dir):
        return []
    found = []
    for name in os.listdir(output_dir):
        path = os.path.join(output_dir, name)
        if name.startswith("checkpoint-") and name[11:].isdigit() and os.path.exists(os.path.join(path, STATE_FILE)):
            found.append((int(name[11:]), path))
    return [path for _, path in sorted(found)]


def save_sharded(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, path: str, folder: str = SHARDED_DIR
) -> None:
    """Every rank writes its shards of `model` and `optimizer` to `path/fsdp` (collective; `folder`: another name,
    "tp" for a tensor-parallel policy)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_state, optim_state = get_state_dict(model, optimizer)
    dcp.save({"model": model_state, "optimizer": optim_state}, checkpoint_id=os.path.join(path, folder))


def load_sharded(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, path: str, folder: str = SHARDED_DIR
) -> None:
    """Load `save_sharded`'s `path/fsdp` into `model` and `optimizer` in place (collective)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    where = os.path.join(path, folder)
    if not os.path.isdir(where):
        raise FileNotFoundError(f"{path} holds no sharded model ({folder}/): was it saved "
                                f"{'without FSDP' if folder == SHARDED_DIR else 'with another tp_size'}?")
    model_state, optim_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optimizer": optim_state}
    dcp.load(state, checkpoint_id=where)
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
