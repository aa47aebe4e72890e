"""Cascade (shared-prefix) decode attention of the C++ CPU kernel (`cascade_decode_attention`).

Rows whose page tables name the same full pages (a GRPO group forked from one prompt, prefix-cache hits on
the same pages) read those pages once as a group, and their own pages alone; the partial softmaxes merge by
log-sum-exp. Checked against the per-row kernel (`paged_decode_attention`) and an fp64 reference on random
paged caches with shared and private pages: groups of several sizes sharing different prefixes, rows that
share only part of a group's prefix, rows with no sharing, partial last pages, sliding windows (rows that
start inside or past the shared pages), softcap, fp32 / bf16 / fp16 caches, GQA and MHA, one and two threads,
and rows whose every key is shared. The grouping itself (`cascade_plan`) is checked on hand-made tables.

Forks copy their leader's partial prompt page: with `alias` (per row: logical page, block copied from, slots
copied) a group also reads those slots once, from the block they were copied from, when every member reads
that page through a copy of one block or as the block itself; the engine passes the aliases of its forks.
"""

from __future__ import annotations

import shutil

import pytest
import torch
from support.paged_cases import forked_case, reference, shared_case

from rollout.kernels import cpu_kernels

HAVE_COMPILER = shutil.which("c++") is not None or shutil.which("g++") is not None


@pytest.fixture(scope="module")
def kernels():
    paged, cascade, plan = (cpu_kernels.paged_decode_attention(), cpu_kernels.cascade_decode_attention(),
                            cpu_kernels.cascade_plan())
    if paged is None and not HAVE_COMPILER:
        pytest.skip("no C++ compiler: the kernel cannot be built here")
    assert paged is not None and cascade is not None and plan is not None
    return paged, cascade, plan


