"""BlockAllocator: null page, all-or-nothing allocation, refcounts, LRU reclaim."""
import pytest

from kvjax.engine.sched.pages import NULL_PAGE, BlockAllocator, OutOfPagesError


def _state(a: BlockAllocator):
  return (list(a._free), list(a._evictable), list(a._refcount), list(a._cached))


def test_null_page_is_never_handed_out():
  a = BlockAllocator(5)
  assert a.num_usable == 4
  assert sorted(a.allocate(4)) == [1, 2, 3, 4]
  assert NULL_PAGE not in a.allocate(0)
  with pytest.raises(ValueError, match="not a usable page"):
    a.incref([NULL_PAGE])
  a.check_invariants()


@pytest.mark.parametrize("num_pages", [0, 1, 2.5])
def test_rejects_pools_without_a_usable_page(num_pages):
  with pytest.raises(ValueError, match="num_pages"):
    BlockAllocator(num_pages)


# name: (pool size, allocations before, request, should succeed)
ALLOCATION_SCENARIOS = {
    "exact_fit": (5, [2], 2, True),
    "one_too_many": (5, [2], 3, False),
    "empty_pool": (5, [4], 1, False),
    "zero_pages": (5, [4], 0, True),
    "whole_pool": (9, [], 8, True),
}


@pytest.mark.parametrize("name", ALLOCATION_SCENARIOS)
def test_allocation_is_all_or_nothing(name):
  num_pages, before, n, ok = ALLOCATION_SCENARIOS[name]
  a = BlockAllocator(num_pages)
  for k in before:
    a.allocate(k)
  snapshot = _state(a)
  if ok:
    assert len(a.allocate(n)) == n
  else:
    free = a.num_free
    with pytest.raises(OutOfPagesError) as err:
      a.allocate(n)
    assert isinstance(err.value, RuntimeError)
    assert f"cannot allocate {n} KV pages: only {free} free" in str(err.value)
    assert (err.value.requested, err.value.available) == (n, free)
    assert _state(a) == snapshot
  a.check_invariants()


def test_fifo_order_and_stats():
  a = BlockAllocator(5)
  assert a.allocate(2) == [1, 2]
  assert (a.num_free, a.num_used, a.utilization) == (2, 2, 0.5)
  a.decref([2, 1])
  assert a.allocate(4) == [3, 4, 2, 1]  # freed pages go to the back
  assert a.utilization == 1.0
  a.check_invariants()


def test_refcounts_and_bad_releases():
  a = BlockAllocator(4)
  [p] = a.allocate(1)
  a.incref([p])
  assert a.refcount(p) == 2
  a.decref([p])
  assert a.num_used == 1
  snapshot = _state(a)
  with pytest.raises(ValueError, match="released 2 times but has refcount 1"):
    a.decref([p, p])
  assert _state(a) == snapshot
  a.free([p])
  assert a.num_used == 0
  with pytest.raises(ValueError, match="is free"):
    a.incref([p])
  with pytest.raises(ValueError, match="negative"):
    a.allocate(-1)
  a.check_invariants()


def test_cached_pages_are_reclaimed_last_in_lru_order():
  a = BlockAllocator(6)
  evicted = []
  a.set_evict_hook(evicted.append)
  pages = a.allocate(3)  # [1, 2, 3]
  for p in pages:
    a.mark_cached(p)
  a.decref([3, 2, 1])  # deepest first: 3 is least recently released
  assert (a.num_free, a.num_evictable, a.num_used) == (5, 3, 0)
  assert a.allocate(2) == [4, 5]  # plain free pages before cached ones
  assert evicted == []
  assert a.allocate(2) == [3, 2]
  assert evicted == [3, 2]
  assert not a.is_cached(3) and a.is_cached(1)
  a.check_invariants()


def test_incref_revives_an_evictable_page():
  a = BlockAllocator(3)
  [p, q] = a.allocate(2)
  a.mark_cached(p)
  a.decref([p, q])
  assert a.can_allocate(2) and not a.can_allocate(2, pinning=[p])
  a.incref([p])  # a prefix hit takes it out of the LRU
  assert a.refcount(p) == 1 and a.num_evictable == 0
  assert a.allocate(1) == [q]
  with pytest.raises(OutOfPagesError):
    a.allocate(1)
  a.check_invariants()


def test_uncache_and_mark_cached_rules():
  a = BlockAllocator(3)
  [p] = a.allocate(1)
  a.mark_cached(p)
  a.decref([p])
  with pytest.raises(ValueError, match="only a held page"):
    a.mark_cached(2)
  a.uncache(p)
  assert a.num_evictable == 0 and a.num_free == 2
  a.check_invariants()
