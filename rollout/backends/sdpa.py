"""The `sdpa` attention backend: gather each request's pages and run torch SDPA (the portable reference).

Prompt chunks attend one segment at a time against their own KV (this step's fresh K/V when nothing
is cached yet, else a gather of the request's slots); decode rows are batched in buckets of similar
KV length, their KV gathered into `[B, Hkv, Lmax, D]` and attended with a key-padding mask. The
metadata is `rollout.attention.GroupMetadata` (built by `rollout.runner._build_group`); the forward
is `rollout.attention.gather_attend`. Runs on any device.
"""

from __future__ import annotations

import torch

from ..attention import GroupMetadata, gather_attend


class SdpaBackend:
    """Gather + SDPA; holds no state."""

    name = "sdpa"
    reads_unwritten_slots = False  # NOTE: padding of a gather repeats a written slot
    kernel = None  # NOTE: CpuBackend sets the C++ decode kernel
    supports_sinks = True  # NOTE: gpt-oss sinks in the explicit softmax of `_attend`

    def build_group(self, window: int | None, tables: list[list[int]], step, page_size: int) -> GroupMetadata:
        from ..runner import _build_group

        return _build_group(window, tables, step, page_size, paged=self.kernel is not None)

    def attend(self, meta, group, layer, query, key, value, k_cache, v_cache, scale, softcap,
               sinks: torch.Tensor | None = None) -> torch.Tensor:
        return gather_attend(meta, group, layer, query, key, value, k_cache, v_cache, scale, softcap, self.kernel,
                             sinks)
