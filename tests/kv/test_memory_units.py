"""Unit tests of the memory machinery, without a model: the sliding-window allocator (exact page ids
recycled), per-group block tables in the scheduler, offload bookkeeping (pages out, pages back,
nothing lost), the host buffer's copies, and the sizing rules."""

from __future__ import annotations

import itertools

import pytest
import torch

from rollout import ContinuousBatchingConfig
from rollout.kv import memory_plan
from rollout.kv.kv_cache import PagedKVCache, storage_layout
from rollout.kv.memory_plan import GiB, KVShape, plan_cache
from rollout.kv.offload import CpuOffloadBuffer, plan_offload
from rollout.kv.page_pool import PagePool
from rollout.kv.page_tables import FREED, FullAttentionAllocator, SlidingWindowAllocator
from rollout.model.model_facts import layer_groups, layer_windows
from rollout.requests import Request, RequestStatus, SamplingParams
from rollout.scheduling.scheduler import Scheduler

PS = 4
_arrival = itertools.count()


def make_request(rid: str, n: int, max_new_tokens: int = 4) -> Request:
    base = sum(map(ord, rid)) * 7
    prompt = [(base + i) % 1000 + 1 for i in range(n)]
    return Request(rid, prompt, max_new_tokens, SamplingParams(temperature=0.0), arrival=next(_arrival))


def step(s: Scheduler):
    """Schedule, advance, append token 7 where a chunk ends; finished requests are removed."""
    out = s.schedule()
    sampled = [x.request for x in out.scheduled if x.samples]
    s.after_step(out)
    for req in sampled:
        if req.append_token(7, None) is not None:  # its stop reason
            s.remove(req)
            req.status = RequestStatus.FINISHED
    s.pool.check_invariants()
    return out


# ------------------------------------------------------------------------------ allocators


def test_sliding_allocator_recycles_exactly_the_pages_the_window_left_behind():
    pool = PagePool(8, PS, enable_prefix_caching=False)
    alloc = SlidingWindowAllocator(pool, window=6)
    table: list[int] = []
    alloc.grow(table, 10)  # tokens 0..9 -> pages 0, 1, 2
    assert table == [0, 1, 2]
    # next query at 10 sees keys 5..10: page 0 (tokens 0..3) is dead
    assert alloc.recycle(table, 10) == [0]
    assert table == [FREED, 1, 2] and list(pool.free_queue) == [3, 4, 5, 6, 7, 0]
    alloc.grow(table, 13)
    assert table == [FREED, 1, 2, 3]
    # next query at 13 sees keys 8..13: page 1 (4..7) is dead, page 2 (8..11) is not
    assert alloc.recycle(table, 13) == [1]
    assert alloc.recycle(table, 13) == []  # idempotent
    assert table == [FREED, FREED, 2, 3] and list(pool.free_queue) == [4, 5, 6, 7, 0, 1]
    alloc.grow(table, 17)  # page 4 taken from the front of the free queue
    assert alloc.recycle(table, 17) == [2]
    assert table == [FREED, FREED, FREED, 3, 4]
    assert pool.num_free_pages == 8 - 2
    pool.check_invariants()


def test_allocator_page_bounds():
    pool = PagePool(64, 16, enable_prefix_caching=False)
    full, sliding = FullAttentionAllocator(pool), SlidingWindowAllocator(pool, window=24)
    assert [full.max_pages(n) for n in (1, 16, 17, 340)] == [1, 1, 2, 22]
    # a query and its 23 past keys span at most 3 pages of 16, short requests fewer
    assert [sliding.max_pages(n) for n in (1, 16, 17, 340)] == [1, 1, 2, 3]
    assert [SlidingWindowAllocator(pool, w).max_pages(1000) for w in (1, 16, 17, 33)] == [1, 2, 2, 3]
    assert [sliding.first_live_page(n) for n in (0, 23, 24, 40, 41)] == [0, 0, 0, 1, 1]


def test_scheduler_keeps_one_table_per_group_and_recycles_after_each_step():
    s = Scheduler(PagePool(16, PS, enable_prefix_caching=False), 64, windows=(None, 8))
    r = make_request("r", 10, max_new_tokens=10)
    s.add(r)
    out = step(s)
    assert out.scheduled[0].tables == [[0, 1, 2], [3, 4, 5]]
    assert s.tables.of(r) == [[0, 1, 2], [3, 4, 5]]  # first query at 10 sees 3..10: nothing dead yet
    step(s)  # computes token 10; the next query at 11 sees 4..11: page 3 (0..3) is dead
    assert s.tables.of(r) == [[0, 1, 2], [FREED, 4, 5]] and s.num_recycled_pages == 1
    step(s)  # 11 -> the query at 12 needs a 4th page in both groups, from the front of the queue
    step(s)
    assert s.tables.of(r) == [[0, 1, 2, 6], [FREED, 4, 5, 7]]
    while s.has_work():
        step(s)
    assert s.pool.num_free_pages == 16 and r.status == RequestStatus.FINISHED
    assert s.max_pages(20) == 5 + 3


