"""The attention of the batch-invariant mode (`ContinuousBatchingConfig(batch_invariant=True)`).

Every query row of a step, a prompt chunk's as well as a decode's, attends its own keys in place over the
paged cache through `rollout.invariant.ops.attend_rows` (the C++ per-row kernel): one reduction order per
token whatever the step holds, and the same one a trainer's padded forward uses
(`rollout.invariant.forward`). No cascade over shared pages (it merges partial softmaxes, another order).
Chosen by `rollout.invariant.mode.engine_backend` for `attn_backend` "auto", "cpu" or "sdpa" on a CPU (the C++
per-row kernel), and on CUDA or for "triton" (the Triton per-row kernel, `rollout.kernels.triton_decode`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rollout.attention.backends.base import AttentionMetadata, StepInputs, cache_slots
from rollout.invariant.ops import attend_rows
from rollout.kv.memory_plan import AttnMemory, KVShape


@dataclass(slots=True)
class InvariantGroup:
    """One layer group's rows for the step: every token is a row of the kernel."""

    window: int | None  # the layers' sliding window, None for full attention
    slot_mapping: torch.Tensor  # [T] cache slot of each new token
    table: torch.Tensor  # [R, P] the group's persistent page tables
    row: torch.Tensor  # [T] table row of each token's request
    start: torch.Tensor  # [T] first key position each token reads
    end: torch.Tensor  # [T] one past its last (its own position + 1)


class InvariantBackend:
    """Per-row attention for every token (see the module docstring); `name` is the backend it stands for."""

    supports_sinks = False  # NOTE: the C++ kernel has no sink term
    reads_unwritten_slots = False  # NOTE: each row reads its own written positions only

    def __init__(self, name: str, kernels: str = "cpu") -> None:
        self.name = name
        self.kernels = kernels  # NOTE: "cpu" (the C++ per-row kernel) or "triton" (rollout.kernels.triton_decode)

    @classmethod
    def attn_memory(
        cls, shape: KVShape, page_size: int, max_batch_tokens: int | None, softcap: bool, max_pages: int
    ) -> AttnMemory:
        return AttnMemory(fixed=0, per_cache_byte=0.0)  # NOTE: read in place, nothing gathered

    def build_group(
        self, window: int | None, tables: list[list[int]], step: StepInputs, page_size: int
    ) -> InvariantGroup:
        table = step.tables[window]  # [R, P] int32
        row = step.rows[step.request_of_token].long()  # [T]
        pos = step.positions.long()  # [T]
        start = torch.zeros_like(pos) if window is None else (pos - (window - 1)).clamp_min(0)
        return InvariantGroup(window, cache_slots(table, row, pos, page_size), table, row, start, pos + 1)

    def attend(
        self,
        meta: AttentionMetadata,
        group: InvariantGroup,
        layer: int,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        scale: float,
        softcap: float | None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:  # [T, H, D]
        if sinks is not None:
            raise ValueError("batch_invariant: the per-row kernel does not implement attention sinks")
        q = query[0].transpose(0, 1)  # [T, H, D]
        out = attend_rows(
            q,
            k_cache,
            v_cache,
            group.table,
            group.row,
            group.start,
            group.end,
            meta.cache.page_size,
            scale,
            softcap,
            self.kernels,
        )
        return out.to(query.dtype)
