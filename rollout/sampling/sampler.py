"""Vectorised per-request sampling with fp32 logprobs.

Each row has its own temperature, top-k, top-p, min-p and (optionally) seed, and its own logits
processors (penalties, biases, bans, forced tokens: `rollout.sampling.processors`, applied first, only on the
rows that use them). Sampling uses the exponential race (argmax of log p - log E, E ~ Exp(1)), which
draws exactly from p. A seeded row's noise depends on its seed and its own stream only, never on what else is in
the batch, drawn one of two ways (`seed_stream`): "generator" (the CPU default) gives each seeded request its own
`torch.Generator`, one host call per row and step; "counter" (the CUDA default) computes every seeded row's noise
in one vectorised draw from the counter-based generator of `rollout.sampling.seeding` (Philox4x32-10 keyed by the
row's seed, counter (token, position = tokens it generated before, purpose)): stateless, the same bits on every
device, nothing a CUDA graph cannot hold. The two streams give different (equally distributed) samples.

Logprobs, and the top k of a row whose request asks for them, come from one tensor per step,
`rollout.sampling.log_distribution.log_distribution` ("processed": the distribution actually sampled from, the
logits processors and the warpers; "raw": `log_softmax` of the unmodified logits; greedy rows raw in both).
"""

from __future__ import annotations

import secrets
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from rollout.kernels import cpu_kernels
from rollout.requests import Request, SamplingParams
from rollout.sampling.log_distribution import log_distribution, top_k, warped_logprobs
from rollout.sampling.processors import LogitsProcessors
from rollout.sampling.seeding import counter_exponential
from rollout.tensors import int_tensor


@dataclass(slots=True)
class SamplerOutput:
    tokens: list[int]
    logprobs: list[float] | None
    # NOTE: per row, (top values, top ids, the sampled token's 1-based rank) of a row whose request has
    # top_logprobs > 0, else None
    top: list[tuple[list[float], list[int], int] | None] | None = None
    # NOTE: per row, the ids it could have drawn (`support`) when its request asks for a sampling mask, else None
    masks: list[list[int] | None] | None = None


