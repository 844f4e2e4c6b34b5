"""Host-side page pool: which physical KV pages are free, used, or cached.

Host code only hands out page ids; the device writes K/V into them.  Page 0 is
a reserved null page: it is never handed out, so padded rows and padded
block-table entries can point at it and write nowhere harmful.

Every usable page is in exactly one of three states:
  used       refcount >= 1 (held by one or more requests, or pinned);
  free       refcount 0, content meaningless;
  evictable  refcount 0, but a prefix-cache entry still points at its content.
Free and evictable pages both count as available: `allocate` takes free pages
first and only then reclaims evictable ones, least recently released first
(vLLM's free-block queue, split in two so a cached page is never reused while a
meaningless one is still around).  Releasing a request's pages deepest-first
therefore evicts tail blocks before the prefixes they hang off.

The prefix cache lives in kvjax/engine/sched/prefix_cache.py (one concept per file); it
marks pages cached here and is told through the evict hook when a page is
reclaimed, so the cache never points at reused memory.
"""
from __future__ import annotations

import collections
from typing import Callable, Iterable, Optional

__all__ = ["NULL_PAGE", "OutOfPagesError", "BlockAllocator"]

NULL_PAGE = 0


class OutOfPagesError(RuntimeError):
  """Raised when an allocation asks for more pages than are available."""

  def __init__(self, requested: int, available: int):
    super().__init__(
        f"cannot allocate {requested} KV pages: only {available} free "
        "(including evictable cached pages)")
    self.requested = requested
    self.available = available


class BlockAllocator:
  """Free list, refcounts and the LRU of evictable cached pages.

  Args:
    num_pages: total pages in the device pool, including the null page 0.
  """

  def __init__(self, num_pages: int):
    if not isinstance(num_pages, int) or num_pages < 2:
      raise ValueError(f"num_pages must be an int >= 2 (page 0 is the null "
                       f"page), got {num_pages!r}")
    self.num_pages = num_pages
    self._refcount = [0] * num_pages
    self._cached = [False] * num_pages
    self._free = collections.deque(range(1, num_pages))
    # Evictable cached pages, least recently released first.
    self._evictable: collections.OrderedDict[int, None] = (
        collections.OrderedDict())
    self._evict_hook: Optional[Callable[[int], None]] = None

  # -- stats ------------------------------------------------------------------

  @property
  def num_usable(self) -> int:
    """Pages that can ever be handed out (all but the null page)."""
    return self.num_pages - 1

  @property
  def num_free(self) -> int:
    """Pages `allocate` can hand out now: free plus evictable cached pages."""
    return len(self._free) + len(self._evictable)

  @property
  def num_evictable(self) -> int:
    """Cached pages nobody holds; reclaimed only when free pages run out."""
    return len(self._evictable)

  @property
  def num_used(self) -> int:
    """Pages with refcount >= 1."""
    return self.num_usable - self.num_free

  @property
  def utilization(self) -> float:
    """Fraction of usable pages held by requests (the KV utilization metric)."""
    return self.num_used / self.num_usable

  def refcount(self, page: int) -> int:
    return self._refcount[page]

  def is_cached(self, page: int) -> bool:
    return self._cached[page]

  # -- allocation -------------------------------------------------------------

  def can_allocate(self, n: int, pinning: Iterable[int] = ()) -> bool:
    """Whether `n` fresh pages fit after `incref(pinning)` takes its pages.

    Pinning an evictable page removes it from the available pool, so a prefix
    hit costs pages too until it is pinned.
    """
    taken = {p for p in pinning if self._refcount[p] == 0}
    return n <= self.num_free - len(taken)

  def allocate(self, n: int) -> list[int]:
    """Hands out `n` pages with refcount 1; all or nothing.

    Raises:
      OutOfPagesError: fewer than `n` pages are available; state is unchanged.
    """
    if n < 0:
      raise ValueError(f"cannot allocate a negative number of pages: {n}")
    if n > self.num_free:
      raise OutOfPagesError(n, self.num_free)
    pages = []
    for _ in range(n):
      if self._free:
        page = self._free.popleft()
      else:
        page, _ = self._evictable.popitem(last=False)
        self._cached[page] = False
        if self._evict_hook is not None:
          self._evict_hook(page)
      self._refcount[page] = 1
      pages.append(page)
    return pages

  def incref(self, pages: Iterable[int]) -> None:
    """Adds a holder to used or evictable pages (a prefix hit, or a pin)."""
    pages = list(pages)
    for page in pages:
      self._check_page(page)
      if self._refcount[page] == 0 and not self._cached[page]:
        raise ValueError(f"page {page} is free; allocate it instead of incref")
    for page in pages:
      if self._refcount[page] == 0:
        del self._evictable[page]
      self._refcount[page] += 1

  def decref(self, pages: Iterable[int]) -> None:
    """Drops a holder; a page nobody holds becomes free or evictable.

    Pages reach the LRU in the order given: pass a request's pages
    deepest-first so its tail blocks are evicted before its prefix.
    """
    pages = list(pages)
    for page in pages:
      self._check_page(page)
    drops = collections.Counter(pages)
    for page, count in drops.items():
      if self._refcount[page] < count:
        raise ValueError(f"page {page} released {count} times but has "
                         f"refcount {self._refcount[page]}")
    for page in pages:
      self._refcount[page] -= 1
      if self._refcount[page] == 0:
        if self._cached[page]:
          self._evictable[page] = None
        else:
          self._free.append(page)

  free = decref

  # -- prefix-cache hooks -----------------------------------------------------

  def set_evict_hook(self, hook: Callable[[int], None]) -> None:
    """`hook(page)` runs when an evictable page is reclaimed by `allocate`."""
    self._evict_hook = hook

  def mark_cached(self, page: int) -> None:
    """Keeps a held page's content reclaimable-but-reusable once released."""
    self._check_page(page)
    if self._refcount[page] == 0:
      raise ValueError(f"only a held page can be cached; page {page} is free")
    self._cached[page] = True

  def uncache(self, page: int) -> None:
    """Forgets that a page is cached; an evictable one becomes plain free."""
    self._check_page(page)
    if self._cached[page] and self._refcount[page] == 0:
      del self._evictable[page]
      self._free.append(page)
    self._cached[page] = False

  # -- checks -----------------------------------------------------------------

  def check_invariants(self) -> None:
    """Raises AssertionError unless every page is in exactly one state."""
    free, evictable = set(self._free), set(self._evictable)
    assert len(free) == len(self._free), "duplicate page in free list"
    assert not free & evictable, f"free and evictable: {free & evictable}"
    assert NULL_PAGE not in free | evictable, "null page handed out"
    assert self._refcount[NULL_PAGE] == 0 and not self._cached[NULL_PAGE]
    used = 0
    for page in range(1, self.num_pages):
      rc = self._refcount[page]
      assert rc >= 0, f"page {page} has refcount {rc}"
      if rc:
        used += 1
        assert page not in free | evictable, f"held page {page} is available"
      elif self._cached[page]:
        assert page in evictable, f"cached page {page} with refcount 0 is lost"
      else:
        assert page in free, f"page {page} leaked: refcount 0, not free"
    assert all(self._cached[p] for p in evictable), "uncached page in LRU"
    assert len(free) + len(evictable) + used == self.num_usable, (
        f"free {len(free)} + evictable {len(evictable)} + used {used} != "
        f"usable {self.num_usable}")

  def _check_page(self, page: int) -> None:
    if not 1 <= page < self.num_pages:
      raise ValueError(f"page {page} is not a usable page id "
                       f"(1..{self.num_pages - 1})")
