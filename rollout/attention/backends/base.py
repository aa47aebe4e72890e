"""What every attention backend shares: the step's inputs, the slot arithmetic and the interface.

- `StepInputs`: the per-request and per-token index tensors of one step (built by the runner, read by
  each backend's `build_group`), with `ragged`, the index helper for runs laid end to end;
- `cache_slots`: the one place a (page table, position) pair becomes a cache slot;
- `AttentionMetadata`: what the registered attention function receives for every layer of a step;
- `AttentionBackend`: everything the rest of the engine asks a backend (`rollout.attention.backends` lists them).

Imports nothing of the engine but its leaf modules (`device_page_tables`, `memory_plan`).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import ClassVar, Protocol

import torch

from rollout.kv.memory_plan import AttnMemory, KVShape
from rollout.tensors import int_tensor

# NOTE: up to this many tokens a CPU step's ragged indices are built from the host lists (a 4 x 9-token verifying
# step's indices and group 44 -> 30 us, 16 x 9 tokens 24 -> 17 us), above by torch ops (a 2048-token prompt chunk
# 33 us against 78 us from the lists)
HOST_RAGGED_TOKENS = 256


class StepInputs:
    """Per-request and per-token index tensors of one step (shared by every layer group), and the
    persistent page tables (`tables[window]`, [R, P] int32; request b is row `rows[b]`).

    Args:
        starts: first position computed this step, per request.
        lens: query tokens this step, per request (>= 1 each).
        rows: page-table row of each request (`rollout.kv.device_page_tables.DevicePageTables.sync`).
        tables: layer group's window -> its persistent page tables [R, P] int32.
        device: where the tensors live.
    """

    def __init__(self, starts: list[int], lens: list[int], rows: list[int],
                 tables: dict[int | None, torch.Tensor], device: torch.device) -> None:
        self.starts_list = starts
        self.lens_list = lens
        self.device = device
        self.starts = int_tensor(starts, device)  # [B]
        self.rows = int_tensor(rows, device)  # [B] page-table row of each request
        self.tables = tables  # group window -> [R, P] int32
        # NOTE: group window -> [B, 3] int64 (logical page, source page, slots) of forks whose partial prompt page
        # copies
        # slots of a page the fork holds a reference to (`Request.fork_alias`); None when no request is one
        self.aliases: dict[int | None, torch.Tensor] | None = None
        # NOTE: a speculative step's verification (each row its last token and its draft, `ModelRunner.prepare`):
        # a backend may attend every token as a decode query of its own, reading keys up to its own position
        self.verify = False
        total = int(sum(lens))
        self.decode_only = total == len(lens)
        if self.decode_only:  # NOTE: a pure decode step (one token per request): no ragged indexing
            self.request_of_token = torch.arange(total, device=device)  # [T]
            self.first_row = list(range(total))
            self.positions = self.starts  # [T]
            return
        self.first_row = list(itertools.accumulate([0, *lens[:-1]]))
        if device.type == "cpu" and total <= HOST_RAGGED_TOKENS:  # NOTE: from the host lists, two packed buffers
            of: list[int] = []
            pos: list[int] = []
            for b, (s, n) in enumerate(zip(starts, lens, strict=True)):
                of += [b] * n
                pos += range(s, s + n)
            self.request_of_token, self.positions = int_tensor(of, device), int_tensor(pos, device)  # [T], [T]
            return
        # NOTE: sizes and first rows from the host lists: no device-to-host read (a sync on CUDA)
        self.request_of_token, offsets, _ = ragged(int_tensor(lens, device), total)  # [T], [T]
        self.positions = self.starts[self.request_of_token] + offsets  # [T]


def ragged(lens: torch.Tensor, total: int | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """For runs of `lens` [B] items laid end to end (`total` of them, when known on the host): (run of
    each item [N], its offset in the run [N], first item of each run [B])."""
    owner = torch.repeat_interleave(torch.arange(lens.numel(), device=lens.device), lens, output_size=total)
    first = torch.cumsum(lens, 0) - lens
    return owner, torch.arange(owner.numel(), device=lens.device) - first[owner], first


def cache_slots(table: torch.Tensor, rows: torch.Tensor, positions: torch.Tensor, page_size: int) -> torch.Tensor:
    """Cache slots (int64) of `positions` (any shape) of table rows `rows` (broadcastable) through `table` [R, P]:
    `table[row, pos // page_size] * page_size + pos % page_size`."""
    ps = page_size
    return table[rows, torch.div(positions, ps, rounding_mode="floor")].long() * ps + positions % ps


class LayerGroup(Protocol):
    """A backend's metadata of one layer group for one step: what the attention function reads of it."""

    window: int | None  # the layers' sliding window, None for full attention
    slot_mapping: torch.Tensor  # [T] cache slot of each new token


@dataclass(slots=True)
class AttentionMetadata:
    """Per-step inputs of the paged attention (built by the runner, shared by every layer)."""

    cache: object  # rollout.kv.kv_cache.PagedKVCache
    groups: list[LayerGroup]  # indexed by `cache.group_of(layer)`: the backend's `build_group` of each group
    backend: AttentionBackend | None = None  # runs `attend` for every layer
    layers_seen: set[int] | None = None  # when set, each layer that runs adds its index (first-step check)


class AttentionBackend(Protocol):
    """The interface every backend implements; nothing else of a backend is read by the engine.

    Model features a backend may refuse: attention sinks (gpt-oss `s_aux`), through `supports_sinks`
    (`rollout.attention.backends.select` picks a backend for a sink model by it, and the attention function
    refuses `s_aux` on a backend without them).
    """

    name: ClassVar[str]  # the `attn_backend` value that selects it
    supports_sinks: ClassVar[bool]  # implements gpt-oss attention sinks (`attend(..., sinks=)`)
    reads_unwritten_slots: ClassVar[bool]  # multiplies slots never written by zero weights: zero the cache

    @classmethod
    def create(cls, device: torch.device, dtype: torch.dtype, **context) -> AttentionBackend:
        """The backend ready to run; ValueError naming `attn_backend` when it cannot run here.

        `context`: what a backend may need from the engine (`page_size`, `num_pages`, `max_batch_tokens`)."""

    @classmethod
    def attn_memory(cls, shape: KVShape, page_size: int, max_batch_tokens: int | None, softcap: bool,
                    max_pages: int) -> AttnMemory:
        """Its step temporaries, for the memory plan (`rollout.kv.memory_plan.plan_cache`).

        `shape`: the cache's storages; `softcap`: the model caps its logits (Gemma 2); `max_pages`: the most
        pages one request can hold."""

    def build_group(self, window: int | None, tables: list[list[int]], step: StepInputs,
                    page_size: int) -> LayerGroup:
        """The metadata of one layer group for this step, once per step and group.

        `tables`: each scheduled request's page table of this group; `step`: positions, starts, lengths
        and persistent page tables of the step's requests."""

    def attend(
        self,
        meta: AttentionMetadata,
        group: LayerGroup,  # this layer's, from `build_group`
        layer: int,
        query: torch.Tensor,  # [1, H, T, D]
        key: torch.Tensor,  # [1, Hkv, T, D] this step's keys (already in the cache)
        value: torch.Tensor,  # [1, Hkv, T, D]
        k_cache: torch.Tensor,  # [Hkv, slots, D]
        v_cache: torch.Tensor,  # [Hkv, slots, D]
        scale: float,
        softcap: float | None,
        sinks: torch.Tensor | None = None,  # [H] attention sinks; only when `supports_sinks`
    ) -> torch.Tensor:  # [T, H, D]
        """One layer's attention over the paged cache."""