class Sampler:
    """Samples one token per row. Unseeded rows draw from the sampler's own generator (seeded from the OS
    unless `seed` is given); torch's global RNG is never read or reseeded.

    Args:
        device: where the logits live.
        seed: seed of the generator of unseeded rows (None: fresh OS entropy).
        seed_stream: how seeded rows draw, "generator" or "counter" (see the module docstring).
    """

    def __init__(self, device: torch.device, seed: int | None = None, seed_stream: str = "generator",
                 exact_logprobs: bool = False) -> None:
        if seed_stream not in ("generator", "counter"):
            raise ValueError(f"seed_stream must be 'generator' or 'counter', got {seed_stream!r}")
        self.device = device
        # NOTE: True: every logprob through torch's log_softmax (bitwise a trainer's, batch-invariant engines); False:
        # a greedy step's logprobs on a CPU may come from `cpu_kernels.greedy_verify` (float rounding apart)
        self.exact_logprobs = exact_logprobs
        self.seed_stream = seed_stream
        # NOTE: counter stream without the requests' histories: draws made so far per request (as a generator's)
        self._draws: dict[str, int] = {}
        self.generator = torch.Generator(device=device)
        # NOTE: not torch.seed(), which reseeds the global generator (a trainer's seeding would be lost).
        self.generator.manual_seed(seed if seed is not None else secrets.randbits(62))
        self._row_generators: dict[str, torch.Generator] = {}
        self.processors = LogitsProcessors(device)

    def generator_for(self, request_id: str, seed: int) -> torch.Generator:
        g = self._row_generators.get(request_id)
        if g is None:
            g = self._row_generators[request_id] = torch.Generator(device=self.device)
            g.manual_seed(seed)
        return g

    def forget(self, request_id: str) -> None:
        self._row_generators.pop(request_id, None)
        self._draws.pop(request_id, None)
        self.processors.release(request_id)

    @torch.inference_mode()
    def __call__(
        self,
        logits: torch.Tensor,  # [R, V] fp32
        params: list[SamplingParams],
        request_ids: list[str],
        logprobs_mode: str | None,  # None: no logprobs; "processed" or "raw"
        requests: Sequence[Request] | None = None,  # the rows' requests: their histories, for the processors
        top_mode: str | None = None,  # the mode of the rows' top k (default `logprobs_mode`)
    ) -> SamplerOutput:
        raw = logits.float()  # [R, V]
        top_mode = top_mode or logprobs_mode
        wants = [] if requests is None or top_mode is None else [i for i, r in enumerate(requests) if r.top_logprobs]
        masked = [] if requests is None else [i for i, r in enumerate(requests) if r.sampling.return_sampling_mask]
        processed = raw
        uses = any(p.uses_processors for p in params)
        if uses:
            if requests is None:  # NOTE: never sample without a processor a row asked for
                raise ValueError("rows with logits processors need their requests (the token histories)")
            processed = self.processors.apply(raw, requests)  # [R, V], a new tensor
        s_rows = [i for i, p in enumerate(params) if not p.greedy]
        if not s_rows and logprobs_mode is None and not wants and not masked:  # NOTE: the common greedy step
            tokens = row_argmax(processed)  # [R]
            if uses:
                self.processors.update(requests, tokens)
            return SamplerOutput(tokens.tolist(), None)
        if not s_rows and not uses and not wants and not masked and not self.exact_logprobs:
            fast = greedy_logprobs(raw)  # NOTE: greedy with logprobs (an RL engine's default) in one kernel call
            if fast is not None:
                return fast
        tokens = torch.empty(raw.shape[0], dtype=torch.long, device=raw.device)  # [R]
        g_rows = [i for i, p in enumerate(params) if p.greedy]
        if g_rows:
            idx, sub = _take(processed, g_rows)
            tokens[idx] = row_argmax(sub)
        warped = None
        if s_rows:
            idx, rows = _take(processed, s_rows)
            sub = [params[i] for i in s_rows]
            warped = warped_logprobs(rows, sub)  # [S, V]
            noise = self._noise(warped.shape, [request_ids[i] for i in s_rows], sub,
                                None if requests is None else [requests[i] for i in s_rows])  # [S, V]
            tokens[idx] = row_argmax(warped - noise.log())  # [S]
        if uses:
            self.processors.update(requests, tokens)
        chosen = top = token_list = masks = None
        if masked:
            masks = support(tokens, warped, s_rows, masked, raw.shape[0])
        if logprobs_mode is not None:
            dist = log_distribution(raw, processed, params, logprobs_mode, warped)  # [R, V]
            # NOTE: tokens and their logprobs reach the host in one read (fp64 holds both exactly)
            both = torch.stack([tokens.double(), dist.gather(1, tokens[:, None])[:, 0].double()]).tolist()  # [2, R]
            token_list, chosen = [int(t) for t in both[0]], both[1]
        if wants:
            if top_mode != logprobs_mode:
                dist = log_distribution(raw, processed, params, top_mode, warped)  # [R, V]
            idx = torch.tensor(wants, device=raw.device)
            rows = dist.index_select(0, idx)  # [W, V]
            vals, ids = top_k(rows, max(requests[i].top_logprobs for i in wants))
            # NOTE: vLLM's rank of the sampled token: 1 + how many tokens are strictly more likely
            sampled_lp = rows.gather(1, tokens.index_select(0, idx)[:, None])  # [W, 1]
            ranks = ((rows > sampled_lp).sum(dim=-1) + 1).tolist()
            top = [None] * raw.shape[0]
            for j, i in enumerate(wants):
                k = requests[i].top_logprobs
                top[i] = (vals[j][:k], ids[j][:k], ranks[j])
        return SamplerOutput(tokens.tolist() if token_list is None else token_list, chosen, top, masks)

    @torch.inference_mode()
    def draw(self, logits: torch.Tensor, params: list[SamplingParams], request_ids: list[str],
             logprobs_mode: str | None, positions: list[int]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Tokens [R] (int64) and their logprobs [R] (fp32, or None without `logprobs_mode`) left on the device: no
        host read, for a step whose rows use no logits processor and want no top logprobs (an asynchronous step,
        `rollout.engine.async_steps`). `positions`: each row's stream position (tokens its request generated
        before this draw), taken by the caller when it queued the step. The same tokens as `__call__`."""
        raw = logits.float()  # [R, V]
        if any(p.uses_processors for p in params):
            raise ValueError("Sampler.draw takes rows without logits processors (use the sampler's call)")
        s_rows = [i for i, p in enumerate(params) if not p.greedy]
        if not s_rows:
            tokens = row_argmax(raw)  # [R]
            return tokens, None if logprobs_mode is None else raw.log_softmax(-1).gather(1, tokens[:, None])[:, 0]
        tokens = torch.empty(raw.shape[0], dtype=torch.long, device=raw.device)  # [R]
        g_rows = [i for i, p in enumerate(params) if p.greedy]
        if g_rows:
            idx, sub = _take(raw, g_rows)
            tokens[idx] = row_argmax(sub)
        idx, rows = _take(raw, s_rows)
        sub = [params[i] for i in s_rows]
        warped = warped_logprobs(rows, sub)  # [S, V]
        noise = self._noise(
            warped.shape, [request_ids[i] for i in s_rows], sub, positions=[positions[i] for i in s_rows]
        )
        tokens[idx] = row_argmax(warped - noise.log())  # [S]
        if logprobs_mode is None:
            return tokens, None
        dist = log_distribution(raw, raw, params, logprobs_mode, warped)  # [R, V]
        return tokens, dist.gather(1, tokens[:, None])[:, 0]

    def _noise(self, shape: torch.Size, request_ids: list[str], params: list[SamplingParams],
               requests: Sequence[Request] | None = None, positions: list[int] | None = None) -> torch.Tensor:
        """Exp(1) noise [S, V]: one shared draw for unseeded rows, a per-request stream for seeded ones."""
        noise = torch.empty(shape, dtype=torch.float32, device=self.device)
        seeded = [i for i, p in enumerate(params) if p.seed is not None]
        if len(seeded) < len(params):
            noise.exponential_(generator=self.generator)
        if self.seed_stream == "counter":
            if seeded:
                positions = (self._positions(seeded, request_ids, requests) if positions is None
                             else [positions[i] for i in seeded])
                rows = counter_exponential([params[i].seed for i in seeded], positions, shape[1], self.device)
                if len(seeded) == len(params):
                    return rows  # [S, V]
                noise.index_copy_(0, int_tensor(seeded, self.device), rows)
            return noise
        for i in seeded:
            noise[i].exponential_(generator=self.generator_for(request_ids[i], params[i].seed))
        return noise

    def _positions(self, seeded: list[int], request_ids: list[str], requests: Sequence[Request] | None) -> list[int]:
        """Each seeded row's position in its stream: the tokens its request generated before this draw (a
        preempted, recomputed or speculated row draws at the same place), or without the requests the draws
        made so far for that id (`forget` starts again)."""
        if requests is not None:
            return [len(requests[i].generated) for i in seeded]
        out = []
        for i in seeded:
            n = self._draws.get(request_ids[i], 0)
            self._draws[request_ids[i]] = n + 1
            out.append(n)
        return out


def resolve_seed_stream(setting: str, device: torch.device) -> str:
    """The seeded rows' stream of a `seed_stream` setting on `device` ("auto": "counter" on CUDA, else
    "generator", so seeded CPU samples stay what they were)."""
    if setting != "auto":
        return setting
    return "counter" if device.type == "cuda" else "generator"


def support(tokens: torch.Tensor, warped: torch.Tensor | None, s_rows: list[int], rows: list[int],
            num_rows: int) -> list[list[int] | None]:
    """Per row of `rows`, the token ids it could have drawn: where its warped distribution (after the logits
    processors, temperature, top-k, top-p and min-p: `warped_logprobs`, the tensor the draw read) is above -inf;
    a greedy row could only draw its argmax. None for the other rows."""
    out: list[list[int] | None] = [None] * num_rows
    where = {i: j for j, i in enumerate(s_rows)}
    for i in rows:
        j = where.get(i)
        if j is None:
            out[i] = [int(tokens[i])]
        else:
            out[i] = torch.isfinite(warped[j]).nonzero()[:, 0].tolist()  # NOTE: sorted ascending
    return out


def kernel_rows(x: torch.Tensor) -> bool:
    """Whether rollout's row kernels (`argmax_rows`, `greedy_verify`) take `x`: fp32 CPU [R, V], V >= 1."""
    return x.dtype is torch.float32 and x.is_cpu and x.dim() == 2 and x.shape[1] > 0


