"""Scheduler output -> packed tensors -> one HF forward -> fp32 logits of the rows we sample.

Owns `ModelRunner`: the step's `StepInputs`, each layer group's metadata from the backend's
`build_group`, the forward, and the first-step check that our attention ran in every layer. Which
attention backend runs is the backend's business (`rollout.attention.backends`): the runner never asks. It never
mutates a request (the route recorder, `rollout.model.routes`, writes the routes of those that asked). The model it runs
is the engine view of the user's model (`rollout.model.engine_view`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from rollout.attention.backends import AttentionBackend, AttentionMetadata, StepInputs
from rollout.attention.backends import create as create_backend
from rollout.kv.device_page_tables import DevicePageTables
from rollout.kv.kv_cache import PagedKVCache
from rollout.model.static_decode import StaticDecode, StaticPlan
from rollout.sampling.token_logprobs import ScoredRows, Scores
from rollout.scheduling.stages import SchedulerOutput
from rollout.tensors import int_tensor

logger = logging.getLogger("rollout")


@dataclass(slots=True)
class Feed:
    """The previous step's sampled tokens, written on the device into this step's input ids (an asynchronous step:
    the host queued this step before it read them): ids[dst[j]] = tokens[src[j]]."""

    dst: torch.Tensor  # [m] int64 positions in this step's packed ids
    src: torch.Tensor  # [m] int64 rows of `tokens`
    tokens: torch.Tensor  # [R'] int64 the previous step's sampled tokens

    def write(self, ids: torch.Tensor) -> None:
        ids.view(-1).index_copy_(0, self.dst, self.tokens.index_select(0, self.src))


class ModelRunner:
    """Runs one packed forward per step.

    Args:
        model: the engine view (see `make_engine_view`).
        cache: the paged KV cache.
        windows: attention window of each layer group (None = full attention), in the order of the
            scheduler's page tables; default one full-attention group.
        num_layers: attention layers the model announces; the first step checks that our attention ran
            in each of them (default: the cache's layers).
        backend: the attention backend (`rollout.attention.backends`): builds each group's metadata and attends;
            default the portable `sdpa`.
        compiled: run the view's forward as one compiled graph (`rollout.model.compiled`): True for the dynamic
            whole-forward graph, or the `torch.compile` arguments of the varlen path (`varlen_compile_config`).
        static: run decode-only steps through fixed-shape buffers (`rollout.model.static_decode.StaticPlan`), or None.
    """

    def __init__(
        self, model: torch.nn.Module, cache: PagedKVCache, windows: list[int | None] | None = None,
        num_layers: int | None = None, backend: AttentionBackend | None = None, compiled: bool | dict = False,
        static: StaticPlan | None = None,
    ) -> None:
        self.model = model
        self.forward = model
        if compiled or static is not None:
            from rollout.model.compiled import DYNAMIC, CompiledForward

            # NOTE: the static step enters our attention through the compiled forward's op; without `compiled`
            # the other steps run that forward eagerly
            self.forward = CompiledForward(model, DYNAMIC if compiled is True else (compiled or None))
        self.cache = cache
        self.backend = backend or create_backend("sdpa", cache.device, cache.dtype)
        self.windows = windows or [None]  # attention window of each layer group
        self.num_layers = len(cache.layer_groups) if num_layers is None else num_layers
        self.verified = False  # NOTE: set once a step saw our attention run in every layer
        self.device = cache.device
        self.page_size = cache.page_size
        self.device_page_tables = DevicePageTables(len(self.windows), self.device)  # NOTE: persistent, synced each step
        self.routes = None  # NOTE: a `rollout.model.routes.RouteRecorder` once a request asked for routed experts
        self.lora = None  # NOTE: the engine's `rollout.model.lora.EngineLoras` once an adapter was added
        self.static = None if static is None else StaticDecode(
            self.forward, cache, self.backend, self.windows, self.device_page_tables, static.max_pages,
            static.compile_kwargs, static.cuda_graphs)

    def release(self, request) -> None:
        """`request` is final: its page-table row is free."""
        self.device_page_tables.release(request)

    def prepare(
        self, out: SchedulerOutput, drafts: list[list[int]] | None = None
    ) -> tuple[dict, list[int], list[ScoredRows]]:
        """Forward kwargs for the step, the scheduled indices whose last logits are sampled, and the scored
        rows (those a scoring request keeps follow the sampled ones in `logits_to_keep`: `score_rows`).

        `drafts` (a speculative step of decoding rows, `rollout.engine.speculation`): row i runs its last token then
        `drafts[i]`, and every position's logits are kept, row after row."""
        requests = [s.request for s in out.scheduled]
        if drafts is not None:
            ids, starts, lens = [], [r.num_computed_tokens for r in requests], [1 + len(d) for d in drafts]
            for r, d in zip(requests, drafts, strict=True):
                ids.append(r.token_ids[-1])
                ids += d
            keep, sampled, scored = list(range(len(ids))), list(range(len(requests))), []
        elif out.decode_only:  # NOTE: the steady state: each row's last token, every row sampled
            ids = [r.token_ids[-1] for r in requests]
            starts = [r.num_computed_tokens for r in requests]
            lens = [1] * len(requests)
            keep = sampled = list(range(len(requests)))
            scored: list[ScoredRows] = []
        else:
            ids, keep, sampled, starts, lens = self._rows(out)
            scored_keep, scored = score_rows(out)
            keep = keep + scored_keep
        dev = self.device
        if len(self.windows) == 1:  # NOTE: group 0's table is the request's own `page_ids`
            tables = [[r.page_ids for r in requests]]
        else:
            tables = [list(t) for t in zip(*(s.tables for s in out.scheduled), strict=True)]
        rows = self.device_page_tables.sync(requests, tables)
        persistent = {window: self.device_page_tables.group(g) for g, window in enumerate(self.windows)}
        step = StepInputs(starts, lens, rows, persistent, dev)
        step.aliases = self._fork_aliases(requests)
        step.verify = drafts is not None
        groups = [self.backend.build_group(window, tables[g], step, self.page_size)
                  for g, window in enumerate(self.windows)]
        kwargs = {
            "input_ids": int_tensor(ids, dev)[None],  # [1, T]
            "position_ids": step.positions[None],  # [1, T]
            "logits_to_keep": int_tensor(keep, dev),  # [R]
            "use_cache": False,
            "rollout_meta": AttentionMetadata(cache=self.cache, groups=groups, backend=self.backend),
        }
        return kwargs, sampled, scored

    def _fork_aliases(self, requests: list) -> dict[int | None, torch.Tensor] | None:
        """Per layer group's window, [B, 3] int64 (logical page, source page, slots) of each fork whose partial prompt
        page copies slots of a page it holds a reference to (`Request.fork_alias`; page -1 for the others), or
        None when no request is such a fork."""
        flat = None  # NOTE: one flat int list per group, through `int_tensor` (512 rows, half forks: 75 us, not 127)
        for b, r in enumerate(requests):
            if r.fork_alias is None:
                continue
            page, sources, slots = r.fork_alias
            if flat is None:
                flat = [[-1, 0, 0] * len(requests) for _ in self.windows]
            for g, source in enumerate(sources):
                flat[g][3 * b : 3 * b + 3] = page, source, slots
        if flat is None:
            return None
        return {window: int_tensor(flat[g], self.device).view(-1, 3) for g, window in enumerate(self.windows)}

    @staticmethod
    def _rows(out: SchedulerOutput) -> tuple[list[int], list[int], list[int], list[int], list[int]]:
        """(token ids [T], packed rows sampled, their scheduled indices, start and length of each row)."""
        ids: list[int] = []
        keep: list[int] = []  # packed rows whose logits we sample
        sampled: list[int] = []
        starts: list[int] = []
        lens: list[int] = []
        for i, s in enumerate(out.scheduled):
            req, n = s.request, s.num_new_tokens
            start = req.num_computed_tokens
            tokens = req.token_ids
            if n == 1:
                ids.append(tokens[start])
            else:
                ids += tokens[start : start + n]
            starts.append(start)
            lens.append(n)
            if start + n == len(tokens) and req.max_new_tokens > 0:  # NOTE: a scoring-only request samples nothing
                keep.append(len(ids) - 1)
                sampled.append(i)
        return ids, keep, sampled, starts, lens

    def execute(
        self, out: SchedulerOutput, drafts: list[list[int]] | None = None
    ) -> tuple[torch.Tensor, list[int], Scores | None]:
        """Returns (fp32 logits [R, V] of the sampled rows, their indices into `out.scheduled`, the scored
        rows' logits and where they belong, or None when no row is scored); with `drafts` (see `prepare`), the
        logits [sum(1 + len(draft)), V] of every position run."""
        run, sampled = self.stage(out, drafts)
        logits, scores = run()
        return logits, sampled, scores

    @torch.inference_mode()
    def stage(self, out: SchedulerOutput, drafts: list[list[int]] | None = None,
              feed: Feed | None = None) -> tuple[Callable[[], tuple[torch.Tensor, Scores | None]], list[int]]:
        """The step's host part now (its inputs built from the requests as they are), its device part as `run`:
        returns (run, the sampled rows' indices into `out.scheduled`); `run()` -> (fp32 logits of the sampled rows,
        the scored rows or None). `run` reads no request: an asynchronous step (`rollout.engine.async_steps`)
        queues it, and `feed` writes the previous step's sampled tokens into this one's inputs on the device."""
        copies = out.copies
        if out.decode_only and self.static is not None and self.verified and self.routes is None \
                and self.lora is None and not drafts:  # NOTE: the static step runs no adapters and no drafts
            staged = self._static_stage(out)
            if staged is not None:
                def run_static():
                    with torch.inference_mode():
                        self._copy_slots(copies)
                        return self.static.launch(*staged, feed), None

                return run_static, list(range(len(out.scheduled)))
        if self.lora is not None:  # NOTE: may order the rows by adapter (`EngineLoras.begin`), so before `prepare`
            self.lora.begin(out, drafts)
        kwargs, sampled, scored = self.prepare(out, drafts)

        def run() -> tuple[torch.Tensor, Scores | None]:
            with torch.inference_mode():
                self._copy_slots(copies)
                if feed is not None:
                    feed.write(kwargs["input_ids"])
                logits = self._forward(kwargs, out)
            if not scored:
                return logits, None
            return logits[: len(sampled)], Scores(logits[len(sampled) :], scored)

        return run, sampled

    def _copy_slots(self, copies) -> None:
        for src, dst, n in copies:
            ps = self.page_size
            idx = torch.arange(n, device=self.device)
            self.cache.copy_slots(src * ps + idx, dst * ps + idx)

    def _forward(self, kwargs: dict, out: SchedulerOutput) -> torch.Tensor:
        """fp32 logits of the kept rows (none when nothing is kept) of one general forward."""
        kept = len(kwargs["logits_to_keep"])
        if not kept:
            kwargs["logits_to_keep"] = kwargs["logits_to_keep"].new_tensor([0])
        meta = kwargs["rollout_meta"]
        if not self.verified:
            meta.layers_seen = set()
        if self.routes is not None:
            self.routes.begin()
        try:
            logits = self.forward(**kwargs).logits[0]  # [R + S, V]
        finally:
            if self.lora is not None:
                self.lora.end()
        if self.routes is not None:
            self.routes.record(out)
        if not self.verified:
            self._verify(meta.layers_seen)
        if not kept:
            logits = logits[:0]
        return logits.float()

    def _static_stage(self, out: SchedulerOutput) -> tuple | None:
        """The host part of a decode-only step through the static buffers (`StaticDecode.stage`), or None when a
        request's page table is wider than them (then the general path runs the step). The first step runs the
        general path (its layer check)."""
        requests = [s.request for s in out.scheduled]
        if len(self.windows) == 1:
            tables = [[r.page_ids for r in requests]]
        else:
            tables = [list(t) for t in zip(*(s.tables for s in out.scheduled), strict=True)]
        if not self.static.fits(tables):
            return None
        rows = self.device_page_tables.sync(requests, tables)
        return self.static.stage(requests, rows, tables)

    def _verify(self, seen: set[int]) -> None:
        """Refuse a model whose forward did not run our attention in every layer (silent garbage otherwise)."""
        missing = sorted(set(range(self.num_layers)) - seen)
        if missing:
            raise RuntimeError(
                f"rollout's paged attention did not run in layer(s) {missing} of {self.num_layers}: the model's "
                "forward (or a layer's) was replaced by one that bypasses the attention interface (e.g. a "
                "wrapper bound to another module instance), so the engine would produce wrong tokens. "
                "Build the engine on a model whose layers dispatch attention through "
                "transformers.AttentionInterface (call it before wrapping, or pass the unwrapped model)."
            )
        self.verified = True


def score_rows(out: SchedulerOutput) -> tuple[list[int], list[ScoredRows]]:
    """(packed row indices of this step's scored positions, where they belong); none in a decode-only step."""
    keep: list[int] = []
    scored: list[ScoredRows] = []
    if out.decode_only:
        return keep, scored
    offset = 0
    for s in out.scheduled:
        req, start, n = s.request, s.request.num_computed_tokens, s.num_new_tokens
        if req.score_from is not None:
            lo = max(start, req.score_from - 1)
            hi = min(start + n, req.num_given_tokens - 1)
            if hi > lo:
                scored.append(ScoredRows(req, lo, hi - lo))
                keep.extend(range(offset + lo - start, offset + hi - start))
        offset += n
    return keep, scored
