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
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from rollout.requests import Request, SamplingParams

_NEG_INF = float("-inf")


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
        self._ngrams: dict[str, tuple[int, dict[tuple[int, ...], set[int]]]] = {}  # id -> (indexed upto, index)

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
        """The processed logits `[R, V]` fp32 (a new tensor; `logits` is left as it was)."""
        vocab = logits.shape[-1]
        x = logits.clone()  # [R, V]
        rows = [i for i, r in enumerate(reqs) if r.sampling.uses_processors]
        slots = {i: self._slot(reqs[i], vocab) for i in rows}
        biased = [i for i in rows if reqs[i].sampling.logit_bias]
        if biased:
            idx = self._index(biased)
            x.index_add_(0, idx, self.bias[self._index([slots[i] for i in biased])])
        pairs: list[tuple[int, int, float]] = []  # (row, token, bias) of multi-token sequence biases
        for i in rows:
            for seq, b in reqs[i].sampling.sequence_bias:
                hist = reqs[i].token_ids
                if len(seq) - 1 <= len(hist) and hist[len(hist) - len(seq) + 1:] == list(seq[:-1]):
                    pairs.append((i, seq[-1], b))
        if pairs:
            r, t, b = zip(*pairs, strict=True)
            x.index_put_((self._index(r), self._index(t)), torch.tensor(b, device=self.device), accumulate=True)
        penalised = [i for i in rows if reqs[i].sampling.penalised]
        if penalised:
            self._penalise(x, penalised, [reqs[i].sampling for i in penalised], [slots[i] for i in penalised])
        self._mask(x, rows, reqs)
        return x

    def _penalise(self, x: torch.Tensor, rows: list[int], params: list[SamplingParams], slots: list[int]) -> None:
        """transformers' repetition penalty over prompt + generated tokens (divide positive logits, multiply
        negative ones), then vLLM's frequency (x count) and presence (x seen) penalties over generated ones."""
        idx, sidx = self._index(rows), self._index(slots)
        sub = x[idx]  # [P, V]
        if any(p.repetition_penalty != 1.0 for p in params):
            rep = torch.tensor([p.repetition_penalty for p in params], device=self.device)[:, None]  # [P, 1]
            sub = torch.where(self.seen[sidx], torch.where(sub < 0, sub * rep, sub / rep), sub)
        counted = [i for i, p in enumerate(params) if _counted(p)]
        if counted:  # NOTE: the RL case (repetition penalty only) skips the counts altogether
            cidx = self._index(counted)
            counts = self.counts[sidx[cidx]]  # [C, V] int32
            freq = torch.tensor([params[i].frequency_penalty for i in counted], device=self.device)[:, None]  # [C, 1]
            pres = torch.tensor([params[i].presence_penalty for i in counted], device=self.device)[:, None]  # [C, 1]
            sub[cidx] -= freq * counts + pres * (counts > 0)
        x[idx] = sub

    def _mask(self, x: torch.Tensor, rows: list[int], reqs: Sequence[Request]) -> None:
        """n-gram bans and minimum length (-inf), forced BOS / EOS (the row -inf but those tokens, at 0),
        begin-suppress (-inf): the per-row rules, gathered into one masked write each."""
        banned: list[tuple[int, int]] = []
        forced: list[tuple[int, tuple[int, ...]]] = []
        for i in rows:
            req, p = reqs[i], reqs[i].sampling
            n_gen = len(req.generated)
            if p.no_repeat_ngram_size:
                banned.extend((i, t) for t in self._ngram_bans(req, p.no_repeat_ngram_size))
            if n_gen < p.min_new_tokens or req.num_prompt_tokens + n_gen < p.min_length:
                banned.extend((i, t) for t in req.eos_token_ids)
            if p.forced_bos_token_id is not None and req.num_prompt_tokens == 1 and n_gen == 0:
                forced.append((i, (p.forced_bos_token_id,)))
            if p.forced_eos_token_ids and n_gen == req.max_new_tokens - 1:
                forced.append((i, p.forced_eos_token_ids))
        if banned:
            r, t = zip(*banned, strict=True)
            x.index_put_((self._index(r), self._index(t)), torch.tensor(_NEG_INF, device=self.device))
        for i, tokens in forced:  # NOTE: at most once per request (its first or last token)
            x[i] = _NEG_INF
            x[i, self._index(tokens)] = 0.0
        begin = [(i, t) for i in rows for t in reqs[i].sampling.begin_suppress_tokens if _at_begin(reqs[i])]
        if begin:
            r, t = zip(*begin, strict=True)
            x.index_put_((self._index(r), self._index(t)), torch.tensor(_NEG_INF, device=self.device))

    def _ngram_bans(self, req: Request, n: int) -> set[int]:
        """Tokens that would repeat an n-gram of prompt + generated (transformers' NoRepeatNGram)."""
        tokens = req.token_ids
        upto, index = self._ngrams.get(req.request_id, (0, {}))
        for start in range(upto, len(tokens) - n + 1):
            index.setdefault(tuple(tokens[start : start + n - 1]), set()).add(tokens[start + n - 1])
        self._ngrams[req.request_id] = (max(upto, len(tokens) - n + 1), index)
        if len(tokens) < n:
            return set()
        return index.get(tuple(tokens[len(tokens) - n + 1 :]), set())

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


def _at_begin(req: Request) -> bool:
    """transformers' begin index: the first generated token (the second after a forced BOS of a 1-token prompt)."""
    p = req.sampling
    begin = 1 if req.num_prompt_tokens == 1 and p.forced_bos_token_id is not None else 0
    return len(req.generated) == begin
