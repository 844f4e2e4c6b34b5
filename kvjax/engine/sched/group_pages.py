"""Each request's pages in every KV layer group: one RequestPages per group, moved together.

kvjax/caches/groups.py (EngineConfig.kv_groups) keeps one page pool and block table per
group of layers that attend alike; an engine without groups has one.  The scheduler
(kvjax/engine/sched/scheduler.py) decides who runs; this module gives a request pages in
every group at once: it is admitted, given pages, preempted and released in all groups
together (a request short of pages in any group waits or preempts), while each group frees
the pages its own layers no longer read by its release rule
(kvjax/engine/sched/request_pages.py).  After a verify step (speculation) each group rolls
back the pages it reserved for rejected drafts and releases only what the window of the
accepted position no longer sees (`settle`), since the next step's queries start there.

The prefix cache, per group: every group caches the pages of its own layers in its own
PrefixCache, all under the one hash chain of a request's full blocks (so a LoRA adapter's
or tenant's salt separates them in every group alike).  A request resumes at a position L
(block aligned, at most its prompt length - 1) only where every group serves L: it caches
a page for each block [0, L) its layers still read from L on, i.e. all but
`page_release.dead_pages(L)`.  A global group reads every block, so it serves the longest
cached prefix as a one-pool lookup does; a sliding group of window W needs only the blocks
covering [L - W + 1, L), the ones its window sees at L, and not the early blocks it released
(they may be evicted: released ones reach its LRU first).  The hit is the largest L every
group serves (vLLM's hybrid KV-cache manager scans the same way); the blocks a group does
not read are the null page in its block table, as the ones it releases later.  Only whole
blocks are shared: prefix_match="token" with several groups is refused.
"""
from __future__ import annotations

from typing import Iterator, Optional, Sequence

import numpy as np

from kvjax.caches.layout import PageRelease
from kvjax.engine.requests import PageCopy, Request
from kvjax.engine.sched.pages import NULL_PAGE, BlockAllocator
from kvjax.engine.sched.prefix_cache import PrefixCache, PrefixHit
from kvjax.engine.sched.request_pages import RequestPages

__all__ = ["GroupPages"]


