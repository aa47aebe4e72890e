"""How an engine's KV cache is sized: the shape of one page across a layer group's layers, how many pages
and query tokens per step fit the memory budget beside the attention backend's step temporaries, and how
many pages the CPU offload buffer holds; under tensor parallelism the smallest of every rank's figures."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rollout.attention.backends import attention_memory
from rollout.config import ContinuousBatchingConfig
from rollout.engine.tp import TensorParallelGroup, tp_size_of
from rollout.kv.memory_plan import KVShape, kv_shape_from_config, plan_cache, step_bytes_per_token
from rollout.kv.offload import plan_offload
from rollout.model.model_facts import text_config


@dataclass(frozen=True)
class CachePlan:
    shape: KVShape  # one page's layout: layers of the largest group x KV heads x head size, dtype
    num_pages: int
    max_batch_tokens: int
    offload_pages: int  # pages of the CPU offload buffer (0: preemption recomputes)


def plan_engine_cache(model: torch.nn.Module, config: ContinuousBatchingConfig, device: torch.device,
                      dtype: torch.dtype, groups: list[int], attn_name: str,
                      tp: TensorParallelGroup | None) -> CachePlan:
    """The cache of an engine on `model` with layers in `groups` (the group of each layer, which share a
    storage: a page costs the largest group's layers) and attention backend `attn_name`."""
    per_layer = kv_shape_from_config(model.config, dtype, tp_size_of(model))
    shape = KVShape(max(groups.count(g) for g in set(groups)), per_layer.num_kv_heads, per_layer.head_dim, dtype)
    tc = text_config(model)
    max_pages = -(-(getattr(tc, "max_position_embeddings", None) or 32768) // config.page_size)
    attn_memory = attention_memory(attn_name, shape, config.page_size, config.max_batch_tokens,
                                   bool(getattr(tc, "attn_logit_softcapping", None)), max_pages)
    num_pages, max_batch_tokens = plan_cache(
        shape, config.page_size, config.num_blocks, config.max_batch_tokens, config.max_memory_percent, device,
        step_bytes_per_token(model.config, dtype), config.max_requests_per_batch,
        cpu_share_set=config.memory_percent_set, attn=attn_memory,
        context_pages=max_pages if getattr(tc, "max_position_embeddings", None) else None,
    )
    offload_pages = plan_offload(config.cpu_offload_space, config.cpu_offload_space_safety_threshold,
                                 config.page_size * shape.bytes_per_token)
    if tp is not None:
        num_pages, max_batch_tokens = tp.agree_min(num_pages, max_batch_tokens)
        offload_pages = tp.agree_min(offload_pages)[0]
    return CachePlan(shape, num_pages, max_batch_tokens, offload_pages)


def engine_cache_stats(core) -> dict:
    """An `EngineCore`'s cache and step counters (`cache_stats`)."""
    pool = core.page_pool
    return {  # NOTE: num_blocks / free_blocks are the seed API's (transformers') names for pages
        "num_blocks": pool.num_pages,
        "free_blocks": pool.num_free_pages,
        "page_size": pool.page_size,
        "cached_pages": len(pool.cached),
        "preemptions": core.scheduler.num_preemptions,
        "offloaded_pages": core.scheduler.num_offloaded_pages,
        "restored_pages": core.scheduler.num_restored_pages,
        "offload_fallbacks": core.scheduler.num_offload_fallbacks,
        "offload_free_pages": core.cache.offload.num_free if core.cache.offload else 0,
        "recycled_pages": core.scheduler.num_recycled_pages,
        "peak_used_pages": core.scheduler.peak_used_pages,
        "cached_prompt_tokens": core.scheduler.num_cached_prompt_tokens,
        "kv_bytes": core.cache.nbytes,
        "max_batch_tokens": core.max_batch_tokens,
        **core.stats,
    }