def greedy_logprobs(raw: torch.Tensor) -> SamplerOutput | None:
    """Each row's argmax and its raw logprob (a greedy row's logprob in both modes: `log_distribution`) in one call
    of `cpu_kernels.greedy_verify` for fp32 CPU logits (its argmax is `row_argmax`'s, index for index; its
    log-softmax torch's to float rounding: within 1.5e-7, tests/kernels/test_argmax.py), instead of an argmax, a
    log_softmax over every row, a gather and a read (each op 3-5x slower right after a forward: ~150 us of a 4-row 5M
    step); None elsewhere."""
    if not kernel_rows(raw):
        return None
    kernel = cpu_kernels.greedy_verify()
    if kernel is None:
        return None
    out = kernel(raw, [1] * raw.shape[0], [], True)  # NOTE: [token, logprob] per row
    return SamplerOutput([int(t) for t in out[0::2]], out[1::2])


def row_argmax(x: torch.Tensor) -> torch.Tensor:  # [R, V] -> [R] int64
    """`x.argmax(dim=-1)`, the same indices; fp32 CPU rows through rollout's kernel (`cpu_kernels.argmax_rows`:
    torch's took 0.46 ms for 16 rows x 32768, most of a 100M model's sampling step)."""
    if kernel_rows(x):
        kernel = cpu_kernels.argmax_rows()
        if kernel is not None:
            return kernel(x)
    return x.argmax(dim=-1)


def _take(logits: torch.Tensor, rows: list[int]) -> tuple[slice | torch.Tensor, torch.Tensor]:
    """(index, logits[rows]): every row in order is a slice and the logits themselves, no [R, V] copy."""
    if len(rows) == logits.shape[0]:  # NOTE: rows are increasing, so all of them means 0 .. R - 1
        return slice(None), logits
    idx = int_tensor(rows, logits.device)  # NOTE: from pinned memory on CUDA: no synchronising upload
    return idx, logits.index_select(0, idx)
