"""The `cpu` attention backend: decode rows through the C++ paged kernel, prompt chunks through SDPA.

Decode rows (one query token each) are attended in place over the paged cache by
`rollout.kernels.cpu_kernels.cascade_decode_attention` (fp32, bf16 and fp16 caches, half precision widened in
the kernel): rows whose page tables name the same full pages (the G samples of a GRPO group forked from
one prompt, prefix-cache hits) read those pages once per step as a group, merged by log-sum-exp with each
row's own pages (equal to the per-row kernel up to float rounding), and so do the slots a group's forks copied
from their leader's partial prompt page (`StepInputs.aliases`: read from the block they were copied from); prompt chunks take the `sdpa` backend's segments (this is `SdpaBackend` with the kernel
set, so its builder emits `PagedDecode` rows instead of decode buckets). The kernel is built once per
machine (see rollout.kernels.cpu_kernels); when it cannot be, `"auto"` picks `sdpa` instead and an explicit
`"cpu"` is a ValueError.
"""

from __future__ import annotations

import dataclasses

import torch

from rollout.attention.backends.sdpa import SdpaBackend
from rollout.kernels import cpu_kernels
from rollout.kv.memory_plan import AttnMemory, KVShape

DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def cpu_kernel(dtype: torch.dtype):
    """The paged (cascade) decode kernel for a `dtype` cache, or None (unsupported dtype, disabled, cannot build)."""
    return cpu_kernels.cascade_decode_attention() if dtype in DTYPES else None


class CpuBackend(SdpaBackend):
    """`sdpa` with decode rows sent to `kernel` (see the module docstring)."""

    name = "cpu"
    supports_sinks = False  # NOTE: the C++ kernel has no sink term; sink models run on `sdpa`
    reads_unwritten_slots = False  # NOTE: the kernel reads each row's own positions only

    def __init__(self, kernel) -> None:
        self.kernel = kernel

    @classmethod
    def create(cls, device: torch.device, dtype: torch.dtype, **_) -> CpuBackend:
        if device.type != "cpu":
            raise ValueError(f"attn_backend='cpu' runs on a CPU only; the model is on {device}")
        kernel = cpu_kernel(dtype)
        if kernel is None:
            raise ValueError(f"attn_backend='cpu' needs rollout's C++ kernel, which is unavailable here for {dtype} "
                             "(ROLLOUT_CPU_KERNELS=0, no compiler, or a failed build: see the warning); "
                             "use attn_backend='sdpa' or 'auto'")
        return cls(kernel)

    @classmethod
    def attn_memory(cls, shape: KVShape, page_size: int, max_batch_tokens: int | None, softcap: bool,
                    max_pages: int) -> AttnMemory:
        # NOTE: decode rows are read in place: only `sdpa`'s prompt-chunk gathers and softcap chunks remain
        return dataclasses.replace(super().attn_memory(shape, page_size, max_batch_tokens, softcap, max_pages),
                                   per_cache_byte=0.0)
