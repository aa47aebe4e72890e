"""The static decode step: a decode-only step as one fixed-shape forward over persistent buffers.

What a compiled graph per shape (`torch.compile(fullgraph=True, dynamic=False)`, the guide's
`decode_compile_config`) and a CUDA graph both need:

- rows padded to a bucket (`bucket`: 1, 2, 4, 8, then multiples of 8), so a batch drifting between 1 and 40
  rows meets 8 shapes;
- every per-step input in a buffer that lives as long as the engine (`Bucket`): token ids, positions, the logits
  rows kept, and per layer group the new tokens' cache slots, the page tables (`[bucket, max_pages]` int32,
  copied on the device from the persistent `DevicePageTables`), the first and one-past-last positions read;
  one host-to-device copy of one packed int64 list writes all the small ones;
- padded rows write their K/V into a reserved null page (one page past the pool's: the cache holds
  `num_pages + 1`), read position 0 of a real row and are dropped from the logits;
- nothing read back from the device inside the step: the attention metadata of a bucket is built once, over the
  buffers, so the step runs the attention backend's in-place decode kernel (`cpu`, `triton`) on them.

On CUDA with `use_cuda_graph=True` each bucket's forward is captured in a CUDA graph (one memory pool) at its
second step and replayed after the buffers are filled (NOT yet run on a GPU: see `StaticDecode`).
`StaticDecode.run` returns the fp32 logits of the live rows. Each bucket's forward runs through the compiled
attention op of `rollout.model.compiled` (the only way our attention enters a dynamo graph), compiled per
bucket with the config's `torch.compile` arguments (its own code object: its own cache, no recompile limit
shared between buckets), or eagerly through the same op when no compile config is given.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from rollout.attention.backends import AttentionMetadata
from rollout.kv.device_page_tables import DevicePageTables
from rollout.kv.kv_cache import PagedKVCache
from rollout.tensors import int_tensor

if TYPE_CHECKING:  # NOTE: imported where used: rollout.model.compiled imports torch._dynamo (and with it triton)
    from rollout.model.compiled import CompiledForward

logger = logging.getLogger("rollout")

SMALL_BUCKETS = (1, 2, 4, 8)
BUCKET_STEP = 8
FALLBACK_MAX_PAGES = 32  # NOTE: the guide's page-table width when neither the field nor the model's context says


@dataclass(frozen=True, slots=True)
class StaticPlan:
    """Whether and how an engine runs its decode steps static: `max_pages` wide page tables, each bucket's forward
    compiled with `compile_kwargs` (None: eagerly), captured in a CUDA graph when `cuda_graphs`."""

    max_pages: int
    compile_kwargs: dict | None
    cuda_graphs: bool = False


def varlen_compile(config, device: torch.device) -> bool | dict:
    """How the general (varlen) path of `config` runs: `varlen_compile_config`'s `torch.compile` arguments when set,
    else True (the dynamic whole-forward graph, on a CPU) where `default_compile_level >= 1` supplies it, else False."""
    from rollout.model.compiled import compile_kwargs

    if config.varlen_compile_config is not None:
        return compile_kwargs(config.varlen_compile_config, "varlen_compile_config")
    return config.default_compile_level >= 1 and device.type == "cpu"


def static_plan(config, device: torch.device, page_size: int, num_pages: int,
                max_context: int | None) -> StaticPlan | None:
    """The decode path of `config` (a `ContinuousBatchingConfig`): static when `decode_compile_config` is set, or
    with `use_cuda_graph` on CUDA, unless `max_blocks_per_request=0` (the guide's switch for the decode fast path);
    None otherwise (the general path, compiled by `default_compile_level` as a whole)."""
    from rollout.model.compiled import compile_kwargs

    if config.max_blocks_per_request == 0:
        return None
    if config.decode_compile_config is None and not (config.use_cuda_graph and device.type == "cuda"):
        return None
    width = config.max_blocks_per_request or (-(-max_context // page_size) if max_context else FALLBACK_MAX_PAGES)
    kwargs = None if config.decode_compile_config is None else compile_kwargs(config.decode_compile_config)
    return StaticPlan(max(1, min(width, num_pages)), kwargs, bool(config.use_cuda_graph) and device.type == "cuda")


def bucket(n: int) -> int:
    """The padded row count of an `n`-row decode step: 1, 2, 4, 8, then the next multiple of 8."""
    if n < 1:
        raise ValueError(f"a decode step has at least one row, got {n}")
    for b in SMALL_BUCKETS:
        if n <= b:
            return b
    return -(-n // BUCKET_STEP) * BUCKET_STEP


@dataclass(slots=True)
class Bucket:
    """The persistent inputs of one padded row count (`size`), views of one packed int64 buffer (`flat`)."""

    size: int
    flat: torch.Tensor  # [size * (3 + 3 * G)] int64: ids, positions, rows, then per group slots, starts, ends
    ids: torch.Tensor  # [1, size]
    positions: torch.Tensor  # [1, size]
    rows: torch.Tensor  # [size] row of the persistent page tables (padded rows: row of the first live one)
    keep: torch.Tensor  # [size] every row's logits
    tables: list[torch.Tensor]  # per group [size, max_pages] int32
    meta: AttentionMetadata  # over the buffers above, built once
    fn: object = None  # its forward (compiled or eager), set at the first step
    graph: object = None  # its CUDA graph (`torch.cuda.CUDAGraph`), once captured
    logits: torch.Tensor | None = None  # [1, size, V] the graph's output, overwritten by each replay
    captured_for: tuple = ()  # the cache storages' addresses the graph was captured on


class StaticDecode:
    """Decode-only steps through fixed-shape buffers (see the module docstring).

    Args:
        forward: the engine view's forward through rollout's compiled attention op (`CompiledForward`).
        cache: the paged cache (one page past the pool's: the null page).
        backend: the attention backend; needs `static_group` (an in-place decode kernel: `cpu`, `triton`).
        windows: each layer group's window (None: full attention).
        page_tables: the runner's persistent page tables (synced for the step before `run`).
        max_pages: page-table width (`max_blocks_per_request`): a step whose request holds more runs the general path.
        compile_kwargs: `torch.compile` arguments of each bucket's forward, or None to run it eagerly.
        cuda_graphs: capture each bucket's forward in a CUDA graph at its second step (the first warms it up),
            all in one memory pool, and replay it after filling the buffers. NOTE: written without a GPU, NOT yet
            run on one (benchmarks/RESULTS.md says what the device run must show). A graph reads the weights
            and the cache where they were at capture: weights updated in place are seen by the next replay; a
            cache reallocated (`wake` after `sleep`) has new addresses, so the graphs are captured again.
    """

    def __init__(self, forward: CompiledForward, cache: PagedKVCache, backend, windows: list[int | None],
                 page_tables: DevicePageTables, max_pages: int, compile_kwargs: dict | None,
                 cuda_graphs: bool = False) -> None:
        self.forward = forward
        self.page_tables = page_tables
        self.cache = cache
        self.backend = backend
        self.windows = windows
        self.max_pages = max_pages
        self.compile_kwargs = compile_kwargs
        self.null_page = cache.num_pages - 1  # NOTE: the pool hands out pages [0, num_pages - 1) only
        self.buckets: dict[int, Bucket] = {}
        self.steps = 0  # NOTE: steps run here, for tests and profiles
        self.eager_fallbacks = 0  # NOTE: buckets whose compile failed (then run eagerly, with one warning)
        self.cuda_graphs = cuda_graphs and cache.device.type == "cuda"
        self.pool = torch.cuda.graph_pool_handle() if self.cuda_graphs else None  # NOTE: one pool for every bucket
        self.captures = 0  # NOTE: graphs captured (again after a cache reallocation)
        self.replays = 0

    def fits(self, tables: list[list[list[int]]]) -> bool:
        """Every scheduled request's page table (per group) fits the buffers' width."""
        return all(len(t) <= self.max_pages for group in tables for t in group)

    def _bucket(self, size: int) -> Bucket:
        b = self.buckets.get(size)
        if b is not None:
            return b
        dev, groups = self.cache.device, len(self.windows)
        flat = torch.zeros(size * (3 + 3 * groups), dtype=torch.long, device=dev)
        fields = flat.view(3 + 3 * groups, size)
        tables = [torch.full((size, self.max_pages), self.null_page, dtype=torch.int32, device=dev)
                  for _ in range(groups)]
        meta_groups = [self.backend.static_group(window, fields[3 + 3 * g], tables[g], torch.arange(size, device=dev),
                                                 fields[4 + 3 * g], fields[5 + 3 * g])
                       for g, window in enumerate(self.windows)]
        meta = AttentionMetadata(cache=self.cache, groups=meta_groups, backend=self.backend)
        b = Bucket(size, flat, fields[0].view(1, size), fields[1].view(1, size), fields[2],
                   torch.arange(size, device=dev), tables, meta)
        self.buckets[size] = b
        return b

    def stage(self, requests: list, rows: list[int], tables: list[list[list[int]]]) -> tuple[Bucket, torch.Tensor, int]:
        """The host part of a step: its bucket and its inputs packed in one host tensor (pinned on CUDA), read from
        the requests now; `launch` copies them into the buffers on the device."""
        n = len(requests)
        b = self._bucket(bucket(n))
        pad = b.size - n
        ps = self.cache.page_size
        positions = [r.num_computed_tokens for r in requests]
        host = [r.token_ids[-1] for r in requests] + [0] * pad
        host += positions + [0] * pad
        host += rows + [rows[0]] * pad  # NOTE: padded rows read position 0 of a live row: harmless, dropped
        null_slot = self.null_page * ps
        for g, window in enumerate(self.windows):
            group = tables[g]
            host += [group[i][p // ps] * ps + p % ps for i, p in enumerate(positions)] + [null_slot] * pad
            host += ([0] * n if window is None else [max(0, p - window + 1) for p in positions]) + [0] * pad
            host += [p + 1 for p in positions] + [1] * pad
        packed = int_tensor(host, torch.device("cpu"))
        return b, (packed.pin_memory() if self.cache.device.type == "cuda" else packed), n

    def fill(self, b: Bucket, packed: torch.Tensor) -> Bucket:
        """Write a staged step's inputs into its bucket's buffers (one packed upload, a table copy per group)."""
        b.flat.copy_(packed, non_blocking=True)
        for g, table in enumerate(b.tables):  # NOTE: on the device, from the persistent tables: no host read
            persistent = self.page_tables.group(g)
            width = min(persistent.shape[1], self.max_pages)
            table[:, :width].copy_(persistent.index_select(0, b.rows)[:, :width])
        return b

    def run(self, requests: list, rows: list[int], tables: list[list[list[int]]]) -> torch.Tensor:
        """fp32 logits [B, V] of the step's B decode rows (one token each, in order)."""
        return self.launch(*self.stage(requests, rows, tables))

    def launch(self, b: Bucket, packed: torch.Tensor, n: int, feed=None) -> torch.Tensor:
        """The device part of a staged step: fill the buffers (then `feed`, the previous step's tokens written into
        the ids on the device: `rollout.model.runner.Feed`), run or replay the bucket's forward; fp32 logits [n, V]."""
        self.fill(b, packed)
        if feed is not None:
            feed.write(b.ids)
        if b.fn is None:
            b.fn = (self.forward.eager if self.compile_kwargs is None
                    else self.forward.compile(f"_decode{b.size}", self.compile_kwargs))
        kwargs = {"input_ids": b.ids, "position_ids": b.positions, "logits_to_keep": b.keep, "use_cache": False}
        self.steps += 1
        if self.cuda_graphs:
            storages = self._storages()
            if b.graph is not None and b.captured_for == storages:
                b.graph.replay()
                self.replays += 1
                return b.logits[0, :n].float()  # [B, V]
            if b.captured_for == ("warm", storages):  # NOTE: the second step of this bucket on this cache
                return self._capture(b, kwargs, storages)[0, :n].float()  # [B, V]
            b.graph, b.logits, b.captured_for = None, None, ("warm", storages)
        out, fn = self.forward.run(b.fn, b.meta, kwargs)
        if fn is not b.fn:
            self.eager_fallbacks += 1
            b.fn = fn
        return out.logits[0, :n].float()  # [B, V]

    def _storages(self) -> tuple:
        """The cache storages' addresses (a host property: no device read)."""
        return tuple(t.data_ptr() for t in (*self.cache.keys.values(), *self.cache.values.values()))

    def _capture(self, b: Bucket, kwargs: dict, storages: tuple) -> torch.Tensor:
        """Capture bucket `b`'s forward (its buffers already filled) and replay it once: the capture runs nothing."""
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            out, _ = self.forward.run(b.fn, b.meta, kwargs)
        b.graph, b.logits, b.captured_for = graph, out.logits, storages
        self.captures += 1
        graph.replay()
        self.replays += 1
        return b.logits
