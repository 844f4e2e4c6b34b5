"""Each request's pages in every KV layer group: one RequestPages per group, moved together.

kvjax/caches/groups.py (EngineConfig.kv_groups) keeps one page pool and block table per
group of layers that attend alike; an engine without groups has one.  The scheduler
(kvjax/engine/sched/scheduler.py) decides who runs; this module gives a request pages in
every group at once: it is admitted, given pages, preempted and released in all groups
together (a request short of pages in any group waits or preempts), while each group frees
the pages its own layers no longer read by its release rule
(kvjax/engine/sched/request_pages.py).  Group 0's pool is the one the prefix cache shares.
"""
from __future__ import annotations

from typing import Iterator, Optional, Sequence

import numpy as np

from kvjax.caches.layout import PageRelease
from kvjax.engine.requests import PageCopy, Request
from kvjax.engine.sched.pages import BlockAllocator
from kvjax.engine.sched.prefix_cache import PrefixCache, PrefixHit
from kvjax.engine.sched.request_pages import RequestPages

__all__ = ["GroupPages"]


class GroupPages:
  """One RequestPages per KV layer group, group 0's with the prefix cache.

  Args:
    pools: (num_pages, page_release) of each group's pool, group 0's first.
    page_size: tokens per page.
    max_pages_per_seq: block-table width.
    max_num_batched_tokens: what one row may write (bounds a sliding group's pages).
    prefix_cache: PrefixCache of an allocator (group 0's), or None for no prefix cache.
  """

  def __init__(self, pools: Sequence[tuple[int, PageRelease]], page_size: int,
               max_pages_per_seq: int, max_num_batched_tokens: int, prefix_cache=None):
    self.groups: list[RequestPages] = []
    for group, (num_pages, release) in enumerate(pools):
      allocator = BlockAllocator(num_pages)
      cache = prefix_cache(allocator) if prefix_cache and group == 0 else None
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

  def admission(self, hit: PrefixHit, num_tokens: int) -> Optional[list]:
    """(new pages, dead hit pages) of each group for `hit` plus `num_tokens` to prefill, if
    every group can allocate them now, else None."""
    fits = [group.admission(hit if group.group == 0 else PrefixHit(), num_tokens)
            for group in self.groups]
    return None if None in fits else fits

  def admit(self, req: Request, hit: PrefixHit, fits: list, pins: list[int],
            copies: list[PageCopy]) -> None:
    """Gives a newly admitted `req` its pages in every group (`fits`: `admission`'s)."""
    for group, (need, dead) in zip(self.groups, fits):
      group.admit(req, hit if group.group == 0 else PrefixHit(), need, dead, pins, copies)

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
    """Offers `req`'s newly computed full blocks to the prefix cache."""
    self.groups[0].cache_blocks(req)

  def block_tables(self, reqs: list[Request]) -> tuple[np.ndarray, tuple[np.ndarray, ...]]:
    """(group 0's block tables, every group's when there is more than one group, else ())
    of `reqs`' rows."""
    tables = tuple(group.block_tables(reqs) for group in self.groups)
    return tables[0], tables if len(tables) > 1 else ()

  def check_invariants(self, running: list[Request]) -> None:
    """AssertionError unless every group's pages are consistent with `running`'s."""
    for group in self.groups:
      group.check_invariants(running)

  @property
  def prefix_cache(self) -> Optional[PrefixCache]:
    return self.groups[0].prefix_cache
