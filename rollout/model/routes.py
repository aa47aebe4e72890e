"""Routed experts recorded inside the engine step (`generate(..., return_routed_experts=True)`).

`RouteRecorder` puts a forward hook on each MoE router of the engine view (`rollout.model.routers`; the
user's model and the classes are untouched): the step's packed forward `[1, T]` hands each router its `T`
rows, and the hook keeps the expert indices `[T, k]` the router returned, the ones its experts then ran.
No second forward. After the forward, `record` maps packed row `i` back to (request, position) through the
step's schedule (the rows are the scheduled chunks in order, chunk `s` covering positions
`num_computed_tokens .. + num_new_tokens`) and writes:

- each asking request's own `RequestRoutes` (CPU, int16 `[tokens, L, k]`), so preemption (recomputed
  positions are written again), CPU offload and sliding windows lose nothing;
- `pages`, routes beside the KV: one row per KV slot `[num_pages * page_size, L, k]` on the cache's device,
  written at each computed token's slot in layer group 0. A request that reads KV it did not compute
  (a prefix-cache hit, a fork of a group leader's prompt, its partial page copied) reads those positions'
  routes from the same slots at its first step. Once a recorder exists the engine records every step (the
  core turns it on at the first request that asks, dropping the prefix cache then), so every cached page has
  its routes. On a model whose every layer slides, positions a sliding window had already recycled when the
  page was shared are -1.

Memory: `pages` is `num_pages * page_size * L * k * 2` bytes (Qwen3-30B-A3B: 768 bytes per KV slot, under
1% of its KV); each asking request holds `(prompt + forced + max_new_tokens) * L * k * 2` bytes on the CPU
until its output is delivered. Engines never asked for routes hold nothing and run no hook.
"""

from __future__ import annotations

import torch

from rollout.kv.page_tables import FREED
from rollout.model.routers import route_shape
from rollout.scheduling.stages import SchedulerOutput

ROUTE_DTYPE = torch.int16  # NOTE: expert ids < 32768 (the largest MoE models have 384 experts)


class RequestRoutes:
    """One request's routes by position: int16 `[capacity, L, k]` on the CPU, -1 where no token ran.

    `known` is how many leading positions are recorded (a chunk always starts at or below it, except after
    a prefix-cache hit or a fork, whose reused positions are then read from the KV slots' routes)."""

    def __init__(self, capacity: int, num_layers: int, top_k: int) -> None:
        self.capacity, self.shape = capacity, (num_layers, top_k)
        self.data: torch.Tensor | None = None  # [capacity, L, k], allocated at the first write
        self.known = 0

    def write(self, start: int, rows: torch.Tensor) -> None:
        """Routes `rows [n, L, k]` of positions `start .. start + n`."""
        if self.data is None:
            self.data = torch.full((self.capacity, *self.shape), -1, dtype=ROUTE_DTYPE)
        self.data[start : start + len(rows)] = rows
        if start <= self.known:
            self.known = max(self.known, start + len(rows))

    def tensor(self, num_tokens: int) -> torch.Tensor:
        """`[num_tokens, L, k]` int16: the experts of every position that ran, -1 elsewhere (the last sampled token)."""
        if self.data is None:
            return torch.full((num_tokens, *self.shape), -1, dtype=ROUTE_DTYPE)
        return self.data[:num_tokens].clone()