class GroupPages:
  """One RequestPages per KV layer group, each with its own prefix cache (if any).

  Args:
    pools: (num_pages, page_release) of each group's pool, group 0's first.
    page_size: tokens per page.
    max_pages_per_seq: block-table width.
    max_num_batched_tokens: what one row may write (bounds a sliding group's pages).
    prefix_cache: PrefixCache of an allocator (each group's), or None for no prefix cache.
  """

  def __init__(self, pools: Sequence[tuple[int, PageRelease]], page_size: int,
               max_pages_per_seq: int, max_num_batched_tokens: int, prefix_cache=None):
    self.groups: list[RequestPages] = []
    for group, (num_pages, release) in enumerate(pools):
      allocator = BlockAllocator(num_pages)
      cache = prefix_cache(allocator) if prefix_cache else None
      self.groups.append(RequestPages(allocator, cache, page_size, release,
                                      max_pages_per_seq, max_num_batched_tokens, group))

  def __len__(self) -> int:
    return len(self.groups)

  def __iter__(self) -> Iterator[RequestPages]:
    return iter(self.groups)

  def __getitem__(self, group: int) -> RequestPages:
    return self.groups[group]

  def add(self, req: Request) -> None:
    """Gives a new request an empty table in every group but 0 (whose table is `pages`)."""
    req.group_pages = [[] for _ in self.groups[1:]]

  def check_fits(self, label: str, num_tokens: int) -> None:
    """ValueError (naming `label`) unless a request of `num_tokens` fits every group."""
    for group in self.groups:
      group.check_fits(label, num_tokens)

  @property
  def prefix_caches(self) -> list[PrefixCache]:
    """Every group's prefix cache, group 0's first (none without a prefix cache)."""
    return [group.prefix_cache for group in self.groups if group.prefix_cache]

  def lookup(self, req: Request) -> tuple[PrefixHit, ...]:
    """Each group's part of `req`'s prefix hit (none if it takes no hits), all of the same
    num_tokens (module doc); nothing is held until `admit`."""
    if not self.prefix_caches or not req.takes_prefix_hits:
      return (PrefixHit(num_queried=req.num_tokens),) * len(self.groups)
    return self.hits(req.token_ids, req.cache_salt)

  def hits(self, token_ids: Sequence[int], cache_salt: Optional[str] = None
           ) -> tuple[PrefixHit, ...]:
    """Each group's part of the prefix hit a prompt of `token_ids` would take now (the
    engine's prefix cache must exist)."""
    caches = self.prefix_caches
    if len(caches) == 1:
      return (caches[0].lookup(token_ids, cache_salt),)
    return self._hit_every_group_serves(token_ids, cache_salt)

  def _hit_every_group_serves(self, token_ids: Sequence[int], cache_salt: Optional[str]
                              ) -> tuple[PrefixHit, ...]:
    """The largest block-aligned hit every group serves (module doc), or none."""
    size = self.groups[0].page_size
    hashes = self.prefix_caches[0].block_hashes(token_ids, (len(token_ids) - 1) // size,
                                                cache_salt)
    pages = [[group.prefix_cache.page_of(h) for h in hashes] for group in self.groups]
    # missing_before[g][i]: how many of blocks 0 .. i - 1 group g does not cache.
    missing_before = [np.cumsum([0] + [page is None for page in group_pages])
                      for group_pages in pages]
    least = max(self.prefix_caches[0].min_cacheable_tokens, 1)
    for num_blocks in range(len(hashes), 0, -1):
      if num_blocks * size < least:
        break
      # Served: every block group g misses is one its layers no longer read at the hit.
      if all(missing[num_blocks] == _num_missing(missing, group.page_release.dead_pages(
          num_blocks * size)) for group, missing in zip(self.groups, missing_before)):
        return tuple(PrefixHit(num_blocks * size,
                               tuple(NULL_PAGE if page is None else page
                                     for page in group_pages[:num_blocks]),
                               tuple(hashes[:num_blocks]), num_queried=len(token_ids))
                     for group_pages in pages)
    return (PrefixHit(num_queried=len(token_ids)),) * len(self.groups)

  def without_copy(self, hits: tuple[PrefixHit, ...]) -> tuple[PrefixHit, ...]:
    """The hits' full blocks only (a token-mode copy source that cannot be pinned)."""
    return tuple(group.prefix_cache.without_copy(hit) for group, hit in zip(self.groups, hits))

  def admission(self, hits: tuple[PrefixHit, ...], num_tokens: int) -> Optional[list]:
    """(new pages, dead hit pages) of each group for its hit plus `num_tokens` to prefill,
    if every group can allocate them now, else None."""
    fits = [group.admission(hit, num_tokens) for group, hit in zip(self.groups, hits)]
    return None if None in fits else fits

  def admit(self, req: Request, hits: tuple[PrefixHit, ...], fits: list, pins: list[int],
            copies: list[PageCopy]) -> None:
    """Gives a newly admitted `req` its hit's and new pages in every group (`fits`:
    `admission`'s)."""
    for group, hit, (need, dead) in zip(self.groups, hits, fits):
      group.admit(req, hit, need, dead, pins, copies)

  def need(self, req: Request, num_slots: int) -> tuple[int, ...]:
    """New pages `req` needs in each group to hold positions up to `num_slots`."""
    return tuple(group.need(req, num_slots) for group in self.groups)

  def can_allocate(self, needs: Sequence[tuple[int, ...]]) -> bool:
    """Whether every group has the pages of all `needs` (each `need`'s) free now."""
    return all(group.allocator.can_allocate(sum(need[group.group] for need in needs))
               for group in self.groups)

  def give(self, req: Request, need: tuple[int, ...]) -> None:
    """`need` (`need`'s) new pages at the end of `req`'s table in each group."""
    for group, n in zip(self.groups, need):
      group.give(req, n)

  def settle(self, req: Request) -> None:
    """After a step of a still-running `req`: each group's rollback and release."""
    for group in self.groups:
      group.settle(req)

  def release(self, req: Request) -> None:
    """Frees every page of `req` in every group."""
    for group in self.groups:
      group.release(req)

  def discard_own(self, req: Request) -> tuple[list[int], ...]:
    """The pages only `req` holds in each group, out of the prefix cache."""
    return tuple(group.discard_own(req) for group in self.groups)

  def cache_blocks(self, req: Request) -> None:
    """Offers `req`'s newly computed full blocks to every group's prefix cache."""
    caches = self.prefix_caches
    num_full = req.num_computed_tokens // self.groups[0].page_size
    if not caches or num_full <= req.num_cached_blocks:
      return
    req.block_hashes = caches[0].block_hashes(req.token_ids, num_full, req.cache_salt,
                                              known=req.block_hashes)
    for group in self.groups:
      group.cache_blocks(req, num_full)
    req.num_cached_blocks = num_full

  def block_tables(self, reqs: list[Request]) -> tuple[np.ndarray, tuple[np.ndarray, ...]]:
    """(group 0's block tables, every group's when there is more than one group, else ())
    of `reqs`' rows."""
    tables = tuple(group.block_tables(reqs) for group in self.groups)
    return tables[0], tables if len(tables) > 1 else ()

  def check_invariants(self, running: list[Request]) -> None:
    """AssertionError unless every group's pages are consistent with `running`'s."""
    for group in self.groups:
      group.check_invariants(running)


def _num_missing(missing_before: np.ndarray, blocks: Sequence[int]) -> int:
  """How many of `blocks` are missing (missing_before: cumulative counts, as above)."""
  if isinstance(blocks, range):  # a window's dead pages: counted in O(1)
    return missing_before[blocks.stop] - missing_before[blocks.start]
  return sum(missing_before[i + 1] - missing_before[i] for i in blocks)
