"""The `flash` attention backend: flash-attn over the paged cache, CUDA only.

Not implemented yet (no GPU has been available to verify it): on CUDA `"auto"` picks `flex`. Asking
for `"flash"` is a ValueError naming `attn_backend` that says why it cannot run here. The plan
(benchmarks/device_check.sh runs its test the first time a GPU is lent): `flash_attn_varlen_func`
with `block_table` over the cache viewed as `[num_blocks, page_size, Hkv, D]` (pages of 256 tokens,
flash-attn's paged-KV granularity), softcap through its `softcap` argument, windows through
`window_size=(W - 1, 0)`.
"""

from __future__ import annotations

import importlib.util

import torch

from rollout.kv.memory_plan import AttnMemory, KVShape


def flash_available() -> bool:
    """flash-attn is importable and a CUDA device is present."""
    return torch.cuda.is_available() and importlib.util.find_spec("flash_attn") is not None


class FlashBackend:
    """The planned flash-attn backend (see the module docstring): `create` always refuses."""

    name = "flash"
    supports_sinks = False  # NOTE: flash-attn has no sink term; sink models run on `sdpa`
    reads_unwritten_slots = False  # NOTE: flash-attn reads each request's first `seqlens_k` keys only

    @classmethod
    def create(cls, device: torch.device, dtype: torch.dtype, **_) -> FlashBackend:
        if device.type != "cuda":
            raise ValueError(f"attn_backend='flash' needs a CUDA device; the model is on {device}")
        if not flash_available():
            raise ValueError("attn_backend='flash' needs the flash-attn package (pip install 'rollout[gpu]')")
        raise ValueError("attn_backend='flash' is not implemented yet in this version of rollout; "
                         "use attn_backend='flex' (the CUDA default)")

    @classmethod
    def attn_memory(cls, shape: KVShape, page_size: int, max_batch_tokens: int | None, softcap: bool,
                    max_pages: int) -> AttnMemory:
        # NOTE: flash-attn reads the pages in place through the page tables: no gather, no score tensor
        return AttnMemory()

    def build_group(self, window, tables, step, page_size):
        raise NotImplementedError("attn_backend='flash' is not implemented yet")

    def attend(self, meta, group, layer, query, key, value, k_cache, v_cache, scale, softcap, sinks=None):
        raise NotImplementedError("attn_backend='flash' is not implemented yet")
