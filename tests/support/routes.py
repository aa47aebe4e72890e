"""The oracle for recorded routes: the top-k of HF's router logits in a teacher-forced forward
(`output_router_logits=True`), and the comparison of an engine's `routed_experts` rows with it."""

from __future__ import annotations

import torch

# NOTE: the engine's forward is not HF's bit for bit (paged attention, packed linears): where HF's k-th and
# (k+1)-th router logits are closer than this, either choice is right.
TIE = 1e-4


@torch.no_grad()
def hf_routes(model, tokens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """`(experts [S, L, k] sorted, gap [S, L])` for one sequence: the top-k of each MoE layer's router logits and
    the margin between its k-th and (k+1)-th logit."""
    ids = torch.tensor([tokens], device=model.device)
    logits = torch.stack(model(ids, output_router_logits=True).router_logits, dim=1).float()  # [S, L, E]
    k = next(m.top_k for m in model.modules() if type(m).__name__.endswith("TopKRouter"))
    top = logits.topk(k + 1, dim=-1)
    return top.indices[..., :k].sort(dim=-1).values, top.values[..., k - 1] - top.values[..., k]


def assert_row_routes(model, tokens: list[int], routes: torch.Tensor) -> int:
    """`routes [len(tokens), L, k]` (a row's recorded experts, the last token's -1) are HF's top-k at every token
    before the last; returns how many (token, layer) pairs were near-ties decided the other way."""
    assert routes.shape[0] == len(tokens)
    assert (routes[-1] == -1).all(), "the last sampled token never ran: its routes must be -1"
    got = routes[:-1].long().sort(dim=-1).values  # [S - 1, L, k]
    assert (got >= 0).all(), f"positions without routes: {(got < 0).any(-1).any(-1).nonzero().flatten().tolist()}"
    want, gap = hf_routes(model, tokens[:-1])
    differ = (got != want.to(got.device)).any(dim=-1)  # [S - 1, L]
    assert (gap.to(differ.device)[differ] < TIE).all(), (
        f"routes differ from HF's top-k at (token, layer) {differ.nonzero().tolist()[:8]}")
    return int(differ.sum())


def batch_rows(batch) -> list[tuple[list[int], torch.Tensor]]:
    """Each row of a `RolloutBatch` as (its tokens, its routes [tokens, L, k]), padding dropped."""
    mask = batch.attention_mask.bool()
    return [(batch.input_ids[i][mask[i]].tolist(), batch.routed_experts[i][mask[i]]) for i in range(len(batch))]
