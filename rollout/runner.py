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

from .attention import ATTN_NAME, AttentionMetadata, Segment, register
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
    """

    def __init__(self, model: torch.nn.Module, cache: PagedKVCache) -> None:
        self.model = model
        self.cache = cache
        self.device = cache.device
        self.page_size = cache.page_size

    def prepare(self, out: SchedulerOutput) -> tuple[dict, list[int]]:
        """Forward kwargs for the step, and the scheduled indices whose last logits are sampled."""
        ps = self.page_size
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        keep: list[int] = []  # packed rows whose logits we sample
        sampled: list[int] = []
        dec_rows: list[int] = []
        dec_slots: list[list[int]] = []
        dec_pos: list[int] = []
        segments: list[Segment] = []
        for i, s in enumerate(out.scheduled):
            req, n = s.request, s.num_new_tokens
            start = req.num_computed_tokens
            end = start + n
            row = len(ids)
            ids += req.token_ids[start:end]
            positions += range(start, end)
            blocks = req.block_ids
            slots += [blocks[p // ps] * ps + p % ps for p in range(start, end)]
            if end == req.num_tokens:
                keep.append(row + n - 1)
                sampled.append(i)
            if n == 1:
                dec_rows.append(row)
                dec_slots.append([blocks[p // ps] * ps + p % ps for p in range(end)])
                dec_pos.append(start)
            else:
                kv = None
                if start > 0:
                    kv = torch.tensor([blocks[p // ps] * ps + p % ps for p in range(end)], device=self.device)
                segments.append(Segment(row, n, end, kv))
        dev = self.device
        meta = AttentionMetadata(cache=self.cache, slot_mapping=torch.tensor(slots, device=dev), segments=segments)
        if dec_rows:
            lmax = max(len(s) for s in dec_slots)
            meta.dec_rows = torch.tensor(dec_rows, device=dev)
            meta.dec_slots = torch.tensor([s + s[:1] * (lmax - len(s)) for s in dec_slots], device=dev)
            meta.dec_kv_len = torch.tensor([len(s) for s in dec_slots], device=dev)
            meta.dec_positions = torch.tensor(dec_pos, device=dev)
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
