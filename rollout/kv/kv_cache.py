"""The paged KV tensors: one K and one V tensor per storage, head-major.

Layout: `key[num_kv_heads, num_pages * page_size, head_dim]` (and the same for value); slot
`p * page_size + i` holds token `i` of page `p`. Tensors are created on the first forward that
reaches a layer, from the shapes the model actually produces, so any head layout works.

Layers are grouped by attention window (see `rollout.kv.page_tables`), and a page belongs to one
group at a time. So the k-th layer of every group shares one tensor ("storage" k): page `p` holds
the k-th layer of whichever group owns it. A model with 2 full and 2 sliding layers therefore needs
2 storages, not 4, and a page costs the same whichever group holds it. How many pages to make is
`rollout.kv.memory_plan`'s job.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def storage_layout(layer_groups: Sequence[int]) -> list[int]:
    """Storage index of each layer: its rank among the layers of its group."""
    seen: dict[int, int] = {}
    out = []
    for g in layer_groups:
        out.append(seen.get(g, 0))
        seen[g] = out[-1] + 1
    return out


class PagedKVCache:
    """Paged K/V storage shared by the layer groups, allocated lazily at the first forward.

    Args:
        num_pages, page_size: the pool's pages.
        device, dtype: where and how the KV lives.
        layer_groups: the group (index into the scheduler's windows) of each layer; None = one group.
        zeroed: allocate zeros instead of uninitialised memory, for attention backends that multiply
            unwritten slots by zero weights (`flex`: garbage NaN * 0 would be NaN).
    """

    def __init__(
        self,
        num_pages: int,
        page_size: int,
        device: torch.device,
        dtype: torch.dtype,
        layer_groups: Sequence[int] | None = None,
        zeroed: bool = False,
    ) -> None:
        self.num_pages = num_pages
        self.page_size = page_size
        self.num_slots = num_pages * page_size
        self.device = device
        self.dtype = dtype
        self.zeroed = zeroed
        self.layer_groups = list(layer_groups or [])
        self._storage_of = storage_layout(self.layer_groups)
        # NOTE: keyed by (storage, num_kv_heads, head_dim): layers of different shapes never share.
        self.keys: dict[tuple[int, int, int], torch.Tensor] = {}  # -> [Hkv, num_slots, D] head-major
        self.values: dict[tuple[int, int, int], torch.Tensor] = {}
        self._layer_ids: dict[int, int] = {}  # id(module) -> layer, for modules without `layer_idx`
        self._specs: set[tuple[int, int, int]] = set()  # storages seen, kept across release
        self.offload = None  # CpuOffloadBuffer, when CPU offload is on (see rollout.kv.offload)

    def layer_index(self, module: torch.nn.Module) -> int:
        return self._layer_ids.setdefault(id(module), len(self._layer_ids))

    def group_of(self, layer_idx: int) -> int:
        return self.layer_groups[layer_idx] if layer_idx < len(self.layer_groups) else 0

    def layer(self, layer_idx: int, num_kv_heads: int, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
        if layer_idx < len(self._storage_of):
            storage = self._storage_of[layer_idx]
        else:  # a layer the config did not announce: a storage of its own
            storage = len(self._storage_of) + layer_idx
        return self.storage((storage, num_kv_heads, head_dim))

    def storage(self, key: tuple[int, int, int]) -> tuple[torch.Tensor, torch.Tensor]:
        """The K and V tensors `[Hkv, num_slots, D]` of storage `key = (index, Hkv, D)`."""
        k = self.keys.get(key)
        if k is None:
            self._specs.add(key)
            # NOTE: empty, not zeros, unless asked: the gather backends only ever read slots they have
            # written (padding of a gather repeats a slot of the same request), so memory is touched
            # only as pages are used.
            shape = (key[1], self.num_slots, key[2])
            new = torch.zeros if self.zeroed else torch.empty
            k = self.keys[key] = new(shape, device=self.device, dtype=self.dtype)
            self.values[key] = new(shape, device=self.device, dtype=self.dtype)
        return k, self.values[key]

    @property
    def nbytes(self) -> int:
        """Bytes of the paged K/V tensors."""
        return sum(t.numel() * t.element_size() for t in (*self.keys.values(), *self.values.values()))

    def release(self) -> int:
        """Free the tensors (they are allocated again at the next forward); returns the bytes freed."""
        freed = self.nbytes
        self.keys.clear()
        self.values.clear()
        if self.offload is not None:
            self.offload.release()
        return freed

    def reallocate(self) -> int:
        """Allocate every storage seen before (after `release`); returns the cache's bytes."""
        for key in sorted(self._specs):
            self.storage(key)
        return self.nbytes

    def copy_slots(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy KV of slots `src` [n] into slots `dst` [n] in every layer (copy-on-write of a page)."""
        for cache in (*self.keys.values(), *self.values.values()):
            cache.index_copy_(1, dst, cache.index_select(1, src))
