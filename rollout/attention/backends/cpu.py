"""The `cpu` attention backend: decode rows through the C++ paged kernel, prompt chunks through SDPA.

Decode rows (one query token each) are attended in place over the paged cache by
`rollout.kernels.cpu_kernels.cascade_decode_attention` (fp32, bf16 and fp16 caches, half precision widened in
the kernel): rows whose page tables name the same full pages (the G samples of a GRPO group forked from
one prompt, prefix-cache hits) read those pages once per step as a group, merged by log-sum-exp with each
row's own pages (equal to the per-row kernel up to float rounding), and so do the slots a group's forks copied
from their leader's partial prompt page (`StepInputs.aliases`: read from the block they were copied from) and the
slots of a partial page every member reads from one block (a verifying row's tokens, below); prompt chunks
take the `sdpa` backend's segments (this is `SdpaBackend` with the kernel set: its builder emits `PagedDecode` rows
instead of decode buckets). The kernel is built once per machine (see rollout.kernels.cpu_kernels); when it cannot be,
`"auto"` picks `sdpa` instead and an explicit `"cpu"` is a ValueError.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from rollout.attention.backends.base import StepInputs, cache_slots
from rollout.attention.backends.sdpa import GroupMetadata, SdpaBackend, attend_gathered, gather_group_rows
from rollout.kernels import cpu_kernels
from rollout.kv.memory_plan import AttnMemory, KVShape

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# NOTE: a speculative step's rows (`StepInputs.verify`) of at most this many tokens run through the kernel, each
# token a decode query reading keys up to its own position (causal inside the draft): the cascade reads a row's
# keys up to its first token's once for all its tokens (its full pages and its partial page's slots). Longer rows
# take sdpa's segments (0: every verifying step does).
VERIFY_MAX_TOKENS = 33


def cpu_kernel(dtype: torch.dtype):
    """The paged (cascade) decode kernel for a `dtype` cache, or None (unsupported dtype, disabled, cannot build)."""
    return cpu_kernels.cascade_decode_attention() if dtype in DTYPES else None


@dataclass(slots=True)
class PagedDecode:
    """Decode rows attended in place over the paged cache by `rollout.kernels.cpu_kernels.paged_decode_attention`."""

    rows: torch.Tensor  # [n] packed rows of the queries
    table: torch.Tensor  # [R, P] page tables (int32 or int64)
    row: torch.Tensor  # [n] row of `table` of each query's request
    start: torch.Tensor  # [n] first position read (> 0 once a sliding window has moved on)
    end: torch.Tensor  # [n] one past the last position read (the row's own, just written)
    all_rows: bool = False  # every packed row, in order (a decode-only step): read and written in place
    alias: torch.Tensor | None = None  # [n, 3] forks' copied partial pages (`StepInputs.aliases`), or None


@dataclass(slots=True)
class CpuGroupMetadata(GroupMetadata):
    """`sdpa`'s group metadata (slots, prompt segments) plus the decode rows the kernel reads in place."""

    paged: PagedDecode | None = None


def build_cpu_group(window: int | None, step: StepInputs, ps: int) -> CpuGroupMetadata:
    """Slots, kernel decode rows and prompt segments of one layer group (reads `step.tables[window]`)."""
    table = step.tables[window]  # [R, P] int32
    alias = None if step.aliases is None else step.aliases[window]
    if step.decode_only:  # NOTE: the common step, no Python loop over the requests
        g = CpuGroupMetadata(window, cache_slots(table, step.rows[step.request_of_token], step.positions, ps))
        # NOTE: the query at `start` sees keys from start - window + 1 on (HF: j > i - window).
        lo = torch.zeros_like(step.starts) if window is None else (step.starts - (window - 1)).clamp_min(0)
        g.paged = PagedDecode(step.request_of_token, table, step.rows, lo, step.starts + 1, all_rows=True, alias=alias)
        return g
    if step.verify and max(step.lens_list) <= VERIFY_MAX_TOKENS:
        return verify_group(window, step, table, alias, ps)
    g, decode = gather_group_rows(CpuGroupMetadata, window, step, ps)
    if decode:
        dev = step.device
        reqs = torch.tensor([c[1] for c in decode], device=dev)
        lo = torch.tensor([c[2] for c in decode], device=dev)
        g.paged = PagedDecode(step.starts.new_tensor([step.first_row[c[1]] for c in decode]),
                              table, step.rows[reqs], lo, lo + torch.tensor([c[0] for c in decode], device=dev),
                              alias=None if alias is None else alias[reqs])
    return g