class RouteRecorder:
    """Records the experts each router of the engine view picks for every token of every step.

    Args:
        routers: the view's MoE routers (`rollout.model.routers.moe_routers`), in layer order.
        num_slots: KV slots of the cache (`num_pages * page_size`).
        page_size: tokens per KV page.
        device: the cache's device.
    """

    def __init__(self, routers: list[torch.nn.Module], num_slots: int, page_size: int, device: torch.device) -> None:
        self.num_layers, self.top_k = route_shape(routers)
        self.page_size, self.device = page_size, device
        self.pages = torch.full((num_slots, self.num_layers, self.top_k), -1, dtype=ROUTE_DTYPE, device=device)
        self.step: list[torch.Tensor] = []  # NOTE: one [T, k] per router, in call (layer) order
        self.handles = [r.register_forward_hook(self._hook) for r in routers]

    def new_request_routes(self, capacity: int) -> RequestRoutes:
        return RequestRoutes(capacity, self.num_layers, self.top_k)

    def _hook(self, module: torch.nn.Module, args, output) -> None:
        self.step.append(output[2])

    def begin(self) -> None:
        """Before a step's forward (a failed step may have left a part of its routes)."""
        self.step = []

    def close(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []

    def slots(self, table: list[int], start: int, end: int) -> list[int]:
        """KV slots of positions `start .. end` through a page table (-1 where the page is FREED)."""
        ps = self.page_size
        return [-1 if table[p // ps] == FREED else table[p // ps] * ps + p % ps for p in range(start, end)]

    def record(self, out: SchedulerOutput) -> None:
        """Deliver the step's routes (after its forward, before `num_computed_tokens` advances)."""
        if len(self.step) != self.num_layers:
            raise RuntimeError(f"{len(self.step)} of {self.num_layers} MoE routers ran in the step's forward")
        routes = torch.stack(self.step, dim=1).to(ROUTE_DTYPE)  # [T, L, k]
        self.step = []
        ps = self.page_size
        for src, dst, n in out.copies:  # NOTE: a fork's partial prompt page: its routes travel with its KV
            self.pages[dst * ps : dst * ps + n] = self.pages[src * ps : src * ps + n]
        slots: list[int] = []
        asking: list[tuple] = []
        for s in out.scheduled:
            req, start = s.request, s.request.num_computed_tokens
            table = s.tables[0]
            if req.routes is not None:
                if req.routes.known < start:  # NOTE: KV it did not compute (prefix hit, fork): read its routes
                    self._fill(req.routes, table, req.routes.known, start)
                asking.append((req.routes, start, len(slots), s.num_new_tokens))
            slots += self.slots(table, start, start + s.num_new_tokens)
        if len(slots) != len(routes):
            raise RuntimeError(f"the routers saw {len(routes)} rows for a step of {len(slots)} tokens")
        index = torch.tensor(slots, device=self.device)
        live = index >= 0
        self.pages[index[live]] = routes[live]
        if asking:
            on_cpu = routes.cpu()
            for store, start, offset, n in asking:
                store.write(start, on_cpu[offset : offset + n])

    def _fill(self, store: RequestRoutes, table: list[int], start: int, end: int) -> None:
        index = torch.tensor(self.slots(table, start, end), device=self.device)
        rows = torch.full((end - start, self.num_layers, self.top_k), -1, dtype=ROUTE_DTYPE, device=self.device)
        live = index >= 0
        rows[live] = self.pages[index[live]]
        store.write(start, rows.cpu())


class RoutedOffloader:
    """The CPU offload buffer (`rollout.kv.offload`) with each parked page's routes parked beside its KV, so a
    restored page's routes are right for whoever shares it later (the scheduler's `Offloader`)."""

    def __init__(self, inner, recorder: RouteRecorder) -> None:
        self.inner, self.recorder = inner, recorder
        self.parked: dict[int, torch.Tensor] = {}  # host slot -> [page_size, L, k]

    def __getattr__(self, name: str):  # NOTE: num_free, release, ... of the buffer itself
        return getattr(self.inner, name)

    def save(self, pages: list[int]) -> list[int] | None:
        slots = self.inner.save(pages)
        if slots is not None:
            ps, routes = self.recorder.page_size, self.recorder.pages
            for slot, page in zip(slots, pages, strict=True):
                self.parked[slot] = routes[page * ps : (page + 1) * ps].clone()
        return slots

    def restore(self, slots: list[int], pages: list[int]) -> None:
        self.inner.restore(slots, pages)
        ps, routes = self.recorder.page_size, self.recorder.pages
        for slot, page in zip(slots, pages, strict=True):
            parked = self.parked.pop(slot, None)
            routes[page * ps : (page + 1) * ps] = -1 if parked is None else parked

    def discard(self, slots: list[int]) -> None:
        self.inner.discard(slots)
        for slot in slots:
            self.parked.pop(slot, None)
