"""The KV pages each request holds: allocation, prefix-cache hits and blocks, windows.

kvjax/engine/sched/scheduler.py decides who runs; this module keeps the pages of those who do.
Pages are allocated for exactly the positions a row writes, and a request's
`pages` is its block table (entry i: tokens [i * G, (i + 1) * G)).

Sliding windows (`sliding_window` W: no layer, MTP module or draft model looks
further back): a query at position p sees keys j > p - W, and every query of a
request from now on sits at or after its `num_computed_tokens` s, so keys
j <= s - W are dead and so are its first (s - W + 1) // G pages.  They return
to the allocator (a cached one stays cached, evictable) and their block-table
entries become the null page, which attention masks as outside the window.  A
row of n positions starting at s then holds pages (s - W + 1) // G through
(s + n - 1) // G: at most ceil((W + n - 2) / G) + 1, however long the request
(`max_pages_held`).  Prefix hits acquire only the live part of their chain;
released blocks reach the LRU before the request's live ones and are evicted
first, and a lookup stops at its first missing block, so no hit has holes.
Which pages are dead is the KV layout's host-side manager (`page_release`, a
kvjax/caches/layout.py PageRelease; the window rule above by default): a layout
may keep some early pages (attention sinks) and release a range after them.

Blocks are cached only once their KV is computed, so a hit never reads KV that
the same step is still writing.

KV layer groups (kvjax/caches/groups.py, EngineConfig.kv_groups): the scheduler keeps one
RequestPages per group, each over its own allocator and with its group's release rule;
`group` says which of the request's tables it keeps (0: `pages`, g: `group_pages[g - 1]`),
so a sliding group frees the pages behind its window while a global group keeps them.
Each group has its own prefix cache; there a hit may lack the blocks a group no longer
reads (null entries, like released ones; kvjax/engine/sched/group_pages.py).
"""
from __future__ import annotations

import collections
from typing import Optional

import numpy as np

from kvjax.caches.layout import PageRelease
from kvjax.engine.requests import PageCopy, Request
from kvjax.engine.sched.pages import NULL_PAGE, BlockAllocator
from kvjax.engine.sched.prefix_cache import PrefixCache, PrefixHit, root_hash

__all__ = ["RequestPages"]


