"""The one definition of a row's logprobs: a sampled token's, its top k, and a scored (teacher-forced) token's.

"raw" is `log_softmax` of the model's logits. "processed" is log p under the distribution the sampler draws
from: the logits processors (`rollout.sampling.processors`, applied by the caller with the row's history:
`LogitsProcessors.apply` for a sampled row, `LogitsProcessors.apply_at` for a scored position), then the
warpers (`warped_logprobs`: temperature, top-k, top-p, min-p), renormalised. A greedy row (temperature 0)
reports the raw logprob in both modes. The sampler, its top k and `record_scores` all read `log_distribution`.
"""

from __future__ import annotations

import torch

from rollout.requests import SamplingParams

MODES = ("processed", "raw")


def needs_processors(params: list[SamplingParams], mode: str) -> bool:
    """Whether `log_distribution` reads the processed logits of these rows (else `processed` may be `raw`)."""
    return mode == "processed" and any(p.uses_processors and not p.greedy for p in params)


def log_distribution(
    raw: torch.Tensor,  # [R, V] fp32, the model's logits
    processed: torch.Tensor,  # [R, V] fp32, after the rows' logits processors (`raw` itself when none)
    params: list[SamplingParams],
    mode: str,
    warped: torch.Tensor | None = None,  # [S, V] warped_logprobs of the non-greedy rows, when already computed
) -> torch.Tensor:
    """[R, V] fp32 logprobs of each row under `mode`; -inf outside a processed row's kept set."""
    if mode == "raw" or all(p.greedy for p in params):
        # NOTE: log_softmax, not logsumexp: on a CPU torch's log_softmax is ~2x faster ([64, 32768] fp32:
        # 1.0 vs 2.0 ms at 2 threads), the same value to float rounding.
        return raw.log_softmax(dim=-1)
    s_rows = [i for i, p in enumerate(params) if not p.greedy]
    if len(s_rows) == len(params):  # NOTE: the common sampled step: the sampler's own tensor, no copy
        return warped if warped is not None else warped_logprobs(processed, params)
    s_idx = torch.tensor(s_rows, device=raw.device)
    if warped is None:
        warped = warped_logprobs(processed.index_select(0, s_idx), [params[i] for i in s_rows])
    g_idx = torch.tensor([i for i, p in enumerate(params) if p.greedy], device=raw.device)
    out = torch.empty_like(raw)  # [R, V]
    out.index_copy_(0, g_idx, raw.index_select(0, g_idx).log_softmax(dim=-1))
    out.index_copy_(0, s_idx, warped)
    return out


def warped_logprobs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """log p after the warpers: [S, V] fp32, -inf outside top-k / top-p / min-p (`logits` already processed).

    transformers' warper order: temperature, top-k, top-p, then min-p (tokens whose probability under the
    renormalised distribution is below `min_p` x the most likely one's)."""
    temps = torch.tensor([p.temperature for p in params], dtype=torch.float32, device=logits.device)
    scaled = logits.float() / temps[:, None]  # [S, V]
    top_k = [p.top_k for p in params]
    if any(k > 0 for k in top_k):
        vocab = scaled.shape[-1]
        host_ks = [min(k, vocab) if k > 0 else vocab for k in top_k]
        ks = torch.tensor(host_ks, device=logits.device)
        kmax = max(host_ks)  # NOTE: from the host list: no device read (a sync on CUDA)
        top_vals = scaled.topk(kmax, dim=-1).values  # [S, kmax]
        kth = top_vals.gather(1, (ks - 1)[:, None])  # [S, 1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    top_p = [p.top_p for p in params]
    if any(p < 1.0 for p in top_p):
        ps = torch.tensor(top_p, dtype=torch.float32, device=logits.device)
        sorted_logits, order = scaled.sort(dim=-1, descending=True)  # [S, V]
        probs = sorted_logits.softmax(dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs  # [S, V]
        drop_sorted = mass_before >= ps[:, None]
        drop_sorted[:, 0] = False  # NOTE: always keep the most likely token
        drop = torch.zeros_like(drop_sorted).scatter(1, order, drop_sorted)
        scaled = scaled.masked_fill(drop, float("-inf"))
    min_p = [p.min_p for p in params]
    if any(m > 0.0 for m in min_p):
        probs = scaled.softmax(dim=-1)  # [S, V]
        ms = torch.tensor(min_p, dtype=torch.float32, device=logits.device)
        drop = probs < ms[:, None] * probs.amax(dim=-1, keepdim=True)  # NOTE: never the most likely token
        scaled = scaled.masked_fill(drop, float("-inf"))
    return torch.log_softmax(scaled, dim=-1)


def top_k(dist: torch.Tensor, k: int) -> tuple[list[list[float]], list[list[int]]]:
    """The k most likely tokens of each row of `dist` [R, V]: (values [R, k], ids [R, k]) as lists."""
    vals, ids = dist.topk(k, dim=-1)  # [R, k]
    return vals.tolist(), ids.tolist()
