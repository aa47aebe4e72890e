"""The `sdpa` attention backend: gather each request's pages and run torch SDPA (the portable reference).

Owns the gather path end to end: its per-group metadata (`GroupMetadata`: `Segment`s, `DecodeBucket`s),
their builder (`build_gather_group`, from the step's `StepInputs`), its attention (`gather_attend`, over
`attend_dense`: SDPA, or an explicit fp32 softmax for Gemma 2's logit softcap and
gpt-oss's attention sinks, chunked by `SOFTCAP_SCORE_BYTES`) and its memory plan. Runs on any device.

- prompt chunks run one segment at a time against their own KV only (the fresh K/V of the step when
  nothing is cached yet, else a gather of the request's slots);
- decode rows (one query token each) are batched in buckets of similar KV length: their KV is gathered
  by slot index from the head-major cache `[Hkv, slots, D]` into `[B, Hkv, Lmax, D]` and attended with
  a key-padding mask;
- the `cpu` backend (`rollout.attention.backends.cpu`) takes the prompt segments from here and attends the
  decode rows in place with its C++ kernel instead (`gather_group_rows`, `attend_gathered`).

Layers are grouped by attention window: each group writes and reads through its own page tables, and a
sliding-window group gathers only the keys still inside the window, so its cost per query is bounded by
the window. No mask is ever built over the whole packed batch.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from rollout.attention.backends.base import AttentionMetadata, StepInputs, cache_slots
from rollout.kv.memory_plan import AttnMemory, KVShape

# NOTE: decode rows are split into at most this many buckets of similar KV length, a bucket closing
# when the next row would read less than half of the bucket's longest KV (and it has enough rows).
MAX_DECODE_BUCKETS = 4
MIN_BUCKET_ROWS = 8
# NOTE: a gather reads at most ~2x the KV its rows need (decode buckets split at half the longest row)
GATHER_WASTE = 2
# NOTE: the explicit path builds its fp32 scores this many bytes at a time (counted by the memory plan).
SOFTCAP_SCORE_BYTES = 32 << 20


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
class GroupMetadata:
    """Where the layers of one group (full attention, or one sliding window) write and read KV.

    Every request has one page table per group, so slots differ between groups; the packed rows of
    the segments are the same for all groups.
    """

    window: int | None  # the layers' sliding window, None for full attention
    slot_mapping: torch.Tensor  # [T] cache slot of each new token
    buckets: list[DecodeBucket] = field(default_factory=list)
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


def build_gather_group(window: int | None, step: StepInputs, ps: int) -> GroupMetadata:
    """Slots, decode buckets and prompt segments of one layer group.

    Reads the group's persistent table `step.tables[window]` (rows `step.rows`)."""
    g, decode = gather_group_rows(GroupMetadata, window, step, ps)
    add_decode_buckets(g, decode, step, ps)
    return g


def gather_group_rows(cls, window: int | None, step: StepInputs, ps: int) -> tuple[GroupMetadata, list]:
    """A `cls` (GroupMetadata or an extension of it) with the group's slots and prompt segments, and its decode
    rows still to place, as (kv_len, request, lo) (the `cpu` backend reads them in place instead)."""
    dev = step.device
    table = step.tables[window]  # [R, P] int32
    g = cls(window, cache_slots(table, step.rows[step.request_of_token], step.positions, ps))
    decode: list[tuple[int, int, int]] = []  # (kv_len, request, lo)
    for b, (start, n) in enumerate(zip(step.starts_list, step.lens_list, strict=True)):
        end = start + n
        # NOTE: the query at `start` sees keys from start - window + 1 on (HF: j > i - window).
        lo = 0 if window is None else max(0, start - window + 1)
        if n == 1:
            decode.append((end - lo, b, lo))
            continue
        kv = None  # NOTE: from position 0 every key is this step's own (lo is 0 too)
        if start > 0:
            kv = cache_slots(table, step.rows[b], torch.arange(lo, end, device=dev), ps)
        g.segments.append(Segment(step.first_row[b], n, lo, end - lo, kv))
    return g, decode


def add_decode_buckets(g: GroupMetadata, decode: list[tuple[int, int, int]], step: StepInputs, ps: int) -> None:
    """Decode rows as buckets of gathered keys of similar lengths."""
    if not decode:
        return
    dev, table = step.device, step.tables[g.window]
    decode.sort(reverse=True)
    for chunk in _bucket(decode):
        kv_len = torch.tensor([c[0] for c in chunk], device=dev)  # [Bb]
        reqs = torch.tensor([c[1] for c in chunk], device=dev)  # [Bb]
        lo = torch.tensor([c[2] for c in chunk], device=dev)  # [Bb]
        lmax = chunk[0][0]
        j = torch.arange(lmax, device=dev)
        # NOTE: padding repeats the row's last key: a written slot, masked out below.
        pos = lo[:, None] + torch.minimum(j[None, :], kv_len[:, None] - 1)  # [Bb, Lmax]
        rows = torch.tensor([step.first_row[c[1]] for c in chunk], device=dev)
        g.buckets.append(DecodeBucket(rows, cache_slots(table, step.rows[reqs][:, None], pos, ps), kv_len,
                                      padded=chunk[-1][0] < lmax))


