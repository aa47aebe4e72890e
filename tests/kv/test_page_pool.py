"""Block pool: exact block ids, ref counts, chained prefix hashes, LRU reuse of freed cached pages.

Pure Python (no model, no torch). Exact ids follow the pool's contract: a fresh pool hands out
blocks in id order; freed blocks join the back of the free queue, a request's tail page first, so
the tail of a freed prefix is evicted before its head.
"""

from __future__ import annotations

import hashlib
import struct

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rollout.kv.page_pool import PagePool, page_hashes

PS = 4  # tokens per page in these tests


def hashes_of(tokens: list[int]) -> list[bytes]:
    """Chained hashes of every full page of `tokens`."""
    return page_hashes(tokens, PS, len(tokens) // PS)


def cache_all(bm: PagePool, blocks: list[int], tokens: list[int]) -> None:
    for block, h in zip(blocks, hashes_of(tokens), strict=False):
        bm.cache_page(block, h)


# ------------------------------------------------------------------------------------ allocate / free


def test_fresh_pool_allocates_in_id_order_and_frees_to_the_back_tail_first():
    bm = PagePool(8, PS)
    assert bm.allocate(3) == [0, 1, 2]
    assert bm.allocate(2) == [3, 4]
    assert bm.num_free_pages == 3
    assert bm.ref_counts == [1, 1, 1, 1, 1, 0, 0, 0]
    bm.free([0, 1, 2])
    assert bm.num_free_pages == 6
    # never-used blocks first, then the freed ones, tail page first
    assert list(bm.free_queue) == [5, 6, 7, 2, 1, 0]
    assert bm.allocate(4) == [5, 6, 7, 2]
    assert bm.allocate(2) == [1, 0]
    bm.check_invariants()


def test_allocate_more_than_free_raises_and_takes_nothing():
    bm = PagePool(4, PS)
    bm.allocate(3)
    with pytest.raises(MemoryError):
        bm.allocate(2)
    assert bm.num_free_pages == 1
    assert bm.allocate(1) == [3]
    bm.check_invariants()


def test_double_free_is_an_error():
    bm = PagePool(4, PS)
    blocks = bm.allocate(1)
    bm.free(blocks)
    with pytest.raises(RuntimeError):
        bm.free(blocks)


def test_blocks_needed_rounds_up():
    bm = PagePool(4, PS)
    assert [bm.pages_needed(n) for n in (0, 1, 4, 5, 8, 9)] == [0, 1, 1, 2, 2, 3]


def test_fork_shares_blocks_until_the_last_reference_goes():
    bm = PagePool(4, PS)
    blocks = bm.allocate(2)
    bm.fork(blocks)
    assert [bm.ref_counts[b] for b in blocks] == [2, 2]
    bm.free(blocks)
    assert [bm.ref_counts[b] for b in blocks] == [1, 1]
    assert bm.num_free_pages == 2  # still held once
    bm.free(blocks)
    assert bm.num_free_pages == 4
    bm.check_invariants()


# ------------------------------------------------------------------------------------ prefix cache


def test_identical_prefix_hits_the_same_blocks_and_takes_references():
    bm = PagePool(8, PS)
    tokens = list(range(1, 13))  # 3 full pages
    a = bm.allocate(3)
    cache_all(bm, a, tokens)
    assert bm.peek_prefix(hashes_of(tokens)) == 3
    assert [bm.ref_counts[b] for b in a] == [1, 1, 1]  # peek takes nothing
    hits = bm.match_prefix(hashes_of(tokens))
    assert hits == a
    assert [bm.ref_counts[b] for b in a] == [2, 2, 2]
    # a longer prompt with the same first two pages hits exactly those two
    longer = tokens[:8] + [99, 98, 97, 96, 95]
    assert bm.match_prefix(hashes_of(longer)) == a[:2]
    assert [bm.ref_counts[b] for b in a] == [3, 3, 2]
    bm.check_invariants()


def test_hashes_are_chained_a_different_first_page_means_no_hit_on_the_second():
    bm = PagePool(8, PS)
    tokens = [1, 2, 3, 4, 5, 6, 7, 8]
    cache_all(bm, bm.allocate(2), tokens)
    other = [9, 9, 9, 9, 5, 6, 7, 8]  # same second page, different first page
    assert hashes_of(other)[1] != hashes_of(tokens)[1]
    assert bm.peek_prefix(hashes_of(other)) == 0
    assert bm.match_prefix(hashes_of(other)) == []
    # a miss in the middle stops the run: page 3 equal, page 2 different -> one hit
    three = tokens + [10, 11, 12, 13]
    cache_all(bm, [0, 1, *bm.allocate(1)], three)
    probe = tokens[:4] + [0, 0, 0, 0] + [10, 11, 12, 13]
    assert bm.match_prefix(hashes_of(probe)) == [0]
    bm.check_invariants()


def test_page_hashes_continue_a_chain():
    tokens = list(range(20))
    full = page_hashes(tokens, PS, 5)
    assert page_hashes(tokens, PS, 3, start=2, parent=full[1]) == full[2:]
    assert len(set(full)) == 5


def test_page_keys_are_a_strong_chained_digest_of_the_token_bytes():
    """Prefix-cache keys are 128-bit BLAKE2b digests chained over the pages' int64 token bytes, so a hit
    (taken without comparing tokens) cannot serve another prompt's KV through a 64-bit hash collision."""
    tokens = [3, 70000, 5, 2**40, 0, 1, 2, 3]
    parent = b"rollout-prefix-root"
    expected = []
    for p in range(2):
        page = tokens[p * PS : (p + 1) * PS]
        parent = hashlib.blake2b(parent + struct.pack(f"={PS}q", *page), digest_size=16).digest()
        expected.append(parent)
    assert hashes_of(tokens) == expected
    # token ids are bytes of the key, not Python hash() values: ids equal modulo 2**61 - 1 differ
    assert hashes_of([1, 2, 3, 4]) != hashes_of([1, 2, 3, 4 + 2**61 - 1])


def test_first_writer_wins_for_a_hash():
    bm = PagePool(4, PS)
    h = hashes_of([1, 2, 3, 4])[0]
    a, b = bm.allocate(2)
    bm.cache_page(a, h)
    bm.cache_page(b, h)  # same content computed twice: the first block stays the cached one
    assert bm.cached == {h: a}
    assert bm.page_hash[b] is None
    bm.check_invariants()


def test_freed_cached_blocks_count_as_free_and_a_hit_revives_them():
    bm = PagePool(6, PS)
    tokens = list(range(1, 9))
    a = bm.allocate(2)
    cache_all(bm, a, tokens)
    bm.free(a)
    assert bm.num_free_pages == 6
    assert bm.match_prefix(hashes_of(tokens)) == a
    assert bm.num_free_pages == 4
    assert a[0] not in bm.free_queue and a[1] not in bm.free_queue
    bm.check_invariants()


def test_lru_eviction_order_of_freed_cached_blocks():
    bm = PagePool(8, PS)
    ta = list(range(1, 13))  # A: 3 pages
    tb = list(range(50, 58))  # B: 2 pages
    a = bm.allocate(3)
    b = bm.allocate(2)
    assert (a, b) == ([0, 1, 2], [3, 4])
    cache_all(bm, a, ta)
    cache_all(bm, b, tb)
    bm.free(a)  # freed first: evicted first, tail page first
    bm.free(b)
    assert list(bm.free_queue) == [5, 6, 7, 2, 1, 0, 4, 3]
    # never-used blocks go before any cached one
    assert bm.allocate(3) == [5, 6, 7]
    assert bm.peek_prefix(hashes_of(ta)) == 3
    # next comes A's tail page: its hash is evicted, A's first two pages still hit
    assert bm.allocate(1) == [2]
    assert bm.peek_prefix(hashes_of(ta)) == 2
    assert bm.peek_prefix(hashes_of(tb)) == 2
    # re-using A's prefix moves it out of the queue: B's tail is evicted before it
    assert bm.match_prefix(hashes_of(ta)) == [0, 1]
    assert bm.allocate(1) == [4]
    assert bm.peek_prefix(hashes_of(tb)) == 1  # B's tail page is gone, its first page still hits
    assert bm.match_prefix(hashes_of(tb)) == [3]
    assert bm.num_free_pages == 0
    bm.free([0, 1])
    assert list(bm.free_queue) == [1, 0]
    bm.check_invariants()


def test_reset_prefix_cache_forgets_every_hash_but_not_references():
    bm = PagePool(6, PS)
    tokens = list(range(1, 13))
    a = bm.allocate(3)
    cache_all(bm, a, tokens)
    bm.free(a[2:])  # one cached page unreferenced, two still held
    assert bm.reset_prefix_cache() == 3
    assert bm.cached == {}
    assert bm.peek_prefix(hashes_of(tokens)) == 0
    assert bm.match_prefix(hashes_of(tokens)) == []
    assert [bm.ref_counts[b] for b in a] == [1, 1, 0]
    assert bm.num_free_pages == 4
    # the blocks can be cached again under the same hashes
    cache_all(bm, a[:2], tokens)
    assert bm.match_prefix(hashes_of(tokens)) == a[:2]
    bm.check_invariants()


def test_prefix_caching_disabled_never_hits():
    bm = PagePool(4, PS, enable_prefix_caching=False)
    tokens = list(range(1, 9))
    a = bm.allocate(2)
    cache_all(bm, a, tokens)
    assert bm.cached == {}
    assert bm.peek_prefix(hashes_of(tokens)) == 0
    assert bm.match_prefix(hashes_of(tokens)) == []
    bm.check_invariants()


# ------------------------------------------------------------------------------- random operations

# A shadow model: each live "sequence" holds a list of blocks and the tokens they contain; `content`
# records which full page (by chained hash) each block really holds. A prefix hit must only ever
# return blocks that hold exactly the requested pages, and allocate must never hand out a held block.

OPS = st.lists(
    st.tuples(
        st.sampled_from(["new", "free", "reset", "extend"]),
        st.integers(0, 3),  # which prefix family (shared leading pages)
        st.integers(1, 4),  # pages
        st.integers(0, 10**6),  # selector
    ),
    max_size=40,
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(num_blocks=st.integers(1, 12), ops=OPS)
def test_random_operations_keep_invariants(num_blocks, ops):
    bm = PagePool(num_blocks, PS)
    content: dict[int, int | None] = {}  # block -> hash of the page it holds
    live: list[tuple[list[int], list[int]]] = []  # (blocks, tokens)
    for op, family, pages, sel in ops:
        if op == "new":
            # family f shares its first f pages with every other prompt of family f
            tokens = [family] * (PS * min(family, pages)) + [sel % 97 + 100 + i for i in range(PS * pages)]
            tokens = tokens[: PS * pages]
            hashes = hashes_of(tokens)
            held_before = {b for blocks, _ in live for b in blocks}
            hits = bm.match_prefix(hashes)
            for p, b in enumerate(hits):
                assert content.get(b) == hashes[p], "prefix hit on a block holding other tokens"
            need = pages - len(hits)
            if need > bm.num_free_pages:
                bm.free(hits)  # NOTE: hits on unreferenced cached pages go back to the free queue
                if need > bm.num_free_pages:
                    with pytest.raises(MemoryError):
                        bm.allocate(need)
                continue
            fresh = bm.allocate(need)
            assert not set(fresh) & held_before, "allocate handed out a held block"
            assert not set(fresh) & set(hits)
            for p, b in enumerate(fresh, start=len(hits)):
                content[b] = hashes[p]  # "compute" the page
                bm.cache_page(b, hashes[p])
            live.append((hits + fresh, tokens))
        elif op == "free" and live:
            blocks, _ = live.pop(sel % len(live))
            bm.free(blocks)
        elif op == "extend" and live:
            blocks, tokens = live[sel % len(live)]
            if bm.num_free_pages:
                (b,) = bm.allocate(1)
                assert all(b not in other for other, _ in live)
                tokens += [sel % 89 + 300 + i for i in range(PS)]
                content[b] = hashes_of(tokens)[-1]
                bm.cache_page(b, content[b])
                blocks.append(b)
        elif op == "reset":
            bm.reset_prefix_cache()
            assert bm.cached == {}
        bm.check_invariants()
        held = [b for blocks, _ in live for b in blocks]
        for b in range(num_blocks):
            assert bm.ref_counts[b] == held.count(b)
        assert bm.num_free_pages == sum(1 for b in range(num_blocks) if b not in held)
    for blocks, _ in live:
        bm.free(blocks)
    assert bm.num_free_pages == num_blocks
    bm.check_invariants()
