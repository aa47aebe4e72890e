"""The dataclasses the engine's stages hand each other: what the scheduler decided for one step
(`SchedulerOutput` of `ScheduledRequest`s) for the runner, and the CPU offload interface the scheduler
calls (`Offloader`, implemented by `rollout.kv.offload`). Pure Python: no torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from rollout.requests import Request


@dataclass(slots=True)
class ScheduledRequest:
    request: Request
    num_new_tokens: int  # query tokens this step, starting at request.num_computed_tokens
    # NOTE: one page table per layer group (FREED where a sliding window recycled the page);
    # None means the request's own `page_ids` is the only table.
    page_tables: list[list[int]] | None = None

    @property
    def tables(self) -> list[list[int]]:
        return self.page_tables if self.page_tables is not None else [self.request.page_ids]

    @property
    def samples(self) -> bool:
        """The chunk reaches the end of the request's tokens, so its last logits are sampled."""
        return self.request.num_computed_tokens + self.num_new_tokens == self.request.num_tokens


@dataclass(slots=True)
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    # NOTE: (src_page, dst_page, num_tokens) page copies the runner applies before the forward
    # (copy-on-write of the partial last prompt page when a request forks a group leader).
    copies: list[tuple[int, int, int]] = field(default_factory=list)
    # NOTE: set by the decode fast path: every row is a DECODING request computing its last token (one
    # token each, every row sampled), so the runner and the core can skip their per-row cases.
    decode_only: bool = False

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    def __bool__(self) -> bool:
        return bool(self.scheduled)


class Offloader(Protocol):
    """Somewhere to park the KV pages of a preempted request (`rollout.kv.offload.CpuOffloadBuffer`)."""

    def save(self, pages: list[int]) -> list[int] | None:
        """Copy `pages` out; returns the slots holding them, or None (nothing kept) when full."""
        ...

    def restore(self, slots: list[int], pages: list[int]) -> None:
        """Copy `slots` back into `pages` (same order) and free the slots."""
        ...

    def discard(self, slots: list[int]) -> None:
        """Free `slots` without copying them back."""
        ...