@pytest.mark.parametrize("heads,kv_heads,head_dim", [(4, 2, 64), (12, 4, 64), (2, 2, 128), (5, 1, 64), (3, 1, 80),
                                                     (16, 2, 128)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("window,softcap", [(None, 0.0), (None, 5.0), (21, 0.0), (40, 5.0)])
@pytest.mark.parametrize("ps", [4, 16])
def test_cascade_equals_the_per_row_kernel(kernels, heads, kv_heads, head_dim, dtype, window, softcap, ps):
    paged, cascade, plan = kernels
    seed = heads * 1000 + head_dim + ps + (window or 0)
    table, row, start, end, blocks = shared_case(ps, window, seed)
    assert plan(table, row, start, end, ps), "the case has no shared pages: it would test nothing"
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(kv_heads, blocks * ps, head_dim, generator=g).to(dtype)
    v = torch.randn(kv_heads, blocks * ps, head_dim, generator=g).to(dtype)
    q = torch.randn(len(row), heads, head_dim, generator=g)
    scale = head_dim**-0.5
    a, b = torch.empty_like(q), torch.empty_like(q)
    paged(q, k, v, table, row, start, end, ps, scale, softcap, a)
    cascade(q, k, v, table.to(torch.int32), row, start, end, ps, scale, softcap, b)
    torch.testing.assert_close(b, a, atol=2e-6, rtol=1e-5)
    torch.testing.assert_close(b.double(), reference(q, k, v, table, row, start, end, ps, scale, softcap),
                               atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("softcap", [0.0, 5.0])
@pytest.mark.parametrize("members,heads,kv_heads,head_dim", [(16, 12, 4, 64), (6, 24, 2, 128), (9, 7, 1, 64)])
def test_large_groups_equal_the_per_row_kernel(kernels, dtype, softcap, members, heads, kv_heads, head_dim):
    """GRPO-sized groups: 16-160 query heads on one set of shared pages (the heads-as-lanes path from 16 heads),
    a partial last head vector, and each member's own pages of different lengths."""
    paged, cascade, plan = kernels
    ps, shared = 16, 5
    g = torch.Generator().manual_seed(members * heads)
    blocks = shared + 3 * members + 1
    table = torch.zeros(members, shared + 3, dtype=torch.long)
    for i in range(members):
        table[i] = torch.tensor(list(range(shared)) + [shared + 3 * i + j for j in range(3)])
    table = torch.randperm(blocks, generator=g)[table]
    end = torch.tensor([shared * ps + 1 + (7 * i) % 40 for i in range(members)])
    row, start = torch.arange(members), torch.zeros(members, dtype=torch.long)
    groups = plan(table, row, start, end, ps)
    assert len(groups) == 1 and groups[0][1] == shared and len(groups[0][2]) == members
    assert members * heads // kv_heads >= 16
    k = torch.randn(kv_heads, blocks * ps, head_dim, generator=g).to(dtype)
    v = torch.randn(kv_heads, blocks * ps, head_dim, generator=g).to(dtype)
    q = torch.randn(members, heads, head_dim, generator=g)
    scale = head_dim**-0.5
    a, b = torch.empty_like(q), torch.empty_like(q)
    paged(q, k, v, table, row, start, end, ps, scale, softcap, a)
    cascade(q, k, v, table, row, start, end, ps, scale, softcap, b)
    torch.testing.assert_close(b, a, atol=2e-6, rtol=1e-5)
    torch.testing.assert_close(b.double(), reference(q, k, v, table, row, start, end, ps, scale, softcap),
                               atol=2e-5, rtol=1e-5)


def test_cascade_is_the_same_at_one_and_two_threads(kernels):
    _, cascade, _ = kernels
    table, row, start, end, blocks = shared_case(16, None, 7)
    g = torch.Generator().manual_seed(7)
    k, v = torch.randn(2, blocks * 16, 64, generator=g), torch.randn(2, blocks * 16, 64, generator=g)
    q = torch.randn(len(row), 4, 64, generator=g)
    before = torch.get_num_threads()
    outs = []
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            o = torch.empty_like(q)
            cascade(q, k, v, table, row, start, end, 16, 0.125, 0.0, o)
            outs.append(o)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(outs[0], outs[1])


def test_plan_groups_rows_by_shared_block_ids(kernels):
    """Rows 0, 2, 3 fork one prompt (blocks 5, 6, 7); row 3 is a prefix-cache hit on its first page only;
    row 1 has other blocks; row 4 reads the same blocks but only inside a partial page (nothing full)."""
    _, _, plan = kernels
    ps = 4
    table = torch.tensor([[5, 6, 7, 10], [1, 2, 3, 11], [5, 6, 7, 12], [5, 13, 14, 0], [5, 0, 0, 0]])
    row = torch.arange(5)
    end = torch.tensor([14, 14, 13, 10, 3])
    start = torch.zeros(5, dtype=torch.long)
    groups = plan(table, row, start, end, ps)
    # NOTE: row 3 shares one page of three: keeping it reads 1 + 3 * 2 + ... more than its own 2 pages alone
    assert [(f, p, sorted(r)) for f, p, r, *_ in groups] == [(0, 3, [0, 2])]
    # a sliding window that has moved past page 0: the group starts at page 1, row 3 no longer shares
    start = torch.tensor([4, 4, 4, 4, 0])
    assert [(f, p, sorted(r)) for f, p, r, *_ in plan(table, row, start, end, ps)] == [(1, 2, [0, 2])]
    # two rows sharing one page only, nothing else: still a group (one page read once)
    assert [
        (f, p, sorted(r))
        for f, p, r, *_ in plan(
            table[[3, 4]], torch.tensor([0, 1]), torch.zeros(2, dtype=torch.long), torch.tensor([10, 4]), ps
        )
    ] == [(0, 1, [0, 1])]


def test_rows_sharing_only_a_partial_page_read_its_slots_once(kernels):
    """Rows in no group that read the first slots of one block (a verifying row's tokens before its context has a
    full page, each query reading up to its own position) form a group of no full pages: the slots every member
    reads, up to the shortest, once; rows reading their page from other blocks do not."""
    plan = kernels[2]
    table = torch.tensor([[1, 2], [3, 4], [1, 5]])
    row, start = torch.arange(3), torch.zeros(3, dtype=torch.long)
    assert plan(table, row, start, torch.tensor([3, 8, 2]), 4) == [(0, 0, [0, 2], 1, 2)]
    assert plan(table[[0, 1]], torch.arange(2), start[:2], torch.tensor([3, 3]), 4) == []
    # NOTE: one verifying row of 5 tokens at positions 20-24, its context in one partial page of 32 slots
    ps, g = 32, torch.Generator().manual_seed(7)
    row, start, end = torch.zeros(5, dtype=torch.long), torch.zeros(5, dtype=torch.long), torch.arange(21, 26)
    table = torch.tensor([[2, 0]])
    assert plan(table, row, start, end, ps) == [(0, 0, [0, 1, 2, 3, 4], 2, 21)]
    k, v = torch.randn(2, 3 * ps, 64, generator=g), torch.randn(2, 3 * ps, 64, generator=g)
    _cascade_is_the_per_row_kernel(kernels, torch.randn(5, 4, 64, generator=g), k, v, table, row, start, end, ps)


def _cascade_is_the_per_row_kernel(kernels, q, k, v, table, row, start, end, ps):
    """The cascade kernel's output equals the per-row kernel's (float rounding) and fp64 attention."""
    paged, cascade, _ = kernels
    a, b = torch.empty_like(q), torch.empty_like(q)
    paged(q, k, v, table, row, start, end, ps, 0.125, 0.0, a)
    cascade(q, k, v, table, row, start, end, ps, 0.125, 0.0, b)
    torch.testing.assert_close(b, a, atol=2e-6, rtol=1e-5)
    torch.testing.assert_close(b.double(), reference(q, k, v, table, row, start, end, ps, 0.125, 0.0),
                               atol=2e-5, rtol=1e-5)


def test_a_verifying_rows_group_reads_its_partial_page_once_too(kernels):
    """A verifying row's queries share its full pages and, in one block, the partial page after them up to the
    first query's end: each query's own keys are only the draft tokens before it."""
    plan = kernels[2]
    ps, g = 16, torch.Generator().manual_seed(8)
    table = torch.tensor([[4, 1, 3, 0], [5, 6, 7, 2]])
    row = torch.tensor([0] * 4 + [1] * 3)
    end = torch.tensor([38, 39, 40, 41, 20, 21, 22])
    start = torch.zeros(7, dtype=torch.long)
    assert sorted(plan(table, row, start, end, ps)) == [(0, 1, [4, 5, 6], 6, 4), (0, 2, [0, 1, 2, 3], 3, 6)]
    k, v = torch.randn(2, 8 * ps, 64, generator=g), torch.randn(2, 8 * ps, 64, generator=g)
    for group in (2, 10):  # NOTE: 10 query heads a KV head: 40 and 30 heads a group (16 at a time)
        q = torch.randn(7, 2 * group, 64, generator=g)
        _cascade_is_the_per_row_kernel(kernels, q, k, v, table, row, start, end, ps)


@pytest.mark.parametrize("arch", ["qwen3", "mistral", "gemma2"])
def test_engine_groups_read_their_prompt_once_and_match_generate(kernels, arch):
    """GRPO-shaped requests (3 prompts x G=4, each sample its own completion length) forked from one prompt's
    pages: the decode steps form cascade groups (checked on the kernel's own arguments), which also read the
    slots the forks copied from the leader's partial page once (while the leader runs and after it finished),
    every greedy completion equals plain `generate`, and every page (the copied-from ones too) is free at the
    end; Mistral's sliding window and Gemma 2's softcap included."""
    from support.tiny_models import hf_greedy, make_model, random_prompts
    from transformers import GenerationConfig

    from rollout import ContinuousBatchingConfig
    from rollout.engine.core import EngineCore

    _, _, plan = kernels
    model = make_model(arch)
    core = EngineCore(model, GenerationConfig(do_sample=False, eos_token_id=None),
                      ContinuousBatchingConfig(page_size=16))
    assert core.backend.name == "cpu"
    kernel, grouped, extended = core.backend.kernel, [], []

    def counting(q, k, v, table, row, start, end, ps, *rest):
        groups = plan(table.long().contiguous(), row, start, end, ps, *rest[3:])
        grouped.append(len(groups))
        extended.append((sum(g[4] > 0 for g in groups), all(reqs[i].status.is_final for i in range(0, 12, 4))))
        return kernel(q, k, v, table, row, start, end, ps, *rest)

    core.backend.kernel = counting
    prompts = random_prompts(3, 50, 90, seed=3)
    reqs = [core.make_request(p, request_id=f"{i}-{j}", max_new_tokens=6 + 5 * j)
            for i, p in enumerate(prompts) for j in range(4)]
    for r in reqs:
        core.add(r)
    while core.has_work():
        core.step()
    # NOTE: Mistral's 24-token window holds at most one full 16-token page, which leaves it as decoding moves on; a
    # group whose window holds none shares the copied slots of its one partial page alone
    assert max(grouped) == 3, "each prompt's samples should form one cascade group"
    assert max(n for n, _ in extended) == max(grouped), "the groups should read their forks' copied slots once too"
    # NOTE: the leaders (`i-0`, 6 new tokens) finish first; their forks keep the copied-from blocks
    assert max(n for n, gone in extended if gone) >= 1, ("after the leaders finished, the copied slots should still be "
                                                         "shared")
    bm = core.scheduler.pool
    bm.check_invariants()
    assert bm.num_free_pages == bm.num_pages, "a page outlived its requests"
    for r in reqs:
        prompt = prompts[int(r.request_id.split("-")[0])]
        assert r.generated == hf_greedy(model, prompt, len(r.generated))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("softcap", [0.0, 5.0])
@pytest.mark.parametrize("leader", [True, False])
@pytest.mark.parametrize("members,heads,kv_heads,ps,rest", [(16, 12, 4, 16, 11), (3, 4, 2, 8, 1), (8, 8, 1, 16, 15)])
def test_forks_read_their_copied_partial_page_once(kernels, dtype, softcap, leader, members, heads, kv_heads, ps,
                                                   rest):
    """With the forks' aliases the group's shared keys run on into the copied slots (read from the leader's
    block, whether the leader is still in the step or gone), and every row equals the per-row kernel."""
    paged, cascade, plan = kernels
    shared = 3
    table, alias, end, k, v = forked_case(ps, members, shared, rest, leader, members * ps + rest, kv_heads, 64, dtype)
    row, start = torch.arange(members), torch.zeros(members, dtype=torch.long)
    (first, pages, rows, block, slots), = plan(table, row, start, end, ps, alias)
    source = int(alias[1, 1])
    assert (first, pages, sorted(rows), block, slots) == (0, shared, list(range(members)), source, rest)
    assert plan(table, row, start, end, ps)[0][3:] == (-1, 0), "without aliases only full pages are shared"
    q = torch.randn(members, heads, 64, generator=torch.Generator().manual_seed(rest))
    a, b, c = torch.empty_like(q), torch.empty_like(q), torch.empty_like(q)
    paged(q, k, v, table, row, start, end, ps, 0.125, softcap, a)
    cascade(q, k, v, table, row, start, end, ps, 0.125, softcap, b, alias)
    cascade(q, k, v, table.to(torch.int32), row, start, end, ps, 0.125, softcap, c, alias)
    torch.testing.assert_close(b, a, atol=2e-6, rtol=1e-5)
    assert torch.equal(b, c)
    paged(q, k, v, table, row, start, end, ps, 0.125, softcap, c, alias)  # NOTE: the engine passes either kernel
    assert torch.equal(c, a), "the per-row kernel reads each row's own copy: aliases change nothing there"
    torch.testing.assert_close(b.double(), reference(q, k, v, table, row, start, end, ps, 0.125, softcap),
                               atol=2e-5, rtol=1e-5)


def test_aliases_extend_a_group_only_when_every_member_agrees(kernels):
    """No extension when one member reads its own page there without a copy (a prefix-cache hit on the same full
    pages), or when copies name different blocks; a member whose keys end inside the copy caps its length."""
    _, _, plan = kernels
    ps, shared, rest = 8, 2, 5
    table, alias, end, _, _ = forked_case(ps, 4, shared, rest, True, 1)
    row, start = torch.arange(4), torch.zeros(4, dtype=torch.long)
    assert plan(table, row, start, end, ps, alias)[0][3:] == (int(alias[1, 1]), rest)
    own = alias.clone()
    own[2] = torch.tensor([-1, 0, 0])
    assert plan(table, row, start, end, ps, own)[0][3:] == (-1, 0)
    other = alias.clone()
    other[3, 1] = int(table[3, shared])
    assert plan(table, row, start, end, ps, other)[0][3:] == (-1, 0)
    short = end.clone()
    short[1] = shared * ps + 3  # NOTE: reads only 3 of the 5 copied slots (a test's case: forks read past them)
    assert plan(table, row, start, short, ps, alias)[0][3:] == (int(alias[1, 1]), 3)


def test_bad_aliases_are_refused(kernels):
    _, cascade, _ = kernels
    ps = 8
    table, alias, end, k, v = forked_case(ps, 3, 2, 5, True, 2)
    q = torch.randn(3, 4, 64)
    row, start, o = torch.arange(3), torch.zeros(3, dtype=torch.long), torch.empty(3, 4, 64)
    bad = alias.clone()
    bad[1, 1] = k.shape[1] // ps  # NOTE: one past the last block
    with pytest.raises(RuntimeError, match="alias block or slots out of range"):
        cascade(q, k, v, table, row, start, end, ps, 0.125, 0.0, o, bad)
    with pytest.raises(RuntimeError, match=r"alias must be int64 \[n, 3\]"):
        cascade(q, k, v, table, row, start, end, ps, 0.125, 0.0, o, alias[:2])
