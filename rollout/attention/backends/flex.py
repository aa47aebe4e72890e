"""The `flex` attention backend: torch FlexAttention over the paged cache, one compiled call per layer.

The whole cache of a layer, `[Hkv, num_slots, D]`, is FlexAttention's key/value sequence (batch 1),
and the step's packed queries `[1, H, T, D]` its query sequence, prompt chunks and decode rows alike.
A KV block of the block mask is one page: `FlexMetadata` lists, for each tile of `Q_BLOCK` query rows,
the pages its requests may read (built from the page tables with tensor ops, no host sync), and the
mask mod keeps, inside those pages, the keys of the row's own request at positions
`lo <= kpos <= pos` (causal; `lo > 0` once a sliding window has moved on). A page's logical position
comes from `logical[page]`; its owner from the request's page table (`table[req, logical] == page`),
so rows of different requests may share a tile. Gemma 2's logit softcap is a score mod.

The kernel is `torch.compile`d once per static configuration (page size, softcap, head layout,
dtype); the number of query rows and of query tiles are dynamic, so steps of any size reuse it.
On CPU the first compile takes ~10-25 s (inductor's C++ template; cached on disk afterwards).

Owns its metadata (`FlexMetadata`, `FlexGroup`), their builder, the compiled kernel and its memory
plan; the slot arithmetic is `rollout.attention.backends.base.cache_slots`, shared with `sdpa`.
"""

from __future__ import annotations

import functools
import types
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch.nn.attention.flex_attention import BlockMask, flex_attention

from rollout.attention.backends.base import StepInputs, cache_slots
from rollout.kv.memory_plan import AttnMemory, KVShape
from rollout.kv.page_tables import FREED
from rollout.tensors import int_tensor

# NOTE: query rows per tile of the block mask. Rows of one tile read the union of their requests'
# pages (masked per row), so a small tile keeps decode rows from reading each other's pages.
Q_BLOCK = 16
# NOTE: FREED (-1) marks a table entry with no page; it also pads the mask mod's flattened tables.
# NOTE: smallest static sizes of the mask mod's tables (rows, flattened page tables, pages): a new
# size is a new compile, so they start large enough for the default engine (8192 tokens a step).
ROW_FLOOR, TABLE_FLOOR, PAGE_FLOOR = 8192, 16384, 65536


@dataclass(slots=True)
class FlexMetadata:
    """One layer group's inputs of the compiled kernel, built once per step (see `build_flex_metadata`).

    NOTE: the mask mod's tables have static sizes (capacities): inductor's CPU template cannot take
    dynamically sized captured buffers, and a static size means one compile for every step.
    """

    kv_num_blocks: torch.Tensor  # [1, 1, NQB] int32: pages each query tile reads
    kv_indices: torch.Tensor  # [1, 1, NQB, num_pages] int32: those pages first, in increasing order
    base: torch.Tensor  # [row_capacity] int32: offset of each query row's page table in `tables`
    pos: torch.Tensor  # [row_capacity] int32: position of each query row (-1 past the step's rows)
    lo: torch.Tensor  # [row_capacity] int32: first position the row may read (its window's start)
    tables: torch.Tensor  # [table_capacity] int32: the page tables [R, P] flattened, FREED where no page
    logical: torch.Tensor  # [page_capacity] int32: logical page index of each page read this step, else -1
    num_rows: int  # T: the step's query rows (max(T, 2) are passed to the kernel)
    q_block: int  # query rows per tile


def capacity(n: int, floor: int) -> int:
    """A static size for `n` items: the next power of two, at least `floor` (few sizes, few compiles)."""
    return max(floor, 1 << max(0, n - 1).bit_length())


