"""Scheduler output -> packed tensors -> one HF forward -> fp32 logits of the rows we sample.

The runner never mutates a request. The model it runs is an *engine view* of the user's model: a
shallow structural copy that shares every parameter and buffer (so weight updates are seen at once)
but has its own config set to our paged attention, its own eval mode, and no autograd. The user's
own module keeps its attention implementation, its train/eval mode and `requires_grad` untouched.
"""

from __future__ import annotations

import copy
import logging

import torch

from .attention import ATTN_NAME, AttentionMetadata, GroupMetadata, Segment, register
from .kv_cache import PagedKVCache
from .scheduler import SchedulerOutput

logger = logging.getLogger("rollout")


def make_engine_view(model: torch.nn.Module) -> torch.nn.Module:
    """A copy of `model`'s module tree sharing its parameters and buffers, running our attention."""
    register()
    memo: dict[int, object] = {}
    for t in (*model.parameters(), *model.buffers()):
        memo[id(t)] = t
    # NOTE: deepcopy with every tensor pre-seeded in the memo copies modules and configs only.
    view = copy.deepcopy(model, memo)
    for a, b in zip(model.parameters(), view.parameters(), strict=True):
        if a is not b:
            raise RuntimeError("engine view does not share parameters with the model")
    try:
        view.set_attn_implementation(ATTN_NAME)
    except Exception as e:  # pragma: no cover - depends on the architecture
        raise ValueError(
            f"{type(model).__name__} cannot run on rollout's paged attention: {e}. "
            "Only Hugging Face causal LMs that dispatch attention through AttentionInterface are supported."
        ) from e
    view.eval()
    return view


class ModelRunner:
    """Runs one packed forward per step.

    Args:
        model: the engine view (see `make_engine_view`).
        cache: the paged KV cache.
        windows: attention window of each layer group (None = full attention), in the order of the
            scheduler's block tables; default one full-attention group.
    """

    def __init__(
        self, model: torch.nn.Module, cache: PagedKVCache, windows: list[int | None] | None = None
    ) -> None:
        self.model = model
        self.cache = cache
        self.windows = windows or [None]  # attention window of each layer group
        self.device = cache.device
        self.page_size = cache.page_size

    def prepare(self, out: SchedulerOutput) -> tuple[dict, list[int]]:
        """Forward kwargs for the step, and the scheduled indices whose last logits are sampled."""
        ids: list[int] = []
        positions: list[int] = []
        keep: list[int] = []  # packed rows whose logits we sample
        sampled: list[int] = []
        dec_rows: list[int] = []
        groups = [_GroupBuilder(w, self.page_size, self.device) for w in self.windows]
        for i, s in enumerate(out.scheduled):
            req, n = s.request, s.num_new_tokens
            start = req.num_computed_tokens
            end = start + n
            row = len(ids)
            ids += req.token_ids[start:end]
            positions += range(start, end)
            if end == req.num_tokens:
                keep.append(row + n - 1)
                sampled.append(i)
            if n == 1:
                dec_rows.append(row)
            for g, table in zip(groups, s.tables, strict=True):
                g.add(table, row, start, end)
        dev = self.device
        meta = AttentionMetadata(cache=self.cache, groups=[g.build() for g in groups])
        if dec_rows:
            meta.dec_rows = torch.tensor(dec_rows, device=dev)
        kwargs = dict(
            input_ids=torch.tensor(ids, device=dev)[None],  # [1, T]
            position_ids=torch.tensor(positions, device=dev)[None],  # [1, T]
            logits_to_keep=torch.tensor(keep, dtype=torch.long, device=dev),  # [R]
            use_cache=False,
            rollout_meta=meta,
        )
        return kwargs, sampled

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> tuple[torch.Tensor, list[int]]:
        """Returns (fp32 logits [R, V] of the sampled rows, their indices into `out.scheduled`)."""
        for src, dst, n in out.copies:
            ps = self.page_size
            idx = torch.arange(n, device=self.device)
            self.cache.copy_slots(src * ps + idx, dst * ps + idx)
        kwargs, sampled = self.prepare(out)
        if not sampled:
            kwargs["logits_to_keep"] = kwargs["logits_to_keep"].new_tensor([0])
        logits = self.model(**kwargs).logits[0]  # [R, V]
        if not sampled:
            logits = logits[:0]
        return logits.float(), sampled


class _GroupBuilder:
    """Collects one layer group's slots for a step (see `attention.GroupMetadata`)."""

    def __init__(self, window: int | None, page_size: int, device: torch.device) -> None:
        self.window = window
        self.ps = page_size
        self.device = device
        self.slots: list[int] = []
        self.dec_slots: list[list[int]] = []
        self.segments: list[Segment] = []

    def add(self, table: list[int], row: int, start: int, end: int) -> None:
        """A request computing positions [start, end) whose pages are `table`."""
        ps = self.ps
        self.slots += [table[p // ps] * ps + p % ps for p in range(start, end)]
        # NOTE: the query at `start` sees keys from start - window + 1 on (HF: j > i - window).
        lo = 0 if self.window is None else max(0, start - self.window + 1)
        if end - start == 1:
            self.dec_slots.append([table[p // ps] * ps + p % ps for p in range(lo, end)])
            return
        kv = None  # NOTE: from position 0 every key is this step's own (lo is 0 too)
        if start > 0:
            kv = torch.tensor([table[p // ps] * ps + p % ps for p in range(lo, end)], device=self.device)
        self.segments.append(Segment(row, end - start, lo, end - lo, kv))

    def build(self) -> GroupMetadata:
        dev = self.device
        g = GroupMetadata(self.window, torch.tensor(self.slots, device=dev), segments=self.segments)
        if self.dec_slots:
            lmax = max(len(s) for s in self.dec_slots)
            g.dec_slots = torch.tensor([s + s[:1] * (lmax - len(s)) for s in self.dec_slots], device=dev)
            g.dec_kv_len = torch.tensor([len(s) for s in self.dec_slots], device=dev)
            g.dec_padded = any(len(s) < lmax for s in self.dec_slots)
        return g
