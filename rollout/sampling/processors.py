"""The logits processors: per-request biases, penalties, bans and forced tokens, over one step's rows.

Applied before the warpers (temperature, top-k, top-p, min-p: `rollout.sampling.sampler`), in transformers'
order (`GenerationMixin._get_logits_processor`): token / sequence bias (vLLM's `logit_bias`, bad words
and `suppress_tokens` as -inf biases), repetition penalty (prompt + generated), presence and frequency
penalties (generated tokens, as vLLM), no-repeat n-grams, minimum length (stop ids masked), forced BOS /
EOS, begin-suppress. Suppressed tokens are -inf biases applied before the forced tokens instead of after
them; the two differ only when a forced token is itself suppressed (then transformers' row is all -inf).

Only rows whose `SamplingParams.uses_processors` is set pay anything; the default path never gets here.
History-dependent state lives on the device and is updated incrementally, as vLLM does: each such
request holds a slot of `[slots, V]` tensors (tokens seen in prompt + generated, generated-token counts when
it has a presence or frequency penalty, its static
bias row), filled once at its first sampled token and bumped by `update` after every sample. The n-gram
bans keep a per-request index of the n-grams seen so far (host side, grown by the new tokens only).

Scored (teacher-forced) positions go through the same rules (`apply_at`): each logits row with its own
`RowHistory` (the tokens before it), its seen / count / bias rows built from that history instead of a slot, so
a scored token's processed logprob is the one the sampler reports for it (`rollout.sampling.log_distribution`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch

from rollout.requests import Request, SamplingParams

_NEG_INF = float("-inf")
_CHUNK = 256  # NOTE: scored rows per block of history tensors in `apply_at` ([_CHUNK, V] each, not [S, V])


class RowHistory(NamedTuple):
    """The history one logits row's processors see: `request.token_ids[:length]`, its first `num_prompt` the
    prompt and the rest generated (a scored completion's tokens count as generated, as when they were sampled)."""

    request: Request
    length: int
    num_prompt: int

    @property
    def num_generated(self) -> int:
        return self.length - self.num_prompt

    @classmethod
    def next_sample(cls, req: Request) -> RowHistory:
        """The row a request samples its next token from: all its tokens so far."""
        n = len(req.token_ids)
        return cls(req, n, n - len(req.generated))

    @classmethod
    def at(cls, req: Request, position: int) -> RowHistory:
        """The logits at `position` (they predict token `position + 1`): a position inside the prompt is scored
        as if the prompt ended there."""
        return cls(req, position + 1, min(req.num_prompt_tokens, position + 1))


class LogitsProcessors:
    """Applies each row's logits processors and keeps their per-request state.

    Args:
        device: where the logits live (and so the count and bias tensors).
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._slots: dict[str, int] = {}  # request id -> row of the slot tensors
        self._free: list[int] = []
        self._capacity = 0
        self.seen: torch.Tensor | None = None  # [slots, V] bool: token occurs in prompt + generated
        self.counts: torch.Tensor | None = None  # [slots, V] int32: generated-token counts
        self.bias: torch.Tensor | None = None  # [slots, V] fp32: the static token bias
        # id -> (starts indexed, (n-1)-gram -> {next token: its first start})
        self._ngrams: dict[str, tuple[int, dict[tuple[int, ...], dict[int, int]]]] = {}

    # ------------------------------------------------------------------ state
    def release(self, request_id: str) -> None:
        slot = self._slots.pop(request_id, None)
        if slot is not None:
            self._free.append(slot)
        self._ngrams.pop(request_id, None)

    def _slot(self, req: Request, vocab: int) -> int:
        slot = self._slots.get(req.request_id)
        if slot is not None:
            return slot
        if not self._free:
            self._grow(vocab)
        slot = self._slots[req.request_id] = self._free.pop()
        p = req.sampling
        if p.penalised:
            seen = self._tensor("seen", torch.bool, vocab)
            seen[slot].zero_()
            seen[slot, torch.tensor(req.token_ids, device=self.device)] = True
        if _counted(p):
            counts = self._tensor("counts", torch.int32, vocab)
            counts[slot].zero_()
            if req.generated:  # NOTE: normally empty: a request registers at its first sample
                gen = torch.tensor(req.generated, device=self.device)
                counts[slot].index_add_(0, gen, torch.ones_like(gen, dtype=torch.int32))
        if p.logit_bias:
            bias = self._tensor("bias", torch.float32, vocab)
            bias[slot].zero_()
            ids = torch.tensor([t for t, _ in p.logit_bias], device=self.device)
            bias[slot, ids] = torch.tensor([b for _, b in p.logit_bias], dtype=torch.float32, device=self.device)
        return slot

    def _tensor(self, name: str, dtype: torch.dtype, vocab: int) -> torch.Tensor:
        t = getattr(self, name)
        if t is None:
            t = torch.zeros(self._capacity, vocab, dtype=dtype, device=self.device)
            setattr(self, name, t)
        return t

    def _grow(self, vocab: int) -> None:
        """Double the slots (at least 8); existing rows are kept."""
        new = max(8, 2 * self._capacity)
        for name in ("seen", "counts", "bias"):
            old = getattr(self, name)
            if old is not None:
                t = torch.zeros(new, vocab, dtype=old.dtype, device=self.device)
                t[: self._capacity] = old
                setattr(self, name, t)
        self._free.extend(range(new - 1, self._capacity - 1, -1))
        self._capacity = new

    # ------------------------------------------------------------------ apply
    @torch.inference_mode()
    def apply(self, logits: torch.Tensor, reqs: Sequence[Request]) -> torch.Tensor:
        """The processed logits `[R, V]` fp32 of the rows each request samples next (a new tensor; `logits` is
        left as it was), from the requests' slots."""
        vocab = logits.shape[-1]
        x = logits.clone()  # [R, V]
        rows = [i for i, r in enumerate(reqs) if r.sampling.uses_processors]
        slots = {i: self._slot(reqs[i], vocab) for i in rows}

        def state(name: str, which: list[int]) -> torch.Tensor:  # [len(which), V] rows of a slot tensor
            return getattr(self, name)[self._index([slots[i] for i in which])]

        self._process(x, rows, [RowHistory.next_sample(r) for r in reqs], state)
        return x

    @torch.inference_mode()
    def apply_at(self, logits: torch.Tensor, rows: Sequence[RowHistory]) -> torch.Tensor:
        """The processed logits `[S, V]` fp32 of scored rows, each at its own history (a new tensor). Stateless
        but for the n-gram index; consecutive positions of one request share their history's counts."""
        x = logits.clone()  # [S, V]
        for lo in range(0, len(rows), _CHUNK):
            hists = list(rows[lo : lo + _CHUNK])
            on = [i for i, h in enumerate(hists) if h.request.sampling.uses_processors]
            if on:
                part = x[lo : lo + len(hists)]  # NOTE: a view: the rules write into x

                def state(name: str, which: list[int], hists=hists) -> torch.Tensor:
                    return self._history_state(name, [hists[i] for i in which], x.shape[-1])

                self._process(part, on, hists, state)
        return x

    def _process(self, x: torch.Tensor, rows: list[int], hists: Sequence[RowHistory],
                 state: Callable[[str, list[int]], torch.Tensor]) -> None:
        """Every rule in order, in place on `x [R, V]`, for `rows` (those using processors); `state(name, rows)`
        gives their "bias" / "seen" / "counts" rows `[len(rows), V]`."""
        params = {i: hists[i].request.sampling for i in rows}
        biased = [i for i in rows if params[i].logit_bias]
        if biased:
            x.index_add_(0, self._index(biased), state("bias", biased))
        pairs: list[tuple[int, int, float]] = []  # (row, token, bias) of multi-token sequence biases
        for i in rows:
            toks, n = hists[i].request.token_ids, hists[i].length
            for seq, b in params[i].sequence_bias:
                if len(seq) - 1 <= n and toks[n - len(seq) + 1 : n] == list(seq[:-1]):
                    pairs.append((i, seq[-1], b))
        if pairs:
            r, t, b = zip(*pairs, strict=True)
            x.index_put_((self._index(r), self._index(t)), torch.tensor(b, device=self.device), accumulate=True)
        penalised = [i for i in rows if params[i].penalised]
        if penalised:
            counted = [i for i in penalised if _counted(params[i])]
            self._penalise(x, penalised, [params[i] for i in penalised], state("seen", penalised),
                           state("counts", counted) if counted else None)
        self._mask(x, rows, hists)

    def _history_state(self, name: str, hists: list[RowHistory], vocab: int) -> torch.Tensor:
        """The slot tensor `name` a request would hold at each history: [H, V] ("bias" fp32, "seen" bool over
        prompt + generated, "counts" int32 over generated)."""
        if name == "bias":
            out = torch.zeros(len(hists), vocab, dtype=torch.float32, device=self.device)
            r = [j for j, h in enumerate(hists) for _ in h.request.sampling.logit_bias]
            t = [t for h in hists for t, _ in h.request.sampling.logit_bias]
            b = [b for h in hists for _, b in h.request.sampling.logit_bias]
            out.index_put_((self._index(r), self._index(t)), torch.tensor(b, device=self.device))
            return out
        counts = torch.zeros(len(hists), vocab, dtype=torch.int32, device=self.device)
        runs: list[int] = []  # first row of each run of consecutive positions of one request
        r: list[int] = []
        t: list[int] = []
        prev: tuple[Request, int, int] | None = None  # (request, lo, hi) of the previous row's window
        for j, h in enumerate(hists):
            lo = 0 if name == "seen" else h.num_prompt
            toks = h.request.token_ids
            if prev is not None and prev[0] is h.request and h.length == prev[2] + 1 and (
                    lo == prev[1] or (prev[1] == prev[2] and lo >= prev[2])):
                if lo <= prev[2]:  # NOTE: one token more than the previous row's window
                    r.append(j)
                    t.append(toks[prev[2]])
            else:
                runs.append(j)
                r.extend([j] * (h.length - lo))
                t.extend(toks[lo : h.length])
            prev = (h.request, lo, h.length)
        if r:
            counts.index_put_((self._index(r), self._index(t)),
                              torch.ones(len(r), dtype=torch.int32, device=self.device), accumulate=True)
        for a, b in zip(runs, [*runs[1:], len(hists)], strict=True):
            if b - a > 1:
                counts[a:b] = counts[a:b].cumsum(dim=0, dtype=torch.int32)
        return counts > 0 if name == "seen" else counts

    def _penalise(self, x: torch.Tensor, rows: list[int], params: list[SamplingParams], seen: torch.Tensor,
                  counts: torch.Tensor | None) -> None:
        """transformers' repetition penalty over prompt + generated tokens (divide positive logits, multiply
        negative ones), then vLLM's frequency (x count) and presence (x seen) penalties over generated ones.
        `seen [P, V]` bool of the rows; `counts [C, V]` int32 of those with a presence / frequency penalty."""
        idx = self._index(rows)
        sub = x[idx]  # [P, V]
        if any(p.repetition_penalty != 1.0 for p in params):
            rep = torch.tensor([p.repetition_penalty for p in params], device=self.device)[:, None]  # [P, 1]
            sub = torch.where(seen, torch.where(sub < 0, sub * rep, sub / rep), sub)
        counted = [i for i, p in enumerate(params) if _counted(p)]
        if counted:  # NOTE: the RL case (repetition penalty only) skips the counts altogether
            cidx = self._index(counted)
            freq = torch.tensor([params[i].frequency_penalty for i in counted], device=self.device)[:, None]  # [C, 1]
            pres = torch.tensor([params[i].presence_penalty for i in counted], device=self.device)[:, None]  # [C, 1]
            sub[cidx] -= freq * counts + pres * (counts > 0)
        x[idx] = sub

    def _mask(self, x: torch.Tensor, rows: list[int], hists: Sequence[RowHistory]) -> None:
        """n-gram bans and minimum length (-inf), forced BOS / EOS (the row -inf but those tokens, at 0),
        begin-suppress (-inf): the per-row rules, gathered into one masked write each."""
        banned: list[tuple[int, int]] = []
        forced: list[tuple[int, tuple[int, ...]]] = []
        for i in rows:
            h = hists[i]
            req, p, n_gen = h.request, h.request.sampling, h.num_generated
            if p.no_repeat_ngram_size:
                banned.extend((i, t) for t in self._ngram_bans(h, p.no_repeat_ngram_size))
            if n_gen < p.min_tokens or h.length < p.min_length:
                banned.extend((i, t) for t in req.eos_token_ids)
            if p.forced_bos_token_id is not None and h.num_prompt == 1 and n_gen == 0:
                forced.append((i, (p.forced_bos_token_id,)))
            if p.forced_eos_token_ids and n_gen == req.max_new_tokens - 1:
                forced.append((i, p.forced_eos_token_ids))
        if banned:
            r, t = zip(*banned, strict=True)
            x.index_put_((self._index(r), self._index(t)), torch.tensor(_NEG_INF, device=self.device))
        for i, tokens in forced:  # NOTE: at most once per request (its first or last token)
            x[i] = _NEG_INF
            x[i, self._index(tokens)] = 0.0
        begin = [(i, t) for i in rows for t in hists[i].request.sampling.begin_suppress_tokens if _at_begin(hists[i])]
        if begin:
            r, t = zip(*begin, strict=True)
            x.index_put_((self._index(r), self._index(t)), torch.tensor(_NEG_INF, device=self.device))

    def _ngram_bans(self, h: RowHistory, n: int) -> list[int]:
        """Tokens that would repeat an n-gram of the history (transformers' NoRepeatNGram). The index maps each
        (n-1)-gram to its next tokens and where each first occurs, so one index serves any history length."""
        tokens, end = h.request.token_ids, h.length
        upto, index = self._ngrams.get(h.request.request_id, (0, {}))
        for start in range(upto, end - n + 1):
            index.setdefault(tuple(tokens[start : start + n - 1]), {}).setdefault(tokens[start + n - 1], start)
        self._ngrams[h.request.request_id] = (max(upto, end - n + 1), index)
        if end < n:
            return []
        nexts = index.get(tuple(tokens[end - n + 1 : end]), {})
        return [t for t, start in nexts.items() if start <= end - n]

    def update(self, reqs: Sequence[Request], tokens: torch.Tensor) -> None:
        """Record the tokens just sampled (`tokens [R]`) in the penalised rows' seen set and counts."""
        rows = [i for i, r in enumerate(reqs) if r.sampling.penalised]
        if rows:
            slots = self._index([self._slots[reqs[i].request_id] for i in rows])
            picked = tokens[self._index(rows)]
            self.seen[slots, picked] = True
        rows = [i for i, r in enumerate(reqs) if _counted(r.sampling)]
        if rows:
            slots = self._index([self._slots[reqs[i].request_id] for i in rows])
            ones = torch.ones(len(rows), dtype=torch.int32, device=self.device)
            self.counts.index_put_((slots, tokens[self._index(rows)]), ones, accumulate=True)

    def _index(self, values: Sequence[int]) -> torch.Tensor:
        return torch.tensor(list(values), dtype=torch.long, device=self.device)


def _counted(p: SamplingParams) -> bool:
    """Whether it needs generated-token counts (presence / frequency penalty)."""
    return p.presence_penalty != 0.0 or p.frequency_penalty != 0.0


def _at_begin(h: RowHistory) -> bool:
    """transformers' begin index: the first generated token (the second after a forced BOS of a 1-token prompt)."""
    begin = 1 if h.num_prompt == 1 and h.request.sampling.forced_bos_token_id is not None else 0
    return h.num_generated == begin
