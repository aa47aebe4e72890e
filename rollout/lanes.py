"""Decode lanes: a contiguous copy of the KV of each decoding request, so decode attention reads a view.

Without lanes, every decode step gathers each request's keys and values out of the paged cache
(`index_select` by slot, `[B, Hkv, Lmax, D]`) before attention reads them again: on a CPU that gather
cost as much as the attention itself (PROFILE.md). With lanes, a request that is decoding owns a
lane, one row of `[num_lanes, Hkv, lane_len, D]` per full-attention layer. The lane is filled once
from the paged cache when the request starts decoding; after that every step appends one token, and
attention reads `lanes[l0:l1, :, :Lmax]`, a strided view, with no copy at all.

The paged cache stays the source of truth (prefix sharing, preemption, offload, copy-on-write all
work on pages); lanes are a cache of it, rebuilt whenever there is any doubt:
- a lane belongs to one `Request` object and holds exactly its first `length` positions; a decode
  row is served from its lane only if the lane's length equals the row's position, otherwise it is
  refilled from the pages;
- a lane whose request is not a decode row this step is freed (finished, preempted, aborted, or
  back in prefill after a recompute);
- a failed forward and a weight update drop every lane (`forget`; the tensors stay allocated), and
  `PagedKVCache.release` frees them (`reset`).

Lanes are used on CPU only (on an accelerator the KV budget is the whole free memory, and a paged
attention kernel reads the pages in place), for full-attention layers only (a sliding window already
bounds the gather), and within a memory budget: rows that do not fit take the gather path.
Half-precision models keep their lanes in fp32, so the fp32 decode attention (see
`rollout.attention`) casts nothing per step.

When the paged kernel of `rollout.cpu_kernels` is built, fp32 and bf16 engines keep no lanes at all:
decode attention reads the pages in place. Lanes serve fp16 caches, `ROLLOUT_PAGED_KERNEL=0`, and
machines without a compiler.

Who reads the lanes: the lane kernel of `rollout.cpu_kernels` when it is built (`DecodeLanes.kernel`),
every lane in place at its own length; otherwise torch SDPA over `LaneBucket`s, views of lane ranges
of similar length, which is why the lanes are then compacted into length order (`compact`).
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field

import torch

LANE_LEN_QUANTUM = 256  # lane length grows in multiples of this
MIN_LANES = 16


@dataclass(slots=True)
class LaneBucket:
    """Decode rows of similar KV length read from lanes in one attention call.

    When the rows' lanes are (nearly) a contiguous range, attention reads the view
    `lanes[lo:hi, :, :lmax]` and `index` maps the rows into it (None: the rows are exactly lanes
    lo..hi-1 in order); otherwise `index` selects their lanes (one copy of whole lane prefixes, still
    far cheaper than gathering slot by slot).
    """

    rows: torch.Tensor  # [n] packed rows of the queries
    lmax: int  # longest KV read (max pos + 1)
    lo: int
    hi: int
    view: bool  # read lanes lo..hi-1 as a view; else `index_select(index)`
    index: torch.Tensor | None  # view: [n] lane - lo of each row (None = identity); gather: [n] lanes
    mask: torch.Tensor | None  # [view ? hi - lo : n, 1, 1, lmax] True = attend; None: nothing is padding


@dataclass(slots=True)
class LaneBatch:
    """The decode rows of one step served from lanes (one full-attention group)."""

    rows: torch.Tensor  # [n] packed rows of the queries
    lanes: torch.Tensor  # [n] lane of each row
    pos: torch.Tensor  # [n] position of each row's new token (= keys before it)
    buckets: list[LaneBucket]
    fill_lanes: torch.Tensor | None = None  # [F] lanes to (re)fill from the paged cache ...
    fill_pos: torch.Tensor | None = None  # [F] ... at these positions ...
    fill_slots: torch.Tensor | None = None  # [F] ... from these cache slots
    kv_len: torch.Tensor | None = None  # [n] pos + 1, when the decode-attention kernel reads the lanes
    flat: dict = field(default_factory=dict)  # (Hkv, lane_len) -> (write index, fill index), built once a step


def _round_up(n: int) -> int:
    return -(-n // LANE_LEN_QUANTUM) * LANE_LEN_QUANTUM


class DecodeLanes:
    """Lane bookkeeping and the lane tensors of every full-attention layer.

    Args:
        budget_bytes: most bytes all lanes of all layers may take.
        bytes_per_token: K and V of one token over all full-attention layers, in the lane dtype.
        dtype: the lanes' dtype.
        device: where they live.
    """

    def __init__(self, budget_bytes: int, bytes_per_token: int, dtype: torch.dtype, device: torch.device) -> None:
        self.budget_bytes = budget_bytes
        self.bytes_per_token = max(1, bytes_per_token)
        self.dtype = dtype
        self.device = device
        self.owner: list[object | None] = []  # request of each lane
        self.length: list[int] = []  # positions held by each lane
        self._free: list[int] = []  # heap of free lanes (lowest first, keeps the used range short)
        self._of: dict[int, int] = {}  # id(request) -> lane
        self.lane_len = 0
        self.keys: dict[int, torch.Tensor] = {}  # layer -> [num_lanes, Hkv, lane_len, D]
        self.values: dict[int, torch.Tensor] = {}
        self.fills = 0  # lanes (re)filled from the paged cache, for tests and profiles
        self.compactions = 0
        self._perm: torch.Tensor | None = None  # pending reorder of this step (see `compact`)
        self._perm_len = 0
        self._permuted: set[int] = set()
        # NOTE: `rollout.cpu_kernels.decode_attention` (set by the engine): it reads every lane at its own
        # length, so the rows need no buckets and the lanes no compaction.
        self.kernel = None

    @property
    def num_lanes(self) -> int:
        return len(self.owner)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.keys.values(), *self.values.values()))

    def forget(self) -> None:
        """No lane belongs to any request any more (after a failed step, a weight update); the tensors
        stay allocated for the next requests, which fill their lanes before reading them."""
        self._of = {}
        self._perm = None
        self.owner = [None] * self.num_lanes
        self.length = [0] * self.num_lanes
        self._free = list(range(self.num_lanes))

    def reset(self) -> None:
        """Forget every lane and free the tensors (`PagedKVCache.release`)."""
        self.owner = []
        self.lane_len = 0
        self.keys.clear()
        self.values.clear()
        self.forget()

    def _release(self, lane: int) -> None:
        self._of.pop(id(self.owner[lane]), None)
        self.owner[lane] = None
        self.length[lane] = 0
        heapq.heappush(self._free, lane)

    def _max_lanes(self, lane_len: int) -> int:
        return self.budget_bytes // (lane_len * self.bytes_per_token)

    def _grow(self, want_lanes: int, want_len: int, limit: int = 0) -> None:
        """Raise lane count and/or length within the budget (tensors follow lazily, see `layer`).

        `limit`: the longest the rows can get (prompt + max_new_tokens). Lanes are sized for it when
        that is at most twice what is needed now, so one generation rarely reallocates them."""
        if want_len > self.lane_len:
            new_len = _round_up(max(want_len, min(limit, 2 * want_len)))
            if self._max_lanes(new_len) < max(self.num_lanes, want_lanes, 1):
                new_len = _round_up(want_len)
            if self._max_lanes(new_len) >= max(self.num_lanes, 1):
                self.lane_len = new_len
        if self.lane_len == 0:
            return
        cap = self._max_lanes(self.lane_len)
        if want_lanes > self.num_lanes and cap > self.num_lanes:
            new = min(cap, max(MIN_LANES, want_lanes, 2 * self.num_lanes))
            for lane in range(self.num_lanes, new):
                self.owner.append(None)
                self.length.append(0)
                heapq.heappush(self._free, lane)

    def plan(self, requests: list, starts: list[int]) -> tuple[list[int], list[int], list[int]]:
        """Assign lanes to this step's decode rows (`requests[i]` writes position `starts[i]`).

        Returns `(served, lanes, fill)`: the indices of the rows served from lanes, their lanes, and
        the indices (into `served`) of the rows whose lane must be filled from the pages first. The
        other rows take the gather path. Lanes of requests that are not decode rows are freed.
        """
        self._perm = None
        here = {id(r) for r in requests}
        for lane, owner in enumerate(self.owner):
            if owner is not None and id(owner) not in here:
                self._release(lane)
        if max(starts) + 1 > self.lane_len:
            limit = max(r.num_prompt_tokens + r.max_new_tokens for r in requests)
            self._grow(len(starts), max(starts) + 1, limit)
        else:
            self._grow(len(starts), 0)
        served: list[int] = []
        lanes: list[int] = []
        fill: list[int] = []
        # NOTE: rows that keep their lane first, then newcomers longest first: requests that start
        # decoding together get consecutive lanes in order of length, so buckets read views.
        order = sorted(range(len(starts)), key=lambda i: (self._of.get(id(requests[i])) is None, -starts[i]))
        for i in order:
            req, start = requests[i], starts[i]
            if start + 1 > self.lane_len:
                continue
            lane = self._of.get(id(req))
            if lane is not None and self.owner[lane] is not req:  # NOTE: a recycled id()
                lane = None
            if lane is None:
                if not self._free:
                    continue
                lane = heapq.heappop(self._free)
                self.owner[lane] = req
                self._of[id(req)] = lane
                self.length[lane] = 0
            if self.length[lane] != start:
                fill.append(len(served))
                self.fills += 1
            self.length[lane] = start + 1
            served.append(i)
            lanes.append(lane)
        return served, lanes, fill

    def compact(self, order: list[int]) -> dict[int, int]:
        """Move lanes `order` to 0 .. len(order) - 1 (every other lane is freed); returns old -> new.

        Finished requests leave holes and newcomers take whatever lane is free, so over time the
        lanes of one bucket stop being a short contiguous range. The runner then calls this with the
        rows ordered by length: afterwards every bucket is an exact view again. The copy (one
        `index_select` of the used lane prefixes per layer) is done by `layer` on first use this step.
        """
        n = len(order)
        self.compactions += 1
        owner = [self.owner[lane] for lane in order]
        length = [self.length[lane] for lane in order]
        self._perm = torch.tensor(order, device=self.device)
        self._perm_len = max(length, default=0)
        self._permuted = set()
        self.owner = owner + [None] * (self.num_lanes - n)
        self.length = length + [0] * (self.num_lanes - n)
        self._of = {id(r): i for i, r in enumerate(owner)}
        self._free = list(range(n, self.num_lanes))
        return {old: new for new, old in enumerate(order)}

    def layer(self, layer: int, num_kv_heads: int, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V lanes `[num_lanes, Hkv, lane_len, D]` of `layer`, grown (contents kept) if needed."""
        k = self.keys.get(layer)
        shape = (self.num_lanes, num_kv_heads, self.lane_len, head_dim)
        if k is None or k.shape != shape:
            new = []
            for old in (k, self.values.get(layer)):
                t = torch.zeros(shape, dtype=self.dtype, device=self.device)
                if old is not None:
                    n, _, m, _ = old.shape
                    t[:n, :, :m] = old
                new.append(t)
            self.keys[layer], self.values[layer] = new
        if self._perm is not None and layer not in self._permuted:
            n, m = len(self._perm), self._perm_len
            for t in (self.keys[layer], self.values[layer]):
                t[:n, :, :m] = t[:, :, :m].index_select(0, self._perm)
            self._permuted.add(layer)
        return self.keys[layer], self.values[layer]