def test_a_fork_shares_full_pages_in_every_group_and_recycling_spares_held_pages():
    """Issue 13 item 5: a request with the leader's prompt forks both groups' full pages (the sliding one's
    still in its window), copies the partial pages, and the leader's recycling keeps pages the fork holds."""
    s = Scheduler(PagePool(32, PS, enable_prefix_caching=False), 64, windows=(None, 8), fork_prompts=True)
    a = make_request("a", 10, max_new_tokens=4)
    b = Request("b", list(a.prompt_ids), 4, SamplingParams(temperature=0.0), arrival=next(_arrival))
    s.add(a)
    s.add(b)
    out = step(s)  # the leader computes the prompt; b waits for it
    assert [x.request for x in out.scheduled] == [a] and s.tables.of(a) == [[0, 1, 2], [3, 4, 5]]
    out = step(s)  # b forks: pages 0, 1 and 3, 4 shared, the partial pages 2 and 5 copied into 6 and 7
    assert [(x.request, x.num_new_tokens) for x in out.scheduled] == [(a, 1), (b, 1)]
    assert out.scheduled[1].tables == [[0, 1, 6], [3, 4, 7]]
    assert out.copies == [(2, 6, 1), (5, 7, 1)]
    # after the step the leader's window has left page 3 behind: it dropped its reference, the fork holds it;
    # the fork also holds the pages its partial ones were copied from (the decode kernel reads the copied slots
    # there once for the whole group: Request.fork_alias)
    assert b.fork_alias == (2, [2, 5], 1)
    assert [s.pool.ref_counts[x] for x in (0, 1, 3, 4, 2, 5, 6, 7)] == [2, 2, 1, 2, 2, 2, 1, 1]
    assert s.tables.of(a) == [[0, 1, 2], [FREED, 4, 5]]
    assert s.pool.ref_counts[3] == 1 and 3 not in s.pool.free_queue
    step(s)  # b's window leaves page 3 too: now nobody holds it and it is recycled
    assert s.tables.of(b)[1][0] == FREED and s.pool.ref_counts[3] == 0 and 3 in s.pool.free_queue
    while s.has_work():
        step(s)
    assert s.pool.num_free_pages == 32


def test_a_fork_holds_the_page_it_copied_from_until_its_own_pages_go():
    """The leader finishes first: the page its forks copied their partial page from stays held (its first slots
    are what the forks' aliases name) until the last fork lets go; a preempted fork lets go at once."""
    s = Scheduler(PagePool(16, PS, enable_prefix_caching=False), 64, fork_prompts=True)
    a = make_request("a", 10, max_new_tokens=3)
    forks = [Request(f"b{i}", list(a.prompt_ids), 8, SamplingParams(temperature=0.0), arrival=next(_arrival))
             for i in range(2)]
    for r in (a, *forks):
        s.add(r)
    step(s)
    step(s)  # the forks copy page 2's first slot (position 8; position 9 is each fork's own)
    assert [f.fork_alias for f in forks] == [(2, [2], 1)] * 2 and s.pool.ref_counts[2] == 3
    while a.status is not RequestStatus.FINISHED:
        step(s)
    assert s.pool.ref_counts[2] == 2 and 2 not in s.pool.free_queue
    s.preempt(forks[1])
    assert forks[1].fork_alias is None and s.pool.ref_counts[2] == 1
    while s.has_work():
        step(s)
    assert s.pool.ref_counts[2] == 0 and s.pool.num_free_pages == 16
    assert forks[1].fork_alias is None  # NOTE: recomputed from its tokens, not forked again (the leader is gone)


def test_long_sliding_prompt_is_chunked_to_fit_the_pool():
    s = Scheduler(PagePool(3, PS, enable_prefix_caching=False), 64, windows=(6,))
    r = make_request("r", 30, max_new_tokens=2)
    s.add(r)
    chunks = []
    while s.has_work():
        out = step(s)
        chunks += [x.num_new_tokens for x in out.scheduled]
        assert s.pool.num_pages - s.pool.num_free_pages <= 3
    # 12 tokens fill the pool; then each step may reach the end of the pages it can hold
    assert chunks[0] == 12 and sum(chunks) == 30 + 1 and len(r.generated) == 2


