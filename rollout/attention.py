"""Paged attention for Hugging Face models, registered with `transformers.AttentionInterface`.

Every step is one packed forward over `[1, T]` tokens. The per-step `AttentionMetadata` reaches the
attention function through the model's forward kwargs (`rollout_meta=`), never a module global.
Cost grows with the sum over requests of (query tokens x that request's KV length):

- on CPU, decode rows (one query token each) are attended in place over the paged cache by the C++
  kernel of `rollout.cpu_kernels` (fp32, bf16 and fp16 caches), through the page tables;
- other decode rows (no compiler, `ROLLOUT_CPU_KERNELS=0`, an accelerator) are batched in buckets of
  similar KV length: their KV is
  gathered by slot index from the head-major cache `[Hkv, slots, D]` into `[B, Hkv, Lmax, D]` and
  attended with a key-padding mask;
- prompt chunks run one segment at a time against their own KV only (the fresh K/V of the step
  when nothing is cached yet, else a gather of the request's slots).

Layers are grouped by attention window (`GroupMetadata`): each group writes and reads through its
own page tables, and a sliding-window group gathers only the keys still inside the window, so its
cost per query is bounded by the window.

No mask is ever built over the whole packed batch.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

ATTN_NAME = "rollout_paged"


@dataclass(slots=True)
class Segment:
    """A request with more than one query token this step."""

    q_start: int  # first row in the packed batch
    q_len: int
    kv_start: int  # position of the first key read (> 0 once a sliding window has moved on)
    kv_len: int  # keys read: positions kv_start .. kv_start + kv_len - 1 (the last q_len are this step's)
    kv_slots: torch.Tensor | None  # [kv_len] slots to read, None when all KV is fresh (kv_len == q_len)


@dataclass(slots=True)
class DecodeBucket:
    """Decode rows (one query token each) of similar KV length, attended in one batched call."""

    rows: torch.Tensor  # [B] packed rows of the queries
    slots: torch.Tensor  # [B, Lmax] KV slots (padding repeats the row's last key)
    kv_len: torch.Tensor  # [B] keys each row reads (its window at most)
    padded: bool  # some row reads fewer than Lmax keys
    _mask: torch.Tensor | None = None

    def mask(self) -> torch.Tensor | None:
        """[B, 1, 1, Lmax] True where a query may attend; None when nothing is padding."""
        if not self.padded:
            return None
        if self._mask is None:
            self._mask = key_padding_mask(self.kv_len, self.slots.shape[1])
        return self._mask


def key_padding_mask(kv_len: torch.Tensor, lmax: int) -> torch.Tensor:
    """[B, 1, 1, lmax] bool, True for the first `kv_len[b]` keys of row b (the decode attention mask)."""
    j = torch.arange(lmax, device=kv_len.device)
    return (j[None, :] < kv_len[:, None])[:, None, None, :]


@dataclass(slots=True)
class PagedDecode:
    """Decode rows attended in place over the paged cache by `rollout.cpu_kernels.paged_decode_attention`."""

    rows: torch.Tensor  # [n] packed rows of the queries
    table: torch.Tensor  # [R, P] page tables (int32 or int64)
    row: torch.Tensor  # [n] row of `table` of each query's request
    start: torch.Tensor  # [n] first position read (> 0 once a sliding window has moved on)
    end: torch.Tensor  # [n] one past the last position read (the row's own, just written)


@dataclass(slots=True)
class GroupMetadata:
    """Where the layers of one group (full attention, or one sliding window) write and read KV.

    Every request has one page table per group, so slots differ between groups; the packed rows of
    the segments are the same for all groups.
    """

    window: int | None  # the layers' sliding window, None for full attention
    slot_mapping: torch.Tensor  # [T] cache slot of each new token
    buckets: list[DecodeBucket] = field(default_factory=list)
    paged: PagedDecode | None = None  # decode rows read in place by the paged kernel
    segments: list[Segment] = field(default_factory=list)
    _masks: dict = field(default_factory=dict)

    def segment_mask(self, i: int, seg: Segment) -> torch.Tensor | None:
        """[1, 1, q_len, kv_len] causal (and windowed) mask of a segment, None when plain causal."""
        window = self.window
        if seg.kv_len == seg.q_len and (window is None or window >= seg.kv_len):
            return None
        mask = self._masks.get(i)
        if mask is None:
            dev = self.slot_mapping.device
            # NOTE: positions relative to kv_start; the queries are the last q_len keys.
            q_pos = torch.arange(seg.kv_len - seg.q_len, seg.kv_len, device=dev)[:, None]
            k_pos = torch.arange(seg.kv_len, device=dev)[None, :]
            mask = k_pos <= q_pos
            if window is not None:
                mask &= k_pos > q_pos - window
            mask = self._masks[i] = mask[None, None]
        return mask


@dataclass(slots=True)
class AttentionMetadata:
    """Per-step inputs of the paged attention (built by the runner, shared by every layer)."""

    cache: object  # PagedKVCache
    groups: list  # indexed by `cache.group_of(layer)`: the backend's group metadata (has .window, .slot_mapping)
    backend: object = None  # rollout.backends.AttentionBackend: runs `attend` for every layer
    layers_seen: set[int] | None = None  # when set, each layer that runs adds its index (first-step check)


def _attend(
    q: torch.Tensor,  # [B, H, Lq, D]
    k: torch.Tensor,  # [B, Hkv, Lk, D]
    v: torch.Tensor,  # [B, Hkv, Lk, D]
    mask: torch.Tensor | None,  # [B, 1, Lq, Lk] bool, True = attend
    scale: float,
    softcap: float | None,
    is_causal: bool,
    sinks: torch.Tensor | None = None,  # [H] learned sink logits (gpt-oss)
) -> torch.Tensor:  # [B, H, Lq, D]
    if not softcap and sinks is None:
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=is_causal and mask is None, scale=scale,
            enable_gqa=k.shape[1] != q.shape[1],
        )
    return _attend_explicit(q, k, v, mask, scale, softcap, is_causal, sinks)


# NOTE: the explicit path builds its fp32 scores this many bytes at a time (counted by the memory plan).
SOFTCAP_SCORE_BYTES = 32 << 20


def _attend_explicit(
    q: torch.Tensor,  # [B, H, Lq, D]
    k: torch.Tensor,  # [B, Hkv, Lk, D]
    v: torch.Tensor,  # [B, Hkv, Lk, D]
    mask: torch.Tensor | None,  # [B, 1, Lq, Lk] bool, True = attend
    scale: float,
    softcap: float | None,
    is_causal: bool,
    sinks: torch.Tensor | None = None,  # [H] learned sink logits (gpt-oss)
) -> torch.Tensor:  # [B, H, Lq, D]
    """SDPA has no logit softcap (Gemma 2) and no sinks (gpt-oss): an explicit fp32 path over chunks of
    query rows, so the `[B, H, rows, Lk]` scores never pass SOFTCAP_SCORE_BYTES whatever the step's size."""
    b, h, lq, d = q.shape
    hkv, lk = k.shape[1], k.shape[2]
    g = h // hkv
    kt = k.float().transpose(-1, -2)  # [B, Hkv, D, Lk]
    vf = v.float()  # [B, Hkv, Lk, D]
    rows = max(1, SOFTCAP_SCORE_BYTES // (4 * b * h * (lk + 1)))
    out = q.new_empty(b, h, lq, v.shape[-1])
    for i in range(0, lq, rows):
        j = min(lq, i + rows)
        qi = q[:, :, i:j].float().reshape(b, hkv, g * (j - i), d)  # NOTE: GQA by grouping, K/V not repeated
        s = (torch.matmul(qi, kt) * scale).view(b, hkv, g, j - i, lk)  # [B, Hkv, G, r, Lk]
        if softcap:
            s = torch.tanh(s / softcap) * softcap
        m = None
        if mask is not None:
            m = mask[:, :, i:j][:, :, None]  # [B, 1, 1, r, Lk]
        elif is_causal:  # NOTE: the queries are the last Lq keys
            m = torch.arange(lk, device=q.device) <= torch.arange(i, j, device=q.device)[:, None] + (lk - lq)
        if m is not None:
            s = s.masked_fill(~m, float("-inf"))
        if sinks is None:
            p = s.softmax(-1)
        else:
            # NOTE: a sink is one more logit per head that takes probability mass and carries no value:
            # the softmax denominator gains exp(sink - max).
            sink = sinks.float().reshape(1, hkv, g, 1, 1).expand(b, hkv, g, j - i, 1)
            p = torch.cat([s, sink], dim=-1).softmax(-1)[..., :-1]
        out[:, :, i:j] = torch.matmul(p.reshape(b, hkv, g * (j - i), lk), vf).view(b, h, j - i, -1).to(q.dtype)
    return out


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
    _check_kwargs(module, kwargs, dropout)
    if s_aux is not None and not getattr(meta.backend, "supports_sinks", False):
        raise ValueError(f"attn_backend {getattr(meta.backend, 'name', '?')!r} does not implement attention sinks "
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
    k_cache.index_copy_(1, group.slot_mapping, key[0].to(k_cache.dtype))
    v_cache.index_copy_(1, group.slot_mapping, value[0].to(v_cache.dtype))
    scale = scaling if scaling is not None else head_dim**-0.5
    extra = {} if s_aux is None else {"sinks": s_aux}
    out = meta.backend.attend(meta, group, layer, query, key, value, k_cache, v_cache, scale, softcap, **extra)
    return out[None], None  # out: [T, H, D]


# NOTE: forward kwargs HF attention modules pass that change nothing here (the packed batch carries its
# own positions, the cache is ours, no weights are returned). Anything else is refused, never dropped.
IGNORED_KWARGS = frozenset({"position_ids", "use_cache", "cache_position", "output_attentions",
                            "output_router_logits", "is_causal", "head_mask"})


def _check_kwargs(module: torch.nn.Module, kwargs: dict, dropout: float) -> None:
    unknown = sorted(set(kwargs) - IGNORED_KWARGS)
    if unknown:
        raise ValueError(f"{type(module).__name__} passes attention argument(s) {unknown} that rollout's paged "
                         "attention does not implement; refusing rather than ignoring them")
    if dropout:
        raise ValueError(f"{type(module).__name__} asks for attention dropout {dropout}: the engine runs in eval mode")
    if kwargs.get("output_attentions"):
        raise ValueError("output_attentions=True: rollout's paged attention returns no attention weights")


def gather_attend(
    meta: AttentionMetadata,
    group: GroupMetadata,
    layer: int,
    query: torch.Tensor,  # [1, H, T, D]
    key: torch.Tensor,  # [1, Hkv, T, D]
    value: torch.Tensor,  # [1, Hkv, T, D]
    k_cache: torch.Tensor,  # [Hkv, S, D]
    v_cache: torch.Tensor,  # [Hkv, S, D]
    scale: float,
    softcap: float | None,
    kernel=None,  # rollout.cpu_kernels.paged_decode_attention, for `group.paged` rows
    sinks: torch.Tensor | None = None,  # [H] attention sinks (gpt-oss); not with kernel rows
) -> torch.Tensor:  # [T, H, D]
    """The `cpu` and `sdpa` backends' attention: kernel rows, decode buckets, then prompt segments."""
    num_kv_heads, head_dim = key.shape[1], key.shape[3]
    q_rows = query[0].transpose(0, 1)  # [T, H, D]
    out = torch.empty_like(q_rows)  # [T, H, D]
    # NOTE: CPU SDPA with one query row is ~2x slower in bf16/fp16 than in fp32: decode in fp32.
    upcast = query.device.type == "cpu" and query.dtype in (torch.bfloat16, torch.float16)

    if group.paged is not None:  # NOTE: half-precision K/V are widened in the kernel
        if sinks is not None:
            raise ValueError("rollout's C++ decode kernel does not implement attention sinks")
        pd = group.paged
        q = q_rows.index_select(0, pd.rows).float()  # [n, H, D]
        o = torch.empty_like(q)
        kernel(q, k_cache, v_cache, pd.table, pd.row, pd.start, pd.end, meta.cache.page_size,
               scale, float(softcap or 0.0), o)
        out.index_copy_(0, pd.rows, o.to(out.dtype))

    for bucket in group.buckets:
        q = q_rows.index_select(0, bucket.rows)[:, :, None, :]  # [B, H, 1, D]
        b, lmax = bucket.slots.shape
        flat = bucket.slots.reshape(-1)
        # NOTE: head-major gathers hand SDPA contiguous (L, D) planes.
        k = k_cache.index_select(1, flat).view(num_kv_heads, b, lmax, head_dim).transpose(0, 1)
        v = v_cache.index_select(1, flat).view(num_kv_heads, b, lmax, head_dim).transpose(0, 1)
        if upcast:
            q, k, v = q.float(), k.float(), v.float()
        o = _attend(q, k, v, bucket.mask(), scale, softcap, is_causal=False, sinks=sinks)  # [B, H, 1, D]
        out.index_copy_(0, bucket.rows, o[:, :, 0, :].to(out.dtype))

    for i, seg in enumerate(group.segments):
        rows = slice(seg.q_start, seg.q_start + seg.q_len)
        q = q_rows[rows].transpose(0, 1)[None]  # [1, H, q, D]
        if seg.kv_slots is None:
            k, v = key[:, :, rows], value[:, :, rows]  # [1, Hkv, q, D]
        else:
            k = k_cache.index_select(1, seg.kv_slots)[None]  # [1, Hkv, kv, D]
            v = v_cache.index_select(1, seg.kv_slots)[None]
        mask = group.segment_mask(i, seg)
        o = _attend(q, k, v, mask, scale, softcap, is_causal=True, sinks=sinks)  # [1, H, q, D]
        out[rows] = o[0].transpose(0, 1)
    return out


def register() -> str:
    """Register the paged attention with transformers (idempotent).

    NOTE: no mask function is registered on purpose: transformers' mask builders then return at once
    ("custom attention without equivalent mask creation"). With one registered, even a null one, they
    first scan the packed position ids for sequence starts (`find_packed_sequence_indices`), whose
    `.all()` is a host-device synchronisation on CUDA every forward (seen with
    `torch.cuda.set_sync_debug_mode("error")`, tests/test_gpu.py) and wasted work on a CPU."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_NAME, paged_attention_forward)
    return ATTN_NAME
