"""How many KV pages to make and how many tokens a step may hold: the memory plan.

`plan_cache` splits a memory budget (a share of the free GPU memory, or of the available host RAM on a
CPU) between the paged cache, one step's transient tensors (`step_bytes_per_token`) and the attention
backend's temporaries (`AttnMemory`, declared by each backend).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import psutil
import torch

logger = logging.getLogger("rollout")

GiB = 1 << 30
# NOTE: on a CPU the "device" cache is host RAM shared with everything else: by default take at most
# 5% of the available RAM and never more than 1 GiB (that still holds ~250k tokens of a 5M model).
CPU_CACHE_FRACTION = 0.05
CPU_CACHE_CAP_BYTES = 1 * GiB
# NOTE: the sequences a default-sized cache is made to hold at the model's full context (vLLM's max_num_seqs)
DEFAULT_CONCURRENCY = 256
DEFAULT_MAX_BATCH_TOKENS = 8192
MIN_MAX_BATCH_TOKENS = 256


@dataclass(frozen=True, slots=True)
class KVShape:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype

    @property
    def bytes_per_token(self) -> int:
        return (
            2 * self.num_layers * self.num_kv_heads * self.head_dim * torch.empty((), dtype=self.dtype).element_size()
        )


def kv_shape_from_config(config, dtype: torch.dtype, tp_size: int = 1) -> KVShape:
    """Best estimate of the KV footprint from a HF config (used for sizing; tensors use real shapes); with
    tensor parallelism, of one rank's shard (`num_key_value_heads / tp_size` heads, see rollout.engine.tp)."""
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return KVShape(config.num_hidden_layers, kv_heads // tp_size, head_dim, dtype)


def step_bytes_per_token(config, dtype: torch.dtype, max_requests: int | None = None) -> tuple[int, int]:
    """Rough transient memory of one forward: `(bytes per query token, bytes per sampled row)`.

    Per token: the residual stream and its norms, q/k/v/o projections and the MLP's hidden (a
    few copies each, as the autograd-free forward keeps at most two layers' worth alive). Per sampled
    row: its logits in the model's dtype plus the fp32 copy the sampler works on.
    """
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    elt = torch.empty((), dtype=dtype).element_size()
    hidden = config.hidden_size
    inter = getattr(config, "intermediate_size", None) or getattr(config, "n_inner", None) or 4 * hidden
    vocab = config.vocab_size
    return (8 * hidden + 3 * inter) * elt, vocab * (elt + 4)


@dataclass(frozen=True, slots=True)
class AttnMemory:
    """Transient memory of an attention backend in one step, counted by `plan_cache`.

    per_query_token: bytes per query token of the step (block masks, index tensors).
    fixed: bytes whatever the step (the chunked softcap scores).
    per_cache_byte: bytes per byte of KV cache (a gather reads at most this share of the cache in a layer).
    """

    per_query_token: int = 0
    fixed: int = 0
    per_cache_byte: float = 0.0


def cpu_budget(share: float | None = None) -> int:
    """Bytes a CPU engine may keep for KV: `share` of the available RAM when given, else
    min(5% of the available RAM, 1 GiB)."""
    available = psutil.virtual_memory().available
    if share is not None:
        return int(available * share)
    return min(int(available * CPU_CACHE_FRACTION), CPU_CACHE_CAP_BYTES)


def plan_cache(
    shape: KVShape,
    page_size: int,
    num_pages: int | None,
    max_batch_tokens: int | None,
    max_memory_percent: float,
    device: torch.device,
    step_bytes: tuple[int, int] = (0, 0),
    max_requests: int | None = None,
    cpu_share_set: bool = False,
    attn: AttnMemory = AttnMemory(),
    context_pages: int | None = None,
) -> tuple[int, int]:
    """Returns `(num_pages, max_batch_tokens)`.

    The memory budget is `max_memory_percent` of the free accelerator memory on CUDA. On a CPU it is
    that share of the available RAM when it was set explicitly (`cpu_share_set`), else
    min(5% of the available RAM, 1 GiB): that RAM is shared with the trainer, the data and the OS, so
    by default we do not reserve most of it up front (the tensors are `torch.empty`, so pages of it are only
    touched as the cache fills; a 4-layer, 256-wide fp32 model's KV is 8 KiB per token, so 1 GiB
    holds ~130k tokens).

    `max_batch_tokens` defaults to 8192, lowered until one step's transient memory (`step_bytes`:
    activations per query token and logits per sampled row, at most `max_requests` rows) plus the KV
    it writes fit in a quarter of the budget, and never under 256; nothing in a step grows with its
    square. The attention backend's temporaries (`attn`) count too: per query token (in the step),
    fixed, and in proportion to the cache (what a gather may copy out of it in one layer). On CUDA
    the step memory is then taken out of the budget; on a CPU the step is transient. The rest, less
    the fixed temporaries, is the cache and its gathers: `num_pages` is what that holds, at least 1, and
    no more than `DEFAULT_CONCURRENCY` (or `max_requests`) sequences of the model's whole context need
    (`context_pages` a sequence), twice over for the prefix cache: a model with a 128-token context gets a
    cache of a few MiB, not the budget's GiB.
    """
    per_token = shape.bytes_per_token
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        budget = int(free * max_memory_percent)
    else:
        budget = cpu_budget(max_memory_percent if cpu_share_set else None)
    act_per_token, logits_per_row = step_bytes

    def step_memory(tokens: int) -> int:
        rows = min(tokens, max_requests or tokens)
        return tokens * (act_per_token + per_token + attn.per_query_token) + rows * logits_per_row

    if max_batch_tokens is None:
        max_batch_tokens = DEFAULT_MAX_BATCH_TOKENS
        while max_batch_tokens > MIN_MAX_BATCH_TOKENS and step_memory(max_batch_tokens) > budget // 4:
            max_batch_tokens //= 2
        max_batch_tokens = max(MIN_MAX_BATCH_TOKENS, max_batch_tokens)
    if num_pages is None:
        # NOTE: the backend's fixed temporaries never shrink the step: they come out of the cache's share
        cache_budget = budget - attn.fixed - (step_memory(max_batch_tokens) if device.type == "cuda" else 0)
        num_pages = max(1, int(cache_budget / (per_token * page_size * (1 + attn.per_cache_byte))))
        if context_pages:
            num_pages = min(num_pages, 2 * context_pages * (max_requests or DEFAULT_CONCURRENCY))
    return num_pages, max_batch_tokens