def build_flex_metadata(
    table: torch.Tensor,  # [R, P] int: page tables, FREED (-1) where no page
    starts: torch.Tensor,  # [R] int: first position computed this step
    lens: torch.Tensor,  # [R] int: query tokens this step (>= 1 each)
    num_rows: int,  # T = lens.sum(), known on the host
    page_size: int,
    num_pages: int,
    window: int | None,
    row_capacity: int | None = None,
    q_block: int = Q_BLOCK,
) -> FlexMetadata:
    """Block mask and mask-mod tables of one layer group; tensor ops only (no host synchronisation).

    `row_capacity` (an engine passes its `max_batch_tokens`) bounds the rows of every step, so every
    step shares one compiled kernel (see ROW_FLOOR).

    NOTE: a page read this step sits at one logical index in every table that reads it: shared
    prefix pages are content-addressed by position, copies-on-write keep the index, and a page a
    sliding window recycled is FREED in its old table, outside the range read below.
    """
    dev = table.device
    ps = page_size
    r, p = table.shape
    table = table.to(torch.int32)
    rows = max(num_rows, 2)  # NOTE: FlexAttention's compiled kernel would specialise on sizes 0/1
    row_capacity = capacity(max(row_capacity or 0, rows), ROW_FLOOR)
    req = torch.repeat_interleave(torch.arange(r, device=dev), lens.long(), output_size=num_rows)  # [T]
    first = torch.cumsum(lens, 0) - lens  # [R]
    pos = starts[req] + torch.arange(num_rows, device=dev) - first[req]  # [T]
    lo = torch.zeros_like(pos) if window is None else (pos - window + 1).clamp(min=0)  # [T]
    # pages each row reads: logical j in [lo // ps, pos // ps] of its request's table
    j = torch.arange(p, device=dev)
    reads = (j[None, :] >= (lo // ps)[:, None]) & (j[None, :] <= (pos // ps)[:, None])  # [T, P]
    pages = torch.where(reads, table.index_select(0, req).long(), num_pages)  # [T, P], num_pages = none
    nqb = max(2, -(-rows // q_block))
    pages = torch.nn.functional.pad(pages, (0, 0, 0, nqb * q_block - num_rows), value=num_pages)
    tile = pages.view(nqb, q_block * p).sort(-1).values  # [NQB, q_block * P]
    dup = torch.zeros_like(tile, dtype=torch.bool)
    dup[:, 1:] = tile[:, 1:] == tile[:, :-1]
    tile = torch.where(dup, num_pages, tile).sort(-1).values
    kv_num_blocks = (tile < num_pages).sum(-1, dtype=torch.int32)  # [NQB]
    # NOTE: the CPU kernel wants the dense width (num_pages columns); unused entries are never read.
    width = min(tile.shape[1], num_pages)
    kv_indices = torch.zeros(nqb, num_pages, dtype=torch.int32, device=dev)
    kv_indices[:, :width] = tile[:, :width].clamp(max=num_pages - 1)
    # logical index of every page read this step (per request: from its first row's window start)
    first_lo = lo[first]  # [R]
    end = starts + lens  # [R]
    live = (j[None, :] >= (first_lo // ps)[:, None]) & (j[None, :] * ps < end[:, None]) & (table >= 0)  # [R, P]
    logical = torch.full((capacity(num_pages + 1, PAGE_FLOOR),), -1, dtype=torch.int32, device=dev)
    dst = torch.where(live, table.long(), num_pages).reshape(-1)  # NOTE: slot num_pages collects the rest
    logical.scatter_(0, dst, j.to(torch.int32).expand(r, p).reshape(-1))
    logical.narrow(0, num_pages, 1).fill_(-1)  # NOTE: `logical[i] = -1` copies a host scalar: a sync on CUDA
    return FlexMetadata(
        kv_num_blocks=kv_num_blocks[None, None],
        kv_indices=kv_indices[None, None],
        base=_fill(req.to(torch.int32) * p, row_capacity, 0),
        pos=_fill(pos.to(torch.int32), row_capacity, -1),  # NOTE: padding rows see no key (pos < lo)
        lo=_fill(lo.to(torch.int32), row_capacity, 0),
        tables=_fill(table.reshape(-1), capacity(r * p, TABLE_FLOOR), FREED),
        logical=logical,
        num_rows=num_rows,
        q_block=q_block,
    )


def _fill(x: torch.Tensor, size: int, value: int) -> torch.Tensor:
    """`x` [n] padded with `value` to [size]."""
    return torch.nn.functional.pad(x, (0, size - x.numel()), value=value)


def flex_paged_attention(
    query: torch.Tensor,  # [1, H, T, D], already scaled by the layer's `scaling`
    k_cache: torch.Tensor,  # [Hkv, num_slots, D]
    v_cache: torch.Tensor,  # [Hkv, num_slots, D]
    meta: FlexMetadata,
    page_size: int,
    softcap: float | None,
) -> torch.Tensor:  # [1, H, T, D]
    """Attend every query row of the step over the paged cache in one compiled FlexAttention call."""
    t = meta.num_rows
    q = query if t >= 2 else torch.cat([query, query], 2)  # NOTE: see build_flex_metadata
    if k_cache.dtype != q.dtype:  # NOTE: the CPU kernel needs one dtype for q, k and v
        q = q.to(k_cache.dtype)
    fn = _kernel(page_size, meta.q_block, float(softcap) if softcap else 0.0, q.device.type)
    # NOTE: dynamic: the step's rows and tiles, and the cache's size (engines of any size share a
    # kernel); the mask mod's tables have static capacities (see FlexMetadata).
    k, v = k_cache[None], v_cache[None]
    for x in (q, meta.kv_num_blocks, meta.kv_indices, k, v):
        torch._dynamo.maybe_mark_dynamic(x, 2)
    torch._dynamo.maybe_mark_dynamic(meta.kv_indices, 3)
    out = fn(q, k, v, meta.kv_num_blocks, meta.kv_indices, meta.base, meta.pos,
             meta.lo, meta.tables, meta.logical)
    return out[:, :, :t].to(query.dtype)


def gpu_kernel_options(page_size: int, q_block: int) -> dict:
    """Triton tile sizes for the block mask's (q_block, page) blocks.

    NOTE: torch's GPU FlexAttention kernels need the block mask's block sizes to be multiples of the
    kernel's tiles (BLOCK_M x BLOCK_N; its defaults, 64-128, refuse 16-row tiles): the query tile is one
    block-mask row tile, and the key tile the largest power of two dividing the page, at most 64
    (a 256-token tile of K and V would not fit in shared memory). `FORCE_USE_FLEX_ATTENTION` keeps
    short steps on the same kernel family (the decoding kernel has other tile rules)."""
    block_n = min(64, page_size & -page_size)
    if block_n < 16:
        raise ValueError(f"attn_backend='flex' on CUDA needs a page_size divisible by 16, got {page_size}")
    return {"BLOCK_M": q_block, "BLOCK_N": block_n, "FORCE_USE_FLEX_ATTENTION": True}


@functools.cache
def _kernel(page_size: int, q_block: int, softcap: float, device_type: str = "cpu"):
    """The compiled kernel of one static configuration (NOTE: each has its own code object, so its own
    dynamo cache and recompile budget: see `_renamed`)."""
    ps = page_size
    options = gpu_kernel_options(ps, q_block) if device_type == "cuda" else None

    def paged(q, k, v, kv_num_blocks, kv_indices, base, pos, lo, tables, logical):
        def mask_mod(b, h, q_idx, kv_idx):
            page = kv_idx // ps
            lp = logical[page]
            kpos = lp * ps + kv_idx % ps
            # NOTE: the row's own table holds this page at `lp` (lp <= pos // ps keeps the read in it)
            mine = tables[(base[q_idx] + lp).clamp(0, tables.shape[0] - 1)] == page
            return mine & (kpos <= pos[q_idx]) & (kpos >= lo[q_idx])

        def softcap_mod(score, b, h, q_idx, kv_idx):
            return torch.tanh(score / softcap) * softcap

        block_mask = BlockMask.from_kv_blocks(
            kv_num_blocks, kv_indices, BLOCK_SIZE=(q_block, ps), mask_mod=mask_mod,
            seq_lengths=(q.shape[2], k.shape[2]), compute_q_blocks=False,
        )
        return flex_attention(q, k, v, score_mod=softcap_mod if softcap else None, block_mask=block_mask,
                              scale=1.0, enable_gqa=q.shape[1] != k.shape[1], kernel_options=options)

    tag = f"paged_flex_ps{ps}_q{q_block}_cap{softcap:g}_{device_type}".replace(".", "_")
    return torch.compile(_renamed(paged, tag), fullgraph=True)


def _renamed(fn, name: str):
    """`fn` under its own code object and name. NOTE: dynamo keys its compile cache on the code
    object and its automatic-dynamic memory on (file, line, name): without this, one configuration's
    constants (the softcap) would turn symbolic when another's are seen, which the kernel refuses."""
    code = fn.__code__.replace(co_name=name, co_qualname=name)
    return types.FunctionType(code, fn.__globals__, name, fn.__defaults__, fn.__closure__)


@dataclass(slots=True)
class FlexGroup:
    """The `flex` backend's metadata of one layer group for one step."""

    window: int | None  # the layers' sliding window, None for full attention
    slot_mapping: torch.Tensor  # [T] cache slot of each new token
    flex: FlexMetadata


@dataclass
class FlexBackend:
    """FlexAttention over the paged cache (see the module docstring).

    Args:
        page_size, num_pages: the cache's pages (a page is one KV block of the block mask).
        max_batch_tokens: the engine's step budget: the static size of the per-row mask tables.
        device: where the cache lives.
    """

    page_size: int
    num_pages: int
    max_batch_tokens: int
    device: torch.device
    name: ClassVar[str] = "flex"
    supports_sinks: ClassVar[bool] = False  # NOTE: no sink term in the kernel; sink models run on `sdpa`
    reads_unwritten_slots: ClassVar[bool] = True  # NOTE: a page's unwritten slots get weight 0, and 0 * NaN = NaN

    @classmethod
    def create(cls, device: torch.device, dtype: torch.dtype, page_size: int = 16, num_pages: int = 1,
               max_batch_tokens: int = 8192, **_) -> FlexBackend:
        if device.type not in ("cpu", "cuda"):
            raise ValueError(f"attn_backend='flex' runs on CPU or CUDA; the model is on {device}")
        if dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise ValueError(f"attn_backend='flex' needs a float32, bfloat16 or float16 model, got {dtype}")
        if device.type == "cuda":
            gpu_kernel_options(page_size, Q_BLOCK)  # NOTE: the page-size check, before any compile
        if device.type == "cpu" and not _has_cxx():
            raise ValueError("attn_backend='flex' on CPU compiles a C++ kernel and no C++ compiler was found; "
                             "use attn_backend='sdpa'")
        return cls(page_size, num_pages, max_batch_tokens, device)

    @classmethod
    def attn_memory(cls, shape: KVShape, page_size: int, max_batch_tokens: int | None, softcap: bool,
                    max_pages: int) -> AttnMemory:
        # NOTE: int64 candidate pages [T, P] and its sorted copies; the mask mod's int32 tables; the
        # int32 kv_indices [T / Q_BLOCK, num_pages] (a share of the cache's pages).
        page_bytes = page_size * shape.bytes_per_token
        tokens = max_batch_tokens or 8192
        return AttnMemory(per_query_token=4 * 8 * max_pages, fixed=4 * (3 * ROW_FLOOR + TABLE_FLOOR + PAGE_FLOOR),
                          per_cache_byte=4 * tokens / Q_BLOCK / page_bytes)

    def build_group(self, window: int | None, tables: list[list[int]], step: StepInputs,
                    page_size: int) -> FlexGroup:
        dev, ps = self.device, self.page_size
        # NOTE: the persistent table (rollout.kv.device_page_tables: on the device, updated by the pages appended), the
        # step's rows narrowed to its widest request; nothing is rebuilt from the lists. Entries past a
        # request's own pages (zeros, or a previous owner's) are never read: rows read logical pages up to
        # their position only, and `live` stops at each request's end (build_flex_metadata).
        width = max(len(t) for t in tables)
        table = step.tables[window][:, :width].index_select(0, step.rows)  # [B, P] int32
        lens = int_tensor(step.lens_list, dev)  # [B]
        meta = build_flex_metadata(table, step.starts, lens, len(step.positions), ps, self.num_pages, window,
                                   row_capacity=self.max_batch_tokens)
        return FlexGroup(window, cache_slots(table, step.request_of_token, step.positions, ps), meta)  # [T] slots

    def attend(self, meta, group, layer, query, key, value, k_cache, v_cache, scale, softcap,
               sinks: torch.Tensor | None = None) -> torch.Tensor:
        # NOTE: `sinks` is always None here: the attention function refuses s_aux (supports_sinks is False)
        out = flex_paged_attention((query * scale).contiguous(), k_cache, v_cache, group.flex, self.page_size, softcap)
        return out[0].transpose(0, 1)  # [T, H, D]


def _has_cxx() -> bool:
    import shutil

    return any(shutil.which(c) for c in ("g++", "c++", "clang++"))