# --------------------------------------------------------------------------- offload bookkeeping


class FakeOffloader:
    """Pure-Python stand-in for `CpuOffloadBuffer`: records which page went to which slot."""

    def __init__(self, num_slots: int) -> None:
        self.free = list(range(num_slots))
        self.held: dict[int, int] = {}  # slot -> page it holds
        self.log: list[tuple] = []

    def save(self, pages):
        if len(pages) > len(self.free):
            self.log.append(("full", list(pages)))
            return None
        slots = [self.free.pop(0) for _ in pages]
        self.held.update(zip(slots, pages, strict=True))
        self.log.append(("save", list(pages), slots))
        return slots

    def restore(self, slots, pages):
        self.log.append(("restore", list(slots), list(pages)))
        self.discard(slots)

    def discard(self, slots):
        for slot in slots:
            del self.held[slot]
        self.free += slots


def three_requests(offloader, num_blocks=6):
    s = Scheduler(PagePool(num_blocks, PS, enable_prefix_caching=False), 64, offloader=offloader)
    reqs = [make_request(rid, 7, max_new_tokens=4) for rid in "abc"]
    for r in reqs:
        s.add(r)
    step(s)  # a, b, c prefill: pages [0, 1], [2, 3], [4, 5]
    step(s)  # position 7
    return s, reqs


def test_preempted_request_parks_its_pages_and_resumes_without_recompute():
    off = FakeOffloader(4)
    s, (a, b, c) = three_requests(off)
    out = step(s)  # position 8: everyone needs a third page; c (newest) is preempted
    assert out.preempted == [c]
    assert off.log == [("save", [4, 5], [0, 1])]
    assert c.offloaded == [0, 1] and c.num_computed_tokens == 8 and c.page_ids == []
    assert a.page_ids == [0, 1, 5] and b.page_ids == [2, 3, 4]
    while c.status == RequestStatus.PENDING:
        out = step(s)
    # readmitted once a and b are gone: fresh pages, KV copied back, only its next token computed
    assert [(x.request.request_id, x.num_new_tokens) for x in out.scheduled] == [("c", 1)]
    assert off.log[1][0] == "restore" and off.log[1][1] == [0, 1]
    assert c.page_ids[:2] == off.log[1][2] and c.offloaded == []
    assert s.num_offloaded_pages == s.num_restored_pages == 2
    while s.has_work():
        step(s)
    assert len(c.generated) == 4 and off.free == [2, 3, 0, 1] and off.held == {}
    assert s.pool.num_free_pages == 6


def test_full_offload_buffer_falls_back_to_recompute():
    off = FakeOffloader(1)  # c needs 2 slots
    s, (a, b, c) = three_requests(off)
    step(s)
    assert off.log == [("full", [4, 5])] and s.num_offload_fallbacks == 1
    assert c.offloaded == [] and c.num_computed_tokens == 0 and off.free == [0]


def test_cancelling_an_offloaded_request_frees_its_slots():
    off = FakeOffloader(4)
    s, (a, b, c) = three_requests(off)
    step(s)
    assert off.held == {0: 4, 1: 5}
    s.remove(c)
    assert off.held == {} and sorted(off.free) == [0, 1, 2, 3] and c.offloaded == []


def test_offload_with_two_groups_saves_only_live_pages():
    off = FakeOffloader(16)
    s = Scheduler(PagePool(12, PS, enable_prefix_caching=False), 64, windows=(None, 4), offloader=off)
    a, b = make_request("a", 9, max_new_tokens=12), make_request("b", 9, max_new_tokens=12)
    s.add(a)
    s.add(b)
    step(s)  # a: full [0, 1, 2], sliding [3, 4, 5]; b: full [6, 7, 8], sliding [9, 10, 11]
    assert s.tables.of(a) == [[0, 1, 2], [FREED, 4, 5]]  # query at 9 sees 6..9: page 0 is dead
    assert s.tables.of(b) == [[6, 7, 8], [FREED, 10, 11]]
    step(s)  # position 9 (page 2)
    step(s)  # position 10
    step(s)  # position 11
    out = step(s)  # position 12: both need a 4th page in both groups; the 4 free (2 recycled) do
    assert not out.preempted
    for _ in range(3):  # 13, 14, 15
        assert not step(s).preempted
    full, sliding = (list(t) for t in s.tables.of(b))
    assert sliding[:3] == [FREED] * 3  # the query at 16 sees 13..16: only logical page 3 is live
    out = step(s)  # position 16: 2 pages free (2 more recycled), a takes them, b must go
    assert out.preempted == [b]
    # b's live pages: its 4 full-attention pages, and the one sliding page its window still sees
    assert off.log == [("save", full + sliding[3:], [0, 1, 2, 3, 4])]
    assert b.offloaded == [0, 1, 2, 3, 4] and b.num_computed_tokens == 16
    while s.has_work():
        step(s)
    assert [x[0] for x in off.log] == ["save", "restore"]
    assert off.held == {} and s.pool.num_free_pages == 12
    assert len(a.generated) == len(b.generated) == 12


