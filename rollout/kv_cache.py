"""The paged KV tensors and how many pages to make.

Layout per layer: `key[num_blocks * page_size, num_kv_heads, head_dim]` (and the same for value);
slot `b * page_size + i` holds token `i` of page `b`. Tensors are created on the first forward that
reaches a layer, from the shapes the model actually produces, so any head layout works.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import psutil
import torch

logger = logging.getLogger("rollout")

GiB = 1 << 30
# NOTE: on a CPU the "device" cache is host RAM shared with everything else: by default take at most
# 5% of the available RAM and never more than 1 GiB (that still holds ~250k tokens of a 5M model).
CPU_CACHE_FRACTION = 0.05
CPU_CACHE_CAP_BYTES = 1 * GiB
DEFAULT_MAX_BATCH_TOKENS = 8192
MIN_MAX_BATCH_TOKENS = 256


@dataclass(frozen=True, slots=True)
class KVShape:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype

    @property
    def bytes_per_token(self) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * torch.empty((), dtype=self.dtype).element_size()


def kv_shape_from_config(config, dtype: torch.dtype) -> KVShape:
    """Best estimate of the KV footprint from a HF config (used for sizing; tensors use real shapes)."""
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return KVShape(config.num_hidden_layers, kv_heads, head_dim, dtype)


def plan_cache(
    shape: KVShape,
    page_size: int,
    num_blocks: int | None,
    max_batch_tokens: int | None,
    max_memory_percent: float,
    device: torch.device,
) -> tuple[int, int]:
    """Returns `(num_blocks, max_batch_tokens)`.

    On CUDA the cache takes `max_memory_percent` of the free memory, less room for one step's
    activations. On a CPU it takes min(5% of available RAM, 1 GiB): the machine's RAM is shared with
    the trainer, the data and the OS, so we do not reserve most of it up front. `max_batch_tokens`
    defaults to 8192, lowered if the per-step buffers would not fit, never under 256.
    """
    per_token = shape.bytes_per_token
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        budget = int(free * max_memory_percent)
    else:
        budget = min(int(psutil.virtual_memory().available * CPU_CACHE_FRACTION), CPU_CACHE_CAP_BYTES)
    if max_batch_tokens is None:
        # NOTE: leave the cache at least 4x the KV of a full step.
        fit = budget // (5 * per_token)
        max_batch_tokens = max(MIN_MAX_BATCH_TOKENS, min(DEFAULT_MAX_BATCH_TOKENS, fit))
    if num_blocks is None:
        num_blocks = max(1, budget // (per_token * page_size))
    return num_blocks, max_batch_tokens


class PagedKVCache:
    """Per-layer paged K/V storage, allocated lazily at the first forward."""

    def __init__(self, num_blocks: int, page_size: int, device: torch.device, dtype: torch.dtype) -> None:
        self.num_blocks = num_blocks
        self.page_size = page_size
        self.num_slots = num_blocks * page_size
        self.device = device
        self.dtype = dtype
        self.keys: dict[int, torch.Tensor] = {}  # layer -> [num_slots, Hkv, D]
        self.values: dict[int, torch.Tensor] = {}
        self._layer_ids: dict[int, int] = {}  # id(module) -> layer, for modules without `layer_idx`
        self._specs: dict[int, tuple[int, int]] = {}  # layer -> (num_kv_heads, head_dim), kept across release

    def layer_index(self, module: torch.nn.Module) -> int:
        return self._layer_ids.setdefault(id(module), len(self._layer_ids))

    def layer(self, layer_idx: int, num_kv_heads: int, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
        k = self.keys.get(layer_idx)
        if k is None:
            self._specs[layer_idx] = (num_kv_heads, head_dim)
            # NOTE: empty, not zeros: attention only ever reads slots it has written (padding of a
            # gather repeats a slot of the same request), so memory is touched only as pages are used.
            shape = (self.num_slots, num_kv_heads, head_dim)
            k = self.keys[layer_idx] = torch.empty(shape, device=self.device, dtype=self.dtype)
            self.values[layer_idx] = torch.empty(shape, device=self.device, dtype=self.dtype)
        return k, self.values[layer_idx]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.keys.values(), *self.values.values()))

    def release(self) -> int:
        """Free the tensors (they are allocated again at the next forward); returns the bytes freed."""
        freed = self.nbytes
        self.keys.clear()
        self.values.clear()
        return freed

    def reallocate(self) -> int:
        """Allocate every layer seen before (after `release`); returns the cache's bytes."""
        for layer, (heads, dim) in self._specs.items():
            self.layer(layer, heads, dim)
        return self.nbytes

    def copy_slots(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy KV of slots `src` [n] into slots `dst` [n] in every layer (copy-on-write of a page)."""
        for cache in (*self.keys.values(), *self.values.values()):
            cache.index_copy_(0, dst, cache.index_select(0, src))
