"""Attention backends: how the paged attention of one step runs (`ContinuousBatchingConfig.attn_backend`).

Each backend is one small object with two jobs, as vLLM v1's backends: `build_group` turns the step's
page tables into the tensors its kernel wants, once per step and layer group, and `attend` runs
one layer over the paged cache. The runner and the registered attention function call those two
methods and never ask which backend runs. The K/V of the step are written into the cache before
`attend` (one code path for every backend). Backends:

- `cpu`: the C++ kernel of `rollout.cpu_kernels` for decode rows, SDPA for prompt chunks (`cpu`);
- `sdpa`: gather of each request's pages + torch SDPA, the portable reference (`sdpa`);
- `flex`: torch FlexAttention over the whole paged cache, compiled (`flex`);
- `flash`: flash-attn with page tables, CUDA only (`flash`; refuses to run elsewhere).

`"auto"` picks `cpu` on a CPU (`sdpa`, with one warning, when the kernel cannot build) and `flex` on
CUDA (`flash` there once it is implemented).
"""

from __future__ import annotations

import logging
from typing import Protocol

import torch

from ..config import ATTN_BACKENDS
from ..memory_plan import AttnMemory, KVShape

logger = logging.getLogger("rollout")



class AttentionBackend(Protocol):
    """The interface every backend implements (see the module docstring)."""

    name: str
    reads_unwritten_slots: bool  # the kernel multiplies slots never written by zero weights: zero the cache

    def build_group(self, window: int | None, tables: list[list[int]], step, page_size: int):
        """The metadata of one layer group for this step (has `.window` and `.slot_mapping` [T]).

        `tables`: each scheduled request's page table of this group; `step`: the runner's
        `_StepIndex` (positions, starts, lengths of the step's requests)."""

    def attend(
        self,
        meta,  # rollout.attention.AttentionMetadata
        group,  # this layer's GroupMetadata
        layer: int,
        query: torch.Tensor,  # [1, H, T, D]
        key: torch.Tensor,  # [1, Hkv, T, D] this step's keys (already in the cache)
        value: torch.Tensor,  # [1, Hkv, T, D]
        k_cache: torch.Tensor,  # [Hkv, slots, D]
        v_cache: torch.Tensor,  # [Hkv, slots, D]
        scale: float,
        softcap: float | None,
    ) -> torch.Tensor:  # [T, H, D]
        """One layer's attention over the paged cache."""


# NOTE: a gather reads at most ~2x the KV its rows need (decode buckets split at half the longest row)
GATHER_WASTE = 2


def resolve(name: str, device: torch.device, dtype: torch.dtype) -> str:
    """`name` with "auto" resolved for `device`; ValueError naming `attn_backend` when unknown."""
    if name not in ATTN_BACKENDS:
        raise ValueError(f"attn_backend must be one of {ATTN_BACKENDS}, got {name!r}")
    return _auto(device, dtype) if name == "auto" else name


def attention_memory(name: str, shape: KVShape, page_size: int, max_batch_tokens: int | None,
                     softcap: bool, max_pages: int) -> AttnMemory:
    """The step temporaries of backend `name` (resolved) for the memory plan (`rollout.memory_plan.plan_cache`).

    `shape`: the cache's storages; `max_pages`: the most pages one request can hold.
    """
    from ..attention import SOFTCAP_SCORE_BYTES

    fixed = 2 * SOFTCAP_SCORE_BYTES if softcap else 0  # NOTE: scores and probabilities of one chunk
    if name == "flex":
        from .flex import PAGE_FLOOR, Q_BLOCK, ROW_FLOOR, TABLE_FLOOR

        # NOTE: int64 candidate pages [T, P] and its sorted copies; the mask mod's int32 tables; the
        # int32 kv_indices [T / Q_BLOCK, num_blocks] (a share of the cache's pages).
        page_bytes = page_size * shape.bytes_per_token
        tokens = max_batch_tokens or 8192
        return AttnMemory(per_query_token=4 * 8 * max_pages, fixed=4 * (3 * ROW_FLOOR + TABLE_FLOOR + PAGE_FLOOR),
                          per_cache_byte=4 * tokens / Q_BLOCK / page_bytes)
    # NOTE: `sdpa` decode buckets copy at most GATHER_WASTE x one layer's K/V (x3 when half precision
    # is widened to fp32 on a CPU); prompt chunks (both backends; `cpu` decodes in place) copy one
    # request's K/V of one layer at a time; the softcap path widens K/V to fp32 too.
    widen = 3 if shape.dtype in (torch.bfloat16, torch.float16) else 1
    one_request = max_pages * page_size * shape.bytes_per_token // max(1, shape.num_layers) * widen
    share = 0.0 if name == "cpu" else GATHER_WASTE * widen / max(1, shape.num_layers)
    return AttnMemory(fixed=fixed + one_request, per_cache_byte=share)


def create(name: str, device: torch.device, dtype: torch.dtype, **context) -> AttentionBackend:
    """The backend `name` (`"auto"` resolved for `device`), ready to run; ValueError naming
    `attn_backend` when it is unknown or cannot run here.

    `context`: what a backend may need from the engine (`page_size`, `num_blocks`, `max_batch_tokens`).
    """
    name = resolve(name, device, dtype)
    if name == "cpu":
        from .cpu import CpuBackend

        return CpuBackend.create(device, dtype)
    if name == "sdpa":
        from .sdpa import SdpaBackend

        return SdpaBackend()
    if name == "flex":
        from .flex import FlexBackend

        return FlexBackend.create(device, dtype, **context)
    from .flash import FlashBackend

    return FlashBackend.create(device, dtype, **context)


def _auto(device: torch.device, dtype: torch.dtype) -> str:
    if device.type == "cuda":  # NOTE: "flash" once rollout.backends.flash is implemented and verified
        return "flex"
    if device.type != "cpu":
        return "sdpa"
    from .cpu import cpu_kernel

    if cpu_kernel(dtype) is None:
        # NOTE: rollout.cpu_kernels has said why (disabled, no compiler, failed build)
        logger.warning("attn_backend='auto': rollout's CPU attention kernel is unavailable; using 'sdpa'")
        return "sdpa"
    return "cpu"
