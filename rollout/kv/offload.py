"""CPU offload of preempted requests' KV pages.

When the scheduler preempts a request, its live pages are copied into a preallocated host buffer
instead of being dropped; when the request is readmitted it gets fresh pages, the KV is copied back
and it carries on where it was, with nothing recomputed. When the buffer is full the request falls
back to recompute. The buffer has the cache's layout (one host tensor per cache storage, page `s`
of the buffer in rows `s * page_size ...`); it is pinned when CUDA is present (fast async copies)
and plain host memory otherwise (pinning needs a CUDA driver).
"""

from __future__ import annotations

import logging
from collections import deque

import psutil
import torch

from rollout.kv.kv_cache import PagedKVCache
from rollout.kv.memory_plan import GiB

logger = logging.getLogger("rollout")


def plan_offload(space_gib: float | None, safety_threshold: float, page_bytes: int) -> int:
    """Host pages for `cpu_offload_space` GiB, capped at `safety_threshold` of the available RAM.

    `space_gib=None` takes the whole cap; 0 disables offload (returns 0).
    """
    if space_gib == 0:
        return 0
    cap = int(psutil.virtual_memory().available * safety_threshold)
    want = cap if space_gib is None else int(space_gib * GiB)
    if want > cap:
        logger.warning(
            "cpu_offload_space=%.2f GiB exceeds %.0f%% of the available RAM; using %.2f GiB",
            space_gib, 100 * safety_threshold, cap / GiB,
        )
        want = cap
    return want // page_bytes


class CpuOffloadBuffer:
    """`num_pages` host pages mirroring `cache`'s storages, handed out to preempted requests.

    Implements the scheduler's `Offloader` protocol: `save(pages) -> slots | None`,
    `restore(slots, pages)`, `discard(slots)`. Host tensors are created at the first save, with the
    shapes of the cache's storages at that moment (all exist by then: every forward reaches every layer).

    Args:
        cache: the paged KV cache whose pages are saved and restored.
        num_pages: capacity of the buffer in pages.
    """

    def __init__(self, cache: PagedKVCache, num_pages: int) -> None:
        self.cache = cache
        self.num_pages = num_pages
        self.page_size = cache.page_size
        self.pin = torch.cuda.is_available() and cache.device.type == "cuda"
        self.free_slots: deque[int] = deque(range(num_pages))
        self.host: dict[tuple[int, int, int], tuple[torch.Tensor, torch.Tensor]] = {}  # [Hkv, P, ps, D] each

    @property
    def num_free(self) -> int:
        return len(self.free_slots)

    @torch.inference_mode()  # NOTE: the cache tensors are inference tensors (made in the forward)
    def save(self, pages: list[int]) -> list[int] | None:
        """Copy device `pages` into host slots; None (nothing taken) if there is not room for all."""
        if len(pages) > len(self.free_slots):
            return None
        slots = [self.free_slots.popleft() for _ in pages]
        if pages:
            src = torch.tensor(pages, device=self.cache.device)
            dst = torch.tensor(slots)
            for key in self.cache.keys:
                for dev, host in zip(self._paged(key), self._host(key), strict=True):
                    host[:, dst] = dev.index_select(1, src).to("cpu")
        return slots

    @torch.inference_mode()
    def restore(self, slots: list[int], pages: list[int]) -> None:
        """Copy host `slots` back into device `pages` (same order) and free the slots."""
        if len(slots) != len(pages):
            raise ValueError(f"restoring {len(slots)} offloaded pages into {len(pages)} pages")
        if pages:
            src = torch.tensor(slots)
            dst = torch.tensor(pages, device=self.cache.device)
            for key in list(self.host):
                self.cache.storage(key)  # NOTE: re-created if the cache was released meanwhile
                for dev, host in zip(self._paged(key), self.host[key], strict=True):
                    dev.index_copy_(1, dst, host.index_select(1, src).to(dev.device, non_blocking=self.pin))
        self.discard(slots)

    def discard(self, slots: list[int]) -> None:
        """Give `slots` back to the buffer without copying them anywhere."""
        self.free_slots.extend(slots)

    def release(self) -> None:
        """Drop the host tensors while nothing is parked in them (they come back at the next save)."""
        if len(self.free_slots) == self.num_pages:
            self.host.clear()

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for pair in self.host.values() for t in pair)

    def _paged(self, key: tuple[int, int, int]) -> tuple[torch.Tensor, torch.Tensor]:
        """The cache storage `key` viewed as `[Hkv, num_pages, page_size, D]` (K and V)."""
        k, v = self.cache.storage(key)
        shape = (key[1], self.cache.num_pages, self.page_size, key[2])
        return k.view(shape), v.view(shape)

    def _host(self, key: tuple[int, int, int]) -> tuple[torch.Tensor, torch.Tensor]:
        pair = self.host.get(key)
        if pair is None:
            shape = (key[1], self.num_pages, self.page_size, key[2])
            # NOTE: pinned only with CUDA (pinning without a driver raises); plain host memory is
            # touched only as pages are saved.
            pair = self.host[key] = tuple(
                torch.empty(shape, dtype=self.cache.dtype, pin_memory=self.pin) for _ in range(2)
            )
        return pair
