"""The `triton` attention backend: decode rows and prompt chunks through Triton kernels over the paged cache.

The GPU shape of the `cpu` backend: the same metadata (`rollout.attention.backends.cpu.build_cpu_group`: each
decode row's page-table row and [start, end) of positions, read in place over the paged cache), attended by
`rollout.kernels.triton_decode.paged_decode_attention` instead of the C++ kernel, with gpt-oss's attention sinks;
prompt chunks (prefill and chunked prefill) by `rollout.kernels.triton_prefill.paged_prefill_attention`, causal
over the same pages (their own K/V written there first), instead of `sdpa`'s gathered segments. Runs on CUDA, and on a
CPU under Triton's interpreter (`TRITON_INTERPRET=1` before triton is imported: the tests' exactness path, slow). Chosen
by name only: `"auto"` never picks it. Needs the `triton` extra (`pip install 'rollout[triton]'`); without it
`attn_backend='triton'` is a ValueError naming the extra.
"""

from __future__ import annotations

import dataclasses
import importlib
from dataclasses import dataclass

import torch

from rollout.attention.backends.base import StepInputs
from rollout.attention.backends.cpu import DTYPES, CpuBackend, CpuGroupMetadata, build_cpu_group
from rollout.attention.backends.sdpa import attend_gathered
from rollout.tensors import int_tensor


@dataclass(slots=True)
class PagedPrefill:
    """The step's prompt chunks of one layer group, for the varlen kernel: sequence b is `lens[b]` packed rows from
    `q_start[b]`, at positions from `pos_start[b]`, its keys in page-table row `row[b]` of `table`."""

    table: torch.Tensor  # [R, P]
    row: torch.Tensor  # [B]
    q_start: torch.Tensor  # [B]
    pos_start: torch.Tensor  # [B]
    lens: list[int]


@dataclass(slots=True)
class TritonGroupMetadata(CpuGroupMetadata):
    """The `cpu` group's decode rows, and its prompt chunks for the varlen kernel (none left to `sdpa`)."""

    prefill: PagedPrefill | None = None


def build_triton_group(window: int | None, step: StepInputs, ps: int) -> CpuGroupMetadata:
    g = build_cpu_group(window, step, ps)
    if not g.segments:
        return g
    chunks = [b for b, n in enumerate(step.lens_list) if n > 1]
    dev = step.device
    prefill = PagedPrefill(step.tables[window], step.rows[int_tensor(chunks, dev)],
                           int_tensor([step.first_row[b] for b in chunks], dev),
                           int_tensor([step.starts_list[b] for b in chunks], dev), [step.lens_list[b] for b in chunks])
    fields = {f.name: getattr(g, f.name) for f in dataclasses.fields(g)}
    return TritonGroupMetadata(**{**fields, "segments": []}, prefill=prefill)


def triton_attend(kernel, prefill_kernel, meta, group: CpuGroupMetadata, query, key, value, k_cache, v_cache,
                  scale: float, softcap: float | None, sinks: torch.Tensor | None) -> torch.Tensor:  # [T, H, D]
    """Decode rows and prompt chunks in place over the pages (`query` [1, H, T, D])."""
    q_rows = query[0].transpose(0, 1)  # [T, H, D]
    out = q_rows.new_empty(q_rows.shape)  # [T, H, D]
    pd = group.paged
    if pd is not None:  # NOTE: forks' aliases are a cascade-only shortcut: each row reads its own copy here
        cap = float(softcap or 0.0)
        if pd.all_rows:  # NOTE: a decode-only step: every packed row, written in place
            kernel(q_rows, k_cache, v_cache, pd.table, pd.row, pd.start, pd.end, meta.cache.page_size, scale, cap,
                   out, sinks)
        else:
            q = q_rows.index_select(0, pd.rows)  # [n, H, D]
            o = torch.empty_like(q)
            kernel(q, k_cache, v_cache, pd.table, pd.row, pd.start, pd.end, meta.cache.page_size, scale, cap, o,
                   sinks)
            out.index_copy_(0, pd.rows, o)
    pf = getattr(group, "prefill", None)
    if pf is not None:  # NOTE: every prompt chunk in one launch, in place over the pages, into its rows of `out`
        prefill_kernel(q_rows, k_cache, v_cache, pf.table, pf.row, pf.q_start, pf.pos_start, pf.lens,
                       meta.cache.page_size, scale, float(softcap or 0.0), group.window, out, sinks)
    attend_gathered(out, q_rows, group, key, value, k_cache, v_cache, scale, softcap, sinks)
    return out


class TritonBackend(CpuBackend):
    """The `cpu` backend's metadata and memory plan, decode rows sent to the Triton kernel (see the module
    docstring)."""

    name = "triton"
    supports_sinks = True  # NOTE: the kernel's sink term; prompt chunks use `sdpa`'s explicit softmax

    @classmethod
    def create(cls, device: torch.device, dtype: torch.dtype, **_) -> TritonBackend:
        try:
            triton_decode = importlib.import_module("rollout.kernels.triton_decode")
        except ImportError as e:
            raise ValueError(f"attn_backend='triton' needs the triton extra ({e}); "
                             "pip install 'rollout[triton]', or use attn_backend='auto'") from e
        if dtype not in DTYPES:
            raise ValueError(f"attn_backend='triton' supports fp32, bf16 and fp16 caches, got {dtype}")
        if not triton_decode.available(device):
            raise ValueError(f"attn_backend='triton' runs on CUDA (or on a CPU under Triton's interpreter, "
                             f"TRITON_INTERPRET=1, for tests); the model is on {device}")
        backend = cls(triton_decode.paged_decode_attention)
        backend.prefill_kernel = importlib.import_module("rollout.kernels.triton_prefill").paged_prefill_attention
        return backend

    prefill_kernel = None  # NOTE: `rollout.kernels.triton_prefill.paged_prefill_attention`, set by `create`

    def build_group(self, window: int | None, tables: list[list[int]], step: StepInputs,
                    page_size: int) -> CpuGroupMetadata:
        return build_triton_group(window, step, page_size)

    def attend(self, meta, group, layer, query, key, value, k_cache, v_cache, scale, softcap,
               sinks: torch.Tensor | None = None) -> torch.Tensor:
        return triton_attend(self.kernel, self.prefill_kernel, meta, group, query, key, value, k_cache, v_cache, scale,
                             softcap, sinks)
