"""Edges of `rollout/kv/page_pool.py` that mutmut found untested (tests/README.md): the size checks and
their messages, the errors' messages, `num_unreferenced`, and `check_invariants` itself catching a
corrupted hash map."""

from __future__ import annotations

import pytest

from rollout.kv.page_pool import PagePool, page_hashes

PS = 4


@pytest.mark.parametrize("num_pages, page_size", [(0, 4), (4, 0), (-1, -1)])
def test_sizes_must_be_positive(num_pages, page_size):
    with pytest.raises(ValueError, match="^num_pages and page_size must be positive$"):
        PagePool(num_pages, page_size)


def test_a_page_of_one_token_is_valid():
    pool = PagePool(3, 1)
    assert pool.allocate(3) == [0, 1, 2] and pool.pages_needed(5) == 5


def test_errors_say_what_went_wrong():
    pool = PagePool(2, PS)
    with pytest.raises(MemoryError, match="^need 3 pages, only 2 free$"):
        pool.allocate(3)
    pages = pool.allocate(1)
    pool.free(pages)
    with pytest.raises(RuntimeError, match=f"^page {pages[0]} freed more often than allocated$"):
        pool.free(pages)


def test_num_unreferenced_counts_the_cached_pages_nobody_holds():
    pool = PagePool(8, PS)
    tokens = list(range(1, 13))  # 3 full pages
    hashes = page_hashes(tokens, PS, 3)
    pages = pool.allocate(3)
    for page, h in zip(pages, hashes, strict=True):
        pool.cache_page(page, h)
    assert pool.num_unreferenced(hashes) == 0  # all held
    pool.free(pages[1:])
    assert pool.num_unreferenced(hashes) == 2
    pool.free(pages[:1])
    assert pool.num_unreferenced(hashes) == 3
    assert pool.match_prefix(hashes[:2]) == pages[:2]
    assert pool.num_unreferenced(hashes) == 1


def test_check_invariants_catches_a_hash_missing_from_the_cache_map():
    pool = PagePool(4, PS)
    h = page_hashes([1, 2, 3, 4], PS, 1)[0]
    page = pool.allocate(1)[0]
    pool.cache_page(page, h)
    pool.check_invariants()
    del pool.cached[h]
    with pytest.raises(AssertionError, match=f"page {page} hash not in cache map"):
        pool.check_invariants()
