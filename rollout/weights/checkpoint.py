"""`load_checkpoint`: the tensors of a `save_pretrained` directory, for the one weight door
(`update_weights(directory)` on an engine, `/update_weights_from_disk` on the servers)."""

from __future__ import annotations

import os
from pathlib import Path

import torch


def load_checkpoint(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """The tensors of a `save_pretrained` directory (safetensors shards, or pytorch_model*.bin);
    FileNotFoundError when it is no directory or holds no weights, ValueError when a file cannot be read."""
    root = Path(path)
    if not root.is_dir():
        raise FileNotFoundError(f"model_path {str(path)!r} is not a directory")
    shards = sorted(root.glob("*.safetensors"))
    bins = [] if shards else sorted(root.glob("pytorch_model*.bin"))
    if not shards and not bins:
        raise FileNotFoundError(f"model_path {str(path)!r} holds no *.safetensors or pytorch_model*.bin")
    tensors: dict[str, torch.Tensor] = {}
    try:
        if shards:
            from safetensors.torch import load_file  # noqa: PLC0415 (safetensors comes with transformers)

            for shard in shards:
                tensors.update(load_file(str(shard)))
        for shard in bins:
            tensors.update(torch.load(shard, map_location="cpu", weights_only=True))
    except Exception as e:
        raise ValueError(f"model_path {str(path)!r}: cannot read the checkpoint: {type(e).__name__}: {e}") from None
    return tensors