# ------------------------------------------------------------------------------ host buffer


def test_cpu_offload_buffer_round_trips_pages_and_loses_none():
    cache = PagedKVCache(6, PS, torch.device("cpu"), torch.float32, layer_groups=[0, 1, 0, 1])
    for layer in range(4):
        cache.layer(layer, 2, 3)
    assert len(cache.keys) == 2  # layer k of each group shares storage k
    assert cache.layer(0, 2, 3)[0] is cache.layer(1, 2, 3)[0]
    for k, v in zip(cache.keys.values(), cache.values.values(), strict=True):
        k.copy_(torch.randn_like(k))
        v.copy_(torch.randn_like(v))
    before = {key: (k.clone(), cache.values[key].clone()) for key, k in cache.keys.items()}

    buf = CpuOffloadBuffer(cache, 3)
    slots = buf.save([1, 4])
    assert slots == [0, 1] and buf.num_free == 1
    assert buf.save([0, 2]) is None and buf.num_free == 1  # no room: nothing taken
    for t in (*cache.keys.values(), *cache.values.values()):
        t.zero_()
    buf.restore(slots, [2, 5])
    assert buf.num_free == 3
    for key, (k0, v0) in before.items():
        for t, t0 in ((cache.keys[key], k0), (cache.values[key], v0)):
            pages, pages0 = t.view(2, 6, PS, 3), t0.view(2, 6, PS, 3)  # head-major [Hkv, blocks, ps, D]
            assert torch.equal(pages[:, 2], pages0[:, 1]) and torch.equal(pages[:, 5], pages0[:, 4])
            assert not pages[:, 1].any()  # only the target pages were written
    extra = buf.save([3])
    buf.discard(extra)
    assert buf.num_free == 3 and sorted(buf.free_slots) == [0, 1, 2]
    assert not buf.pin  # plain host memory without CUDA (pinning needs a driver)


def test_storage_layout_and_groups_of_a_hybrid_model():
    from support.tiny_models import make_model

    gemma, mistral = make_model("gemma2"), make_model("mistral", sliding_window=24)
    assert layer_windows(gemma) == [16, None, 16, None]
    assert layer_groups([16, None, 16, None]) == ([None, 16], [1, 0, 1, 0])
    assert layer_windows(mistral) == [24, 24]
    assert layer_windows(make_model("qwen3")) == [None, None]
    assert storage_layout([1, 0, 1, 0]) == [0, 0, 1, 1]
    assert storage_layout([0, 0, 0, 1]) == [0, 1, 2, 0]


# ------------------------------------------------------------------------------------- sizing

SHAPE = KVShape(num_layers=4, num_kv_heads=8, head_dim=128, dtype=torch.bfloat16)  # 16 KiB per token


def test_cpu_sizing_takes_a_small_share_of_ram():
    num_blocks, mbt = plan_cache(SHAPE, 256, None, None, 0.8, torch.device("cpu"), (4096, 8))
    assert num_blocks * 256 * SHAPE.bytes_per_token <= 1 * GiB
    assert mbt == 8192
    assert plan_cache(SHAPE, 256, 7, 300, 0.8, torch.device("cpu")) == (7, 300)  # explicit wins


def test_gpu_sizing_uses_max_memory_percent_of_free_memory(monkeypatch):
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (80 * GiB, 96 * GiB))
    act, logits = 30_000, 1_200_000  # a 150k vocabulary
    num_blocks, mbt = plan_cache(SHAPE, 256, None, None, 0.5, torch.device("cuda"), (act, logits))
    step = mbt * (act + SHAPE.bytes_per_token) + mbt * logits
    assert mbt == 8192
    assert num_blocks == (40 * GiB - step) // (256 * SHAPE.bytes_per_token)
    # little free memory: the step budget shrinks, never under 256 tokens
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (1 * GiB, 96 * GiB))
    _, mbt = plan_cache(SHAPE, 256, None, None, 0.5, torch.device("cuda"), (act, logits))
    assert mbt == 256
    _, mbt = plan_cache(SHAPE, 256, None, None, 0.5, torch.device("cuda"), (act, logits), max_requests=64)
    assert 256 < mbt < 8192  # fewer sampled rows, less logits memory


