"""A speculative step's verification through the C++ paged kernel (`rollout.attention.backends.cpu.verify_group`,
issue 60): every token of a row (its last token and its draft) a query of its own, reading keys up to its own
position. It must equal, to float rounding, an fp64 softmax over exactly those keys (causal inside the draft,
sliding windows, rows whose draft crosses a page) and sdpa's segments (the path before it); and a verifying
engine step's logits must equal the old path's and an fp64 forward of the same tokens."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch
from support.tiny_models import make_model

from rollout.attention.backends import StepInputs
from rollout.attention.backends import cpu as cpu_backend
from rollout.config import ContinuousBatchingConfig
from rollout.engine.core import EngineCore
from rollout.kernels import cpu_kernels
from rollout.scheduling.stages import ScheduledRequest, SchedulerOutput

pytestmark = pytest.mark.skipif(cpu_kernels.cascade_decode_attention() is None,
                                reason="rollout's C++ CPU kernels are unavailable here")
PS, HKV, G, D = 8, 2, 3, 64


def attend(window, starts, lens, verify_max: int, seed: int = 0):
    """(the cpu backend's output [T, H, D] for a verifying step, the fp64 reference [T, H, D])."""
    gen = torch.Generator().manual_seed(seed)
    pages = 40
    k_cache = torch.randn(HKV, pages * PS, D, generator=gen)
    v_cache = torch.randn(HKV, pages * PS, D, generator=gen)
    rng = random.Random(seed)
    width = max(s + n for s, n in zip(starts, lens, strict=True)) // PS + 1
    table = torch.tensor([rng.sample(range(pages), width) for _ in starts], dtype=torch.int32)
    step = StepInputs(starts, lens, list(range(len(starts))), {window: table}, torch.device("cpu"))
    step.verify = True
    old, cpu_backend.VERIFY_MAX_TOKENS = cpu_backend.VERIFY_MAX_TOKENS, verify_max
    try:
        group = cpu_backend.build_cpu_group(window, step, PS)
    finally:
        cpu_backend.VERIFY_MAX_TOKENS = old
    T = sum(lens)
    q = torch.randn(1, HKV * G, T, D, generator=gen)
    slots = group.slot_mapping
    key, value = k_cache[:, slots][None], v_cache[:, slots][None]  # NOTE: this step's K/V, already in the cache
    meta = SimpleNamespace(cache=SimpleNamespace(page_size=PS))
    scale = D**-0.5
    out = cpu_backend.cpu_attend(cpu_backend.cpu_kernel(torch.float32), meta, group, q, key, value, k_cache, v_cache,
                                 scale, None)
    ref = torch.empty(T, HKV * G, D, dtype=torch.float64)
    t = 0
    for b, (s, n) in enumerate(zip(starts, lens, strict=True)):
        for j in range(n):
            p = s + j
            lo = 0 if window is None else max(0, p - window + 1)
            pos = torch.arange(lo, p + 1)
            sl = table[b, pos // PS].long() * PS + pos % PS
            for h in range(HKV * G):
                kk, vv = k_cache[h // G, sl].double(), v_cache[h // G, sl].double()
                w = torch.softmax(kk @ q[0, h, t].double() * scale, 0)
                ref[t, h] = w @ vv
            t += 1
    return out, ref


@pytest.mark.parametrize("window", [None, 12])
def test_verify_rows_through_the_kernel_equal_an_fp64_softmax_and_sdpa_segments(window):
    # NOTE: rows with no draft, drafts inside a page, across a page boundary, a row at a page's first slot
    starts, lens = [5, 13, 30, 16, 47], [1, 4, 7, 9, 3]
    new, ref = attend(window, starts, lens, verify_max=33)
    old, ref_old = attend(window, starts, lens, verify_max=0)
    assert torch.equal(ref, ref_old)
    assert (new.double() - ref).abs().max() < 1e-5
    assert (old.double() - ref).abs().max() < 1e-5
    assert (new - old).abs().max() < 2e-5


def test_longer_rows_keep_sdpa_segments():
    """A row past `VERIFY_MAX_TOKENS` sends the step back to the decode rows + segments split."""
    step = StepInputs([10, 3], [1, 40], [0, 1], {None: torch.arange(14, dtype=torch.int32).view(2, 7)},
                      torch.device("cpu"))
    step.verify = True
    group = cpu_backend.build_cpu_group(None, step, PS)
    assert group.paged.rows.tolist() == [0] and group.paged.end.tolist() == [11]
    assert [(s.q_start, s.q_len) for s in group.segments] == [(1, 40)]
    step = StepInputs([10, 3], [1, 3], [0, 1], step.tables, torch.device("cpu"))
    step.verify = True
    group = cpu_backend.build_cpu_group(None, step, PS)
    assert group.paged.rows.tolist() == [0, 1, 2, 3] and group.paged.end.tolist() == [11, 4, 5, 6]
    assert group.segments == []


def decoding(model, rows: int = 3):
    core = EngineCore(model, None, ContinuousBatchingConfig(page_size=PS, num_blocks=64, attn_backend="cpu"))
    reqs = [core.make_request(list(range(3 + i, 20 + 3 * i)), max_new_tokens=40, temperature=0.0)
            for i in range(rows)]
    for r in reqs:
        core.add(r)
    while not all(len(r.generated) >= 3 for r in reqs):
        core.step()
    return core, reqs


def test_a_verifying_step_equals_the_old_path_and_an_fp64_forward():
    model = make_model("llama")
    core, reqs = decoding(model)
    drafts = [[7, 8, 9, 10], [], [11, 12]]
    for r, d in zip(reqs, drafts, strict=True):
        core.scheduler.tables.grow(r, r.num_computed_tokens + 1 + len(d))
    out = SchedulerOutput([ScheduledRequest(r, 1 + len(d)) for r, d in zip(reqs, drafts, strict=True)])
    new = core.runner.execute(out, drafts)[0]
    old_max, cpu_backend.VERIFY_MAX_TOKENS = cpu_backend.VERIFY_MAX_TOKENS, 0
    try:
        old = core.runner.execute(out, drafts)[0]
    finally:
        cpu_backend.VERIFY_MAX_TOKENS = old_max
    ref = []
    double = make_model("llama").double()
    with torch.inference_mode():
        for r, d in zip(reqs, drafts, strict=True):
            ids = torch.tensor([r.token_ids + d])
            ref.append(double(ids).logits[0, -1 - len(d):])
    ref = torch.cat(ref)
    assert (old.double() - ref).abs().max() < 1e-4
    assert (new.double() - ref).abs().max() < 1e-4
    assert (new - old).abs().max() < 5e-5


def test_a_cpu_step_s_ragged_indices_from_the_host_lists_equal_torch_s(monkeypatch):
    """Up to `HOST_RAGGED_TOKENS` tokens a CPU step builds its per-token request and position indices from the host
    lists; above, by torch ops (`ragged`): the same tensors, dtypes included, for mixed decode rows and chunks."""
    from rollout.attention.backends import base

    rng = random.Random(4)
    table = torch.zeros(8, 64, dtype=torch.int32)
    for _ in range(20):
        b = rng.randint(1, 8)
        lens = [rng.choice([1, 1, rng.randint(2, 60)]) for _ in range(b)]
        lens[0] = max(lens[0], 2)  # NOTE: not a decode-only step
        starts = [rng.randint(0, 500) for _ in range(b)]
        got = {}
        for limit in (10**6, 0):
            monkeypatch.setattr(base, "HOST_RAGGED_TOKENS", limit)
            step = StepInputs(starts, lens, list(range(b)), {None: table}, torch.device("cpu"))
            got[limit] = (step.request_of_token, step.positions, step.first_row)
        (a_of, a_pos, a_first), (b_of, b_pos, b_first) = got[10**6], got[0]
        assert a_of.dtype == b_of.dtype and a_pos.dtype == b_pos.dtype and a_first == b_first
        assert torch.equal(a_of, b_of) and torch.equal(a_pos, b_pos) and len(a_pos) == sum(lens)