def verify_group(window: int | None, step: StepInputs, table: torch.Tensor, alias: torch.Tensor | None,
                 ps: int) -> CpuGroupMetadata:
    """Every token of a verifying step a kernel query of its own: token t of row b reads positions
    [lo, positions[t]] of b's table row (its draft's earlier tokens were written before the attention)."""
    of = step.request_of_token  # [T]
    rows, pos = step.rows[of], step.positions  # [T], [T]
    g = CpuGroupMetadata(window, cache_slots(table, rows, pos, ps))
    lo = torch.zeros_like(pos) if window is None else (pos - (window - 1)).clamp_min(0)
    g.paged = PagedDecode(torch.arange(len(pos), device=pos.device), table, rows, lo, pos + 1, all_rows=True,
                          alias=None if alias is None else alias.index_select(0, of))
    return g


def static_group(window: int | None, slots: torch.Tensor, table: torch.Tensor, rows: torch.Tensor,
                 start: torch.Tensor, end: torch.Tensor) -> CpuGroupMetadata:
    """A decode-only group over persistent buffers (`rollout.model.static_decode`): query row i is table row
    `rows[i]`, writes its token at `slots[i]` and reads positions [start[i], end[i]); built once, read every step."""
    g = CpuGroupMetadata(window, slots)
    g.paged = PagedDecode(rows, table, rows, start, end, all_rows=True)
    return g


def cpu_attend(kernel, meta, group: CpuGroupMetadata, query, key, value, k_cache, v_cache, scale: float,
               softcap: float | None) -> torch.Tensor:  # [T, H, D]
    """Kernel rows in place over the pages, then `sdpa`'s prompt segments (`query` [1, H, T, D])."""
    q_rows = query[0].transpose(0, 1)  # [T, H, D]
    out = q_rows.new_empty(q_rows.shape)  # [T, H, D], contiguous: HF's reshape after attention is then a view
    pd = group.paged
    if pd is not None:  # NOTE: half-precision K/V are widened in the kernel
        ps, cap = meta.cache.page_size, float(softcap or 0.0)
        if pd.all_rows and out.dtype is torch.float32:  # NOTE: a decode-only step: no gather, no scatter
            kernel(q_rows.contiguous(), k_cache, v_cache, pd.table, pd.row, pd.start, pd.end, ps, scale, cap, out,
                   pd.alias)
        else:
            q = q_rows.index_select(0, pd.rows).float()  # [n, H, D]
            o = torch.empty_like(q)
            kernel(q, k_cache, v_cache, pd.table, pd.row, pd.start, pd.end, ps, scale, cap, o, pd.alias)
            out.index_copy_(0, pd.rows, o.to(out.dtype))
    attend_gathered(out, q_rows, group, key, value, k_cache, v_cache, scale, softcap)
    return out


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

    def build_group(self, window: int | None, tables: list[list[int]], step: StepInputs,
                    page_size: int) -> CpuGroupMetadata:
        return build_cpu_group(window, step, page_size)

    def static_group(self, window, slots, table, rows, start, end) -> CpuGroupMetadata:
        """Decode rows over persistent buffers (see `static_group`)."""
        return static_group(window, slots, table, rows, start, end)

    def attend(self, meta, group, layer, query, key, value, k_cache, v_cache, scale, softcap,
               sinks: torch.Tensor | None = None) -> torch.Tensor:
        if sinks is not None:
            raise ValueError("rollout's C++ decode kernel does not implement attention sinks")
        return cpu_attend(self.kernel, meta, group, query, key, value, k_cache, v_cache, scale, softcap)