def test_offload_sizing_is_capped_by_available_ram(monkeypatch):
    class VM:
        available = 10 * GiB

    monkeypatch.setattr("rollout.kv.offload.psutil.virtual_memory", lambda: VM)
    assert plan_offload(0.0, 0.8, 4096) == 0
    assert plan_offload(1.0, 0.8, 4096) == GiB // 4096
    assert plan_offload(None, 0.8, 4096) == int(8 * GiB) // 4096
    assert plan_offload(100.0, 0.5, 4096) == 5 * GiB // 4096  # clamped, with a warning


@pytest.mark.parametrize("windows", [(None,), (None, 8), (8,)])
def test_every_page_and_slot_comes_back_after_random_preemptions(windows):
    """A small soak: many requests on a tight pool with offload; pages and host slots all return."""
    off = FakeOffloader(6)
    s = Scheduler(PagePool(10, PS, enable_prefix_caching=False), 16, windows=windows, offloader=off)
    reqs = [make_request(f"r{i}", 3 + (7 * i) % 11, max_new_tokens=4 + (5 * i) % 9) for i in range(10)]
    for r in reqs:
        s.add(r)
    for _ in range(500):
        if not s.has_work():
            break
        step(s)
    assert not s.has_work()
    assert all(len(r.generated) == r.max_new_tokens for r in reqs)
    assert s.pool.num_free_pages == 10 and off.held == {} and len(off.free) == 6
    assert s.num_preemptions > 0


def test_an_explicit_max_memory_percent_is_honoured_on_cpu(monkeypatch):
    class VM:
        available = 64 * GiB

    monkeypatch.setattr(memory_plan.psutil, "virtual_memory", lambda: VM)
    page = 256 * SHAPE.bytes_per_token
    cpu = torch.device("cpu")
    default = ContinuousBatchingConfig()
    assert not default.memory_percent_set and default.max_memory_percent == 0.8  # the documented default
    num_blocks, _ = plan_cache(SHAPE, 256, None, None, 0.8, cpu, cpu_share_set=default.memory_percent_set)
    assert num_blocks == 1 * GiB // page  # default: min(5% of 64 GiB, 1 GiB)
    explicit = ContinuousBatchingConfig(max_memory_percent=0.25)
    assert explicit.memory_percent_set and explicit.replace(page_size=16).memory_percent_set
    assert not default.replace(page_size=16).memory_percent_set
    num_blocks, _ = plan_cache(SHAPE, 256, None, None, 0.25, cpu, cpu_share_set=explicit.memory_percent_set)
    assert num_blocks == 16 * GiB // page


def test_an_engine_sizes_its_cpu_cache_from_an_explicit_max_memory_percent(monkeypatch):
    from support.tiny_models import make_model

    from rollout.attention.backends import attention_memory
    from rollout.engine.core import EngineCore

    class VM:
        available = 64 * GiB

    monkeypatch.setattr(memory_plan.psutil, "virtual_memory", lambda: VM)
    model = make_model("qwen3")
    page_bytes = 16 * memory_plan.kv_shape_from_config(model.config, torch.float32).bytes_per_token
    small = EngineCore(model, None, ContinuousBatchingConfig(page_size=16, max_memory_percent=0.001))
    # NOTE: the attention backend's fixed temporaries (rollout.attention.backends.attention_memory) share the budget
    shape = memory_plan.kv_shape_from_config(model.config, torch.float32)
    fixed = attention_memory(small.backend.name, shape, 16, None, False, 1024 // 16).fixed
    assert small.page_pool.num_pages == (int(64 * GiB * 0.001) - fixed) // page_bytes


def test_a_default_cache_is_no_larger_than_the_context_needs():
    cpu = torch.device("cpu")
    budget_pages, _ = plan_cache(SHAPE, 16, None, None, 0.8, cpu)
    pages, _ = plan_cache(SHAPE, 16, None, None, 0.8, cpu, context_pages=4)  # NOTE: a 64-token context
    assert pages == 2 * 4 * memory_plan.DEFAULT_CONCURRENCY < budget_pages
    assert plan_cache(SHAPE, 16, None, None, 0.8, cpu, max_requests=4, context_pages=8)[0] == 2 * 8 * 4
    assert plan_cache(SHAPE, 16, 7, None, 0.8, cpu, context_pages=1)[0] == 7  # explicit wins
    assert plan_cache(SHAPE, 16, None, None, 0.8, cpu, context_pages=10**9)[0] == budget_pages
