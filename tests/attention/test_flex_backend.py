"""The flex backend's kernel against a dense fp64 reference on random paged caches.

Block tables share prefix pages between requests, sliding-window tables hold FREED entries for
pages that slid out (their old pages reused by other requests), query tiles mix requests, and steps
run from one decode row to prompt chunks and decodes together. One compiled kernel per
(page size, softcap) is shared by every case (CPU compile: ~10-25 s, then cached on disk).
"""

from __future__ import annotations

import pytest
import torch

from rollout.attention.backends.flex import FREED, build_flex_metadata, flex_paged_attention

PS = 16
NUM_PAGES = 48
H, HKV, D = 4, 2, 16


def make_step(g: torch.Generator, specs: list[tuple[int, int]], window: int | None, share: bool):
    """Block tables for requests `(start, n)`: pages drawn without replacement from the pool, the first
    two pages of requests 0 and 1 shared when `share`, pages before the window FREED and handed on."""
    free = torch.randperm(NUM_PAGES, generator=g).tolist()
    tables = []
    for i, (start, n) in enumerate(specs):
        npages = -(-(start + n) // PS)
        t = [free.pop() for _ in range(npages)]
        if share and i == 1 and len(tables[0]) >= 2 and npages >= 2:
            free += t[:2]
            t[:2] = tables[0][:2]
        if window is not None:
            first = max(0, start - window + 1) // PS
            for j in range(first):  # NOTE: a recycled page goes back to the pool: others may take it
                free.insert(0, t[j])
                t[j] = FREED
        tables.append(t)
    return tables


def reference(q, k_cache, v_cache, tables, specs, window, softcap):
    """[1, H, T, D] fp64: each request's queries against its own keys, causal (and windowed)."""
    outs, row = [], 0
    for t, (start, n) in zip(tables, specs, strict=True):
        end = start + n
        lo = 0 if window is None else max(0, start - window + 1)
        slots = torch.tensor([t[p // PS] * PS + p % PS for p in range(lo, end)])
        k = k_cache[:, slots].double().repeat_interleave(H // HKV, 0)
        v = v_cache[:, slots].double().repeat_interleave(H // HKV, 0)
        s = q[0, :, row : row + n].double() @ k.transpose(-1, -2)  # [H, n, kv]
        if softcap:
            s = torch.tanh(s / softcap) * softcap
        qp = torch.arange(start, end)[:, None]
        kp = torch.arange(lo, end)[None, :]
        ok = kp <= qp
        if window is not None:
            ok &= kp > qp - window
        outs.append(s.masked_fill(~ok, float("-inf")).softmax(-1) @ v)
        row += n
    return torch.cat(outs, 1)[None]


STEPS = [
    [(0, 40), (0, 23), (70, 1), (31, 1), (16, 17)],  # prompts from 0, a decode, a chunk after a prefix
    [(33, 1)] * 3 + [(5, 1), (90, 1), (47, 1)],  # decode rows only: tiles mix six requests
    [(57, 1)],  # a single decode row (padded to two inside)
    [(40, 1), (2, 1), (64, 48)],  # a long chunk straddling four pages next to decodes
]


@pytest.mark.parametrize(
    "dtype, atol", [(torch.float32, 2e-5), pytest.param(torch.bfloat16, 2e-2, marks=pytest.mark.slow)]
)
@pytest.mark.parametrize("window, softcap", [(None, None), (24, None), (None, 20.0)])
def test_flex_kernel_matches_dense_reference(window, softcap, dtype, atol):
    check_kernel(window, softcap, dtype, atol, "cpu")


@pytest.mark.parametrize("window", [None, 24])
def test_entries_past_a_requests_pages_are_never_read(window):
    """The engine hands flex its persistent block table (rollout.kv.device_page_tables): past a request's own pages
    a row holds zeros or a previous owner's page ids, here the pages the other requests of the step read."""
    check_kernel(window, None, torch.float32, 2e-5, "cpu", stale_padding=True)


def check_kernel(window, softcap, dtype, atol, device: str, stale_padding: bool = False) -> None:
    """Every step of STEPS through the paged flex kernel on `device`, against the fp64 reference
    (also run on CUDA by tests/model/test_gpu.py). Table rows are padded with FREED, or with `stale_padding`
    with page ids in use this step (and two more columns)."""
    g = torch.Generator().manual_seed(0)
    k_cache = torch.randn(HKV, NUM_PAGES * PS, D, generator=g).to(dtype)
    v_cache = torch.randn(HKV, NUM_PAGES * PS, D, generator=g).to(dtype)
    for i, specs in enumerate(STEPS):
        tables = make_step(g, specs, window, share=i == 0)
        width = max(map(len, tables))
        if stale_padding:
            width += 2
            used = [x for t in tables for x in t if x != FREED]
            rows = [t + [used[(j + 3 * r) % len(used)] for j in range(width - len(t))] for r, t in enumerate(tables)]
        else:
            rows = [t + [FREED] * (width - len(t)) for t in tables]
        table = torch.tensor(rows, device=device)
        starts = torch.tensor([s for s, _ in specs], device=device)
        lens = torch.tensor([n for _, n in specs], device=device)
        rows = int(lens.sum())
        q = torch.randn(1, H, rows, D, generator=g).to(dtype) * 0.5
        meta = build_flex_metadata(table, starts, lens, rows, PS, NUM_PAGES, window)
        out = flex_paged_attention(q.to(device), k_cache.to(device), v_cache.to(device), meta, PS, softcap)
        assert out.device.type == device and out.shape == (1, H, rows, D) and out.dtype == dtype
        ref = reference(q, k_cache, v_cache, tables, specs, window, softcap)
        err = (out.cpu().double() - ref).abs().max().item()
        assert err < atol, f"step {i}: max error {err}"


def test_block_mask_lists_each_tile_its_requests_pages_once():
    """Tile 0 holds rows of requests 0 and 1 (sharing two pages): the union of the pages they read
    (request 0 at position 30 reads logical pages 0-1 only), no duplicates, sorted."""
    table = torch.tensor([[5, 9, 2, FREED], [5, 9, 7, 3]])
    starts, lens = torch.tensor([30, 50]), torch.tensor([1, 2])
    meta = build_flex_metadata(table, starts, lens, 3, PS, 12, None)
    n = meta.kv_num_blocks[0, 0].tolist()
    assert n[0] == 4 and n[1:] == [0] * (len(n) - 1)  # the padding tile reads none
    assert meta.kv_indices[0, 0, 0, :4].tolist() == [3, 5, 7, 9]
    assert meta.logical[[5, 9, 7, 3, 2]].tolist() == [0, 1, 2, 3, -1]  # page 2 is not read this step
    assert meta.pos[:4].tolist() == [30, 50, 51, -1] and meta.base[:3].tolist() == [0, 4, 4]
    # a window: request 0 at position 30 with window 8 reads only positions 23..30 (page 1)
    meta = build_flex_metadata(table, starts, lens, 3, PS, 12, 8)
    assert meta.lo[:3].tolist() == [23, 43, 44]
    assert meta.kv_indices[0, 0, 0, : meta.kv_num_blocks[0, 0, 0]].tolist() == [3, 7, 9]


def test_gpu_tile_sizes_divide_the_block_mask_blocks():
    """torch's GPU flex kernels refuse block-mask blocks that are not multiples of their tiles (their
    default tiles are 64-128 rows): one query tile per block-mask row tile, a key tile that divides the page."""
    from rollout.attention.backends.flex import Q_BLOCK, gpu_kernel_options

    for page, block_n in [(16, 16), (32, 32), (48, 16), (256, 64), (1024, 64)]:
        opts = gpu_kernel_options(page, Q_BLOCK)
        assert opts["BLOCK_M"] == Q_BLOCK and opts["BLOCK_N"] == block_n and page % opts["BLOCK_N"] == 0
    with pytest.raises(ValueError, match="page_size divisible by 16"):
        gpu_kernel_options(8, Q_BLOCK)
