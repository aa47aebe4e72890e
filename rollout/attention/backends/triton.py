"""The `triton` attention backend: decode rows and prompt chunks through Triton kernels over the paged cache.

The GPU shape of the `cpu` backend: the same metadata (`rollout.attention.backends.cpu.build_cpu_group`: each
decode row's page-table row and [start, end) of positions, read in place over the paged cache), attended by
`rollout.kernels.triton_decode.paged_decode_attention` instead of the C++ kernel, with gpt-oss's attention sinks;
decode rows whose page tables name the same full pages (a GRPO group's forks, prefix-cache hits) as the C++ backend's
cascade: `plan_cascades` (the C++ kernel's grouping, on the host page tables `build_group` is given: no device read)
makes the groups, `rollout.kernels.triton_cascade.cascade_decode_attention` reads each group's shared pages once
(forks read their own copy of the leader's partial page: the C++ kernel's aliases are not used); prompt chunks
(prefill and chunked prefill) by `rollout.kernels.triton_prefill.paged_prefill_attention`, causal over the same pages
(their own K/V written there first), instead of `sdpa`'s gathered segments. Runs on CUDA, and on a
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
    """The `cpu` group's decode rows, its prompt chunks for the varlen kernel (none left to `sdpa`), and the decode
    rows' cascade groups with their host ends (`cascade_decode_attention`'s `groups` and `ends`)."""

    prefill: PagedPrefill | None = None
    cascade: list[tuple[int, int, list[int]]] | None = None  # (first shared page, shared pages, member rows)
    ends: list[int] | None = None  # [n] each decode row's `end`, host ints


def plan_cascades(tables: list[list[int]], lo: list[int], hi: list[int], ps: int) -> list[tuple[int, int, list[int]]]:
    """The C++ kernel's cascade groups (`plan_cascades` in csrc/decode_attention.cpp) of decode rows reading
    positions [lo[i], hi[i]) through page table `tables[i]`: (first shared page, shared full pages, member rows).
    Only full pages inside every member's range are shared; rows sorted by their full pages' blocks, a run split
    where keeping a row would read more keys than taking it out; a group has >= 2 rows and >= 1 page. (The C++
    kernel goes on to share a partial page every member reads from one block, `extend_cascades` and
    `add_partial_cascades` there; the Triton cascade reads full pages only.)"""
    first = [(a + ps - 1) // ps for a in lo]
    full = [b // ps - f for b, f in zip(hi, first, strict=True)]
    idx = sorted((i for i in range(len(lo)) if full[i] > 0),
                 key=lambda i: (first[i], tables[i][first[i]:first[i] + full[i]]))
    out: list[tuple[int, int, list[int]]] = []
    rows: list[int] = []
    start = pages = sum_full = 0
    for i in idx:
        blocks = tables[i][first[i]:first[i] + full[i]]
        if rows:
            prev, common = rows[-1], 0
            if first[prev] == first[i]:
                shared = tables[prev][first[prev]:first[prev] + min(pages, full[i])]
                while common < len(shared) and shared[common] == blocks[common]:
                    common += 1
            m = len(rows)
            if common >= 1 and common + sum_full + full[i] - (m + 1) * common <= pages + sum_full - m * pages + full[i]:
                pages, sum_full = common, sum_full + full[i]
                rows.append(i)
                continue
            if len(rows) >= 2:
                out.append((start, pages, rows))
        start, pages, rows, sum_full = first[i], full[i], [i], full[i]
    if len(rows) >= 2:
        out.append((start, pages, rows))
    return out


def _decode_rows(step: StepInputs) -> list[int]:
    """The requests whose one query token the decode kernel attends, in its row order."""
    return list(range(len(step.lens_list))) if step.decode_only else [
        b for b, n in enumerate(step.lens_list) if n == 1]


def build_triton_group(window: int | None, step: StepInputs, ps: int, tables: list[list[int]] | None = None
                       ) -> CpuGroupMetadata:
    """The `cpu` group, its prompt chunks for the varlen kernel, and with `tables` (the requests' host page tables)
    its decode rows' cascade groups."""
    g = build_cpu_group(window, step, ps)
    cascade = ends = None
    if tables is not None and g.paged is not None:
        reqs = _decode_rows(step)
        ends = [step.starts_list[b] + 1 for b in reqs]
        lo = [0 if window is None else max(0, e - window) for e in ends]
        cascade = plan_cascades([tables[b] for b in reqs], lo, ends, ps) or None
    if not g.segments and cascade is None:
        return g
    prefill = None
    if g.segments:
        chunks = [b for b, n in enumerate(step.lens_list) if n > 1]
        dev = step.device
        prefill = PagedPrefill(step.tables[window], step.rows[int_tensor(chunks, dev)],
                               int_tensor([step.first_row[b] for b in chunks], dev),
                               int_tensor([step.starts_list[b] for b in chunks], dev),
                               [step.lens_list[b] for b in chunks])
    fields = {f.name: getattr(g, f.name) for f in dataclasses.fields(g)}
    return TritonGroupMetadata(**{**fields, "segments": []}, prefill=prefill, cascade=cascade, ends=ends)


def triton_attend(kernel, prefill_kernel, meta, group: CpuGroupMetadata, query, key, value, k_cache, v_cache,
                  scale: float, softcap: float | None, sinks: torch.Tensor | None,
                  cascade_kernel=None) -> torch.Tensor:  # [T, H, D]
    """Decode rows (through `cascade_kernel` where the group has cascade groups) and prompt chunks in place over the
    pages (`query` [1, H, T, D])."""
    q_rows = query[0].transpose(0, 1)  # [T, H, D]
    out = q_rows.new_empty(q_rows.shape)  # [T, H, D]
    pd = group.paged
    if pd is not None:  # NOTE: forks' aliases are a cascade-only shortcut: each row reads its own copy here
        cap = float(softcap or 0.0)
        groups = getattr(group, "cascade", None)
        if groups and cascade_kernel is not None:  # NOTE: the groups' shared pages read once for all their rows
            q = q_rows if pd.all_rows else q_rows.index_select(0, pd.rows)  # [n, H, D]
            o = out if pd.all_rows else torch.empty_like(q)
            cascade_kernel(q, k_cache, v_cache, pd.table, pd.row, pd.start, pd.end, meta.cache.page_size, scale, cap,
                           o, groups, sinks, ends=group.ends)
            if not pd.all_rows:
                out.index_copy_(0, pd.rows, o)
        elif pd.all_rows:  # NOTE: a decode-only step: every packed row, written in place
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
        backend.cascade_kernel = importlib.import_module("rollout.kernels.triton_cascade").cascade_decode_attention
        return backend

    prefill_kernel = None  # NOTE: `rollout.kernels.triton_prefill.paged_prefill_attention`, set by `create`
    cascade_kernel = None  # NOTE: `rollout.kernels.triton_cascade.cascade_decode_attention`; None: no cascade

    def build_group(self, window: int | None, tables: list[list[int]], step: StepInputs,
                    page_size: int) -> CpuGroupMetadata:
        return build_triton_group(window, step, page_size, tables if self.cascade_kernel is not None else None)

    def attend(self, meta, group, layer, query, key, value, k_cache, v_cache, scale, softcap,
               sinks: torch.Tensor | None = None) -> torch.Tensor:
        return triton_attend(self.kernel, self.prefill_kernel, meta, group, query, key, value, k_cache, v_cache, scale,
                             softcap, sinks, self.cascade_kernel)
