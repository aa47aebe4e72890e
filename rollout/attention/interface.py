"""The transformers entry point of rollout's paged attention (registered with `AttentionInterface`).

Every step is one packed forward over `[1, T]` tokens. The per-step `AttentionMetadata`
(`rollout.attention.backends.base`) reaches the attention function through the model's forward kwargs
(`rollout_meta=`), never a module global. For every layer, `paged_attention_forward` checks what the
layer asks for (its kwargs, its window, sinks against the backend's `supports_sinks`), writes the step's
K/V into the layer's cache through its group's `slot_mapping`, and hands the layer to the step's
backend (`meta.backend.attend`); how attention runs over the pages is the backend's (`rollout.attention.backends`).

Owns `ATTN_NAME`, `paged_attention_forward`, the kwargs it ignores or refuses (`IGNORED_KWARGS`,
`check_kwargs`) and `register`.
"""

from __future__ import annotations

import torch

from rollout.attention.backends.base import AttentionMetadata
from rollout.kernels import cpu_kernels

ATTN_NAME = "rollout_paged"


def paged_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,  # [1, H, T, D]
    key: torch.Tensor,  # [1, Hkv, T, D]
    value: torch.Tensor,  # [1, Hkv, T, D]
    attention_mask: torch.Tensor | None = None,
    scaling: float | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    rollout_meta: AttentionMetadata | None = None,
    s_aux: torch.Tensor | None = None,  # [H] attention sinks (gpt-oss)
    dropout: float = 0.0,
    **kwargs,
) -> tuple[torch.Tensor, None]:  # ([1, T, H, D], no weights)
    meta = rollout_meta
    if meta is None:
        raise RuntimeError(
            f"attention '{ATTN_NAME}' was called without rollout metadata: it only runs inside the rollout engine"
        )
    check_kwargs(module, kwargs, dropout)
    if s_aux is not None and not meta.backend.supports_sinks:
        raise ValueError(f"attn_backend {meta.backend.name!r} does not implement attention sinks "
                         "(s_aux); use attn_backend='sdpa'")
    _, num_heads, _, head_dim = query.shape
    num_kv_heads = key.shape[1]
    layer = getattr(module, "layer_idx", None)
    if layer is None:
        layer = meta.cache.layer_index(module)
    if meta.layers_seen is not None:
        meta.layers_seen.add(layer)
    group = meta.groups[meta.cache.group_of(layer)]
    window = sliding_window if sliding_window else None
    if window != group.window:
        raise RuntimeError(
            f"layer {layer} attends with sliding_window={window} but its config announced {group.window}; "
            "rollout reads the windows from config.layer_types / config.sliding_window"
        )
    k_cache, v_cache = meta.cache.layer(layer, num_kv_heads, head_dim)  # [Hkv, S, D] head-major
    k, v, slots = key[0], value[0], group.slot_mapping
    writer = cpu_kernels.write_kv() if k_cache.device.type == "cpu" else None
    if writer is not None and k.dtype is k_cache.dtype and v.dtype is v_cache.dtype and slots.dtype is torch.long \
            and k.stride(-1) == 1 and v.stride(-1) == 1:
        writer(k_cache, v_cache, slots, k, v)  # NOTE: one call for both (two index_copy_ cost ~15-20 us each)
    else:
        k_cache.index_copy_(1, slots, k.to(k_cache.dtype))
        v_cache.index_copy_(1, slots, v.to(v_cache.dtype))
    scale = scaling if scaling is not None else head_dim**-0.5
    out = meta.backend.attend(meta, group, layer, query, key, value, k_cache, v_cache, scale, softcap, sinks=s_aux)
    return out[None], None  # out: [T, H, D]


# NOTE: forward kwargs HF attention modules pass that change nothing here (the packed batch carries its
# own positions, the cache is ours, no weights are returned). Anything else is refused, never dropped.
IGNORED_KWARGS = frozenset({"position_ids", "use_cache", "cache_position", "output_attentions",
                            "output_router_logits", "is_causal", "head_mask"})


def check_kwargs(module: torch.nn.Module, kwargs: dict, dropout: float) -> None:
    if not dropout and kwargs.keys() <= IGNORED_KWARGS and not kwargs.get("output_attentions"):
        return  # NOTE: every layer of every step comes here
    unknown = sorted(set(kwargs) - IGNORED_KWARGS)
    if unknown:
        raise ValueError(f"{type(module).__name__} passes attention argument(s) {unknown} that rollout's paged "
                         "attention does not implement; refusing rather than ignoring them")
    if dropout:
        raise ValueError(f"{type(module).__name__} asks for attention dropout {dropout}: the engine runs in eval mode")
    if kwargs.get("output_attentions"):
        raise ValueError("output_attentions=True: rollout's paged attention returns no attention weights")


def register() -> str:
    """Register the paged attention with transformers (idempotent).

    NOTE: no mask function is registered on purpose: transformers' mask builders then return at once
    ("custom attention without equivalent mask creation"). With one registered, even a null one, they
    first scan the packed position ids for sequence starts (`find_packed_sequence_indices`), whose
    `.all()` is a host-device synchronisation on CUDA every forward (seen with
    `torch.cuda.set_sync_debug_mode("error")`, tests/model/test_gpu.py) and wasted work on a CPU."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_NAME, paged_attention_forward)
    return ATTN_NAME