class RequestPages:
  """Pages of running requests over one BlockAllocator and an optional PrefixCache."""

  def __init__(self, allocator: BlockAllocator, prefix_cache: Optional[PrefixCache],
               page_size: int, page_release: PageRelease, max_pages_per_seq: int,
               max_num_batched_tokens: int, group: int = 0):
    self.group = group  # the KV layer group whose pages these are (kvjax/caches/groups.py)
    self.allocator = allocator
    self.prefix_cache = prefix_cache
    self.page_size = page_size
    self.page_release = page_release
    self.max_pages_per_seq = max_pages_per_seq
    self.max_num_batched_tokens = max_num_batched_tokens  # what one row may write

  def table(self, req: Request) -> list[int]:
    """`req`'s block table in this group's pool."""
    return req.pages if self.group == 0 else req.group_pages[self.group - 1]

  def _set_table(self, req: Request, pages: list[int]) -> None:
    if self.group == 0:
      req.pages = pages
    else:
      req.group_pages[self.group - 1] = pages

  def pages_for(self, num_tokens: int) -> int:
    return -(-num_tokens // self.page_size)

  def max_pages_held(self, num_tokens: int) -> int:
    """Most pages a request of `num_tokens` (prompt + max_new_tokens) holds at once."""
    return self.page_release.max_pages_held(num_tokens, self.max_num_batched_tokens)

  def check_fits(self, label: str, num_tokens: int) -> None:
    """ValueError (naming `label`) unless a request of `num_tokens` fits the pool and the
    block tables."""
    pages, usable = self.max_pages_held(num_tokens), self.allocator.num_usable
    if pages > usable:
      raise ValueError(f"{label} needs up to {pages} KV pages but the pool has {usable}")
    width = self.pages_for(num_tokens - 1)
    if width > self.max_pages_per_seq:
      raise ValueError(f"{label} spans {width} pages but block tables hold "
                       f"{self.max_pages_per_seq}; set max_model_len")

  def admission(self, hit: PrefixHit, num_tokens: int) -> Optional[tuple[int, range]]:
    """(new pages, dead hit pages) for a hit plus `num_tokens` to prefill, if they can be
    allocated now (the hit's live pages and copy source pinned), else None."""
    need = self.pages_for(hit.num_tokens + num_tokens) - len(hit.pages)
    dead = self.page_release.dead_pages(hit.num_tokens)  # within hit.pages
    pin = tuple(p for i, p in enumerate(hit.pages) if i not in dead) + (
        (hit.copy_src,) if hit.copy_tokens else ())
    if not self.allocator.can_allocate(need, pinning=pin):
      return None
    return need, dead

  def admit(self, req: Request, hit: PrefixHit, need: int, dead: range,
            pins: list[int], copies: list[PageCopy]) -> None:
    """Gives a newly admitted `req` its hit's live pages and `need` new ones; a token-mode
    hit's partial page becomes a copy (its source pinned, in `pins`, until the step)."""
    if self.prefix_cache:
      self.prefix_cache.acquire(hit, dead=dead)
    if hit.copy_tokens:
      self.allocator.incref([hit.copy_src])
      pins.append(hit.copy_src)
    new_pages = self.allocator.allocate(need)
    if hit.copy_tokens:
      copies.append(PageCopy(hit.copy_src, new_pages[0], hit.copy_tokens))
    self._set_table(req, [NULL_PAGE if i in dead else p for i, p in enumerate(hit.pages)]
                    + new_pages)
    req.num_computed_tokens = req.num_cached_tokens = hit.num_tokens
    req.block_hashes = list(hit.block_hashes)
    req.num_cached_blocks = len(hit.pages)

  def settle(self, req: Request) -> None:
    """After a step of a still-running `req`: roll back pages reserved for rejected drafts
    (or a burst's unused steps), release the pages behind its window."""
    keep, pages = self.pages_for(req.num_tokens), self.table(req)
    if len(pages) > keep:
      self.allocator.decref(reversed(pages[keep:]))
      del pages[keep:]
    dead = self.page_release.dead_pages(req.num_computed_tokens)
    self.allocator.decref(pages[i] for i in reversed(dead) if pages[i] != NULL_PAGE)
    for i in dead:
      pages[i] = NULL_PAGE

  def need(self, req: Request, num_slots: int) -> int:
    """New pages `req` needs to hold positions up to `num_slots`."""
    return max(0, self.pages_for(num_slots) - len(self.table(req)))

  def give(self, req: Request, need: int) -> None:
    """`need` new pages at the end of `req`'s table (the allocator has them)."""
    self.table(req).extend(self.allocator.allocate(need))

  def block_tables(self, reqs: list[Request]) -> np.ndarray:
    """[rows, max_pages_per_seq] int32: each request's pages, null-padded."""
    tables = np.full((len(reqs), self.max_pages_per_seq), NULL_PAGE, np.int32)
    for i, req in enumerate(reqs):
      pages = self.table(req)
      tables[i, :len(pages)] = pages
    return tables

  def discard_own(self, req: Request) -> list[int]:
    """The pages only `req` holds (what it wrote), out of the prefix cache -> those pages."""
    pages = [p for p in self.table(req) if p != NULL_PAGE and self.allocator.refcount(p) == 1]
    if self.prefix_cache:
      self.prefix_cache.discard(pages)
    return pages

  def release(self, req: Request) -> None:
    """Frees every page of `req`."""
    # Deepest first, so the LRU evicts tail blocks before their prefixes.
    self.allocator.decref(p for p in reversed(self.table(req)) if p != NULL_PAGE)
    self._set_table(req, [])

  def cache_blocks(self, req: Request, num_full: int) -> None:
    """Offers `req`'s blocks num_cached_blocks .. num_full - 1 (computed, their hashes in
    `block_hashes`) to the prefix cache; the caller then counts them cached."""
    g = self.page_size
    for i in range(req.num_cached_blocks, num_full):
      parent = req.block_hashes[i - 1] if i else root_hash(req.cache_salt)
      self.prefix_cache.insert(req.block_hashes[i], parent,
                               req.token_ids[i * g:(i + 1) * g], self.table(req)[i])

  def check_invariants(self, running: list[Request]) -> None:
    """AssertionError unless the pool's refcounts are the pages `running` holds, each
    holding pages for what it computed, no dead page and no lost live one."""
    self.allocator.check_invariants()
    if self.prefix_cache:
      self.prefix_cache.check_invariants()
    held = collections.Counter(p for r in running for p in self.table(r))
    pages = range(1, self.allocator.num_pages)
    assert [self.allocator.refcount(p) for p in pages] == [
        held[p] for p in pages], f"group {self.group}: refcounts differ from the pages held"
    for r in running:
      table = self.table(r)
      assert self.pages_for(r.num_computed_tokens) <= len(table)
      assert len(table) <= self.max_pages_per_seq
      dead = self.page_release.dead_pages(r.num_computed_tokens)
      assert {p for i, p in enumerate(table) if i in dead} <= {NULL_PAGE}, \
          f"{r.request_id} holds a dead page in group {self.group}"
      assert NULL_PAGE not in [p for i, p in enumerate(table) if i not in dead], \
          f"{r.request_id} lost a live page in group {self.group}"