def _bucket(rows: list[tuple[int, int, int]]) -> list[list[tuple[int, int, int]]]:
    """Split rows sorted by decreasing KV length into buckets that waste little padding."""
    buckets = [[rows[0]]]
    for row in rows[1:]:
        cur = buckets[-1]
        if (row[0] * 2 < cur[0][0] and len(cur) >= MIN_BUCKET_ROWS
                and len(buckets) < MAX_DECODE_BUCKETS):
            buckets.append([row])
        else:
            cur.append(row)
    return buckets


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
    sinks: torch.Tensor | None = None,  # [H] attention sinks (gpt-oss)
) -> torch.Tensor:  # [T, H, D]
    """The `sdpa` backend's attention: decode buckets, then prompt segments."""
    q_rows = query[0].transpose(0, 1)  # [T, H, D]
    out = q_rows.new_empty(q_rows.shape)  # [T, H, D], contiguous: HF's reshape after attention is then a view
    attend_gathered(out, q_rows, group, key, value, k_cache, v_cache, scale, softcap, sinks)
    return out


def attend_gathered(out: torch.Tensor, q_rows: torch.Tensor, group: GroupMetadata, key, value, k_cache, v_cache,
                    scale: float, softcap: float | None, sinks: torch.Tensor | None = None) -> None:
    """Writes into `out` [T, H, D] the rows of `group`'s decode buckets and prompt segments (`q_rows` [T, H, D])."""
    num_kv_heads, head_dim = key.shape[1], key.shape[3]
    # NOTE: CPU SDPA with one query row is ~2x slower in bf16/fp16 than in fp32: decode in fp32.
    upcast = q_rows.device.type == "cpu" and q_rows.dtype in (torch.bfloat16, torch.float16)
    for bucket in group.buckets:
        q = q_rows.index_select(0, bucket.rows)[:, :, None, :]  # [B, H, 1, D]
        b, lmax = bucket.slots.shape
        flat = bucket.slots.reshape(-1)
        # NOTE: head-major gathers hand SDPA contiguous (L, D) planes.
        k = k_cache.index_select(1, flat).view(num_kv_heads, b, lmax, head_dim).transpose(0, 1)
        v = v_cache.index_select(1, flat).view(num_kv_heads, b, lmax, head_dim).transpose(0, 1)
        if upcast:
            q, k, v = q.float(), k.float(), v.float()
        o = attend_dense(q, k, v, bucket.mask(), scale, softcap, is_causal=False, sinks=sinks)  # [B, H, 1, D]
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
        o = attend_dense(q, k, v, mask, scale, softcap, is_causal=True, sinks=sinks)  # [1, H, q, D]
        out[rows] = o[0].transpose(0, 1)


def attend_dense(
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


class SdpaBackend:
    """Gather + SDPA (see the module docstring); holds no state."""

    name = "sdpa"
    supports_sinks = True  # NOTE: gpt-oss sinks in the explicit softmax of `attend_dense`
    reads_unwritten_slots = False  # NOTE: padding of a gather repeats a written slot

    @classmethod
    def create(cls, device: torch.device, dtype: torch.dtype, **_) -> SdpaBackend:
        return cls()

    @classmethod
    def attn_memory(cls, shape: KVShape, page_size: int, max_batch_tokens: int | None, softcap: bool,
                    max_pages: int) -> AttnMemory:
        # NOTE: decode buckets copy at most GATHER_WASTE x one layer's K/V (x3 when half precision is
        # widened to fp32 on a CPU); prompt chunks copy one request's K/V of one layer at a time; the
        # softcap path widens K/V to fp32 too and holds the scores and probabilities of one chunk.
        fixed = 2 * SOFTCAP_SCORE_BYTES if softcap else 0
        widen = 3 if shape.dtype in (torch.bfloat16, torch.float16) else 1
        one_request = max_pages * page_size * shape.bytes_per_token // max(1, shape.num_layers) * widen
        return AttnMemory(fixed=fixed + one_request, per_cache_byte=GATHER_WASTE * widen / max(1, shape.num_layers))

    def build_group(self, window: int | None, tables: list[list[int]], step: StepInputs,
                    page_size: int) -> GroupMetadata:
        return build_gather_group(window, step, page_size)

    def attend(self, meta, group, layer, query, key, value, k_cache, v_cache, scale, softcap,
               sinks: torch.Tensor | None = None) -> torch.Tensor:
        return gather_attend(meta, group, layer, query, key, value, k_cache, v_cache, scale, softcap, sinks)
