"""Prefix cache (claim C8): requests sharing a prompt prefix share KV pages.

A block of `page_size` tokens is named by a hash chain:
  hash_i = sha256(hash_{i-1}, tokens of block i, extra keys)
with hash_{-1} a root derived from the request's `cache_salt`, and the salt also
in every block's extra keys, so differently-salted tenants never share a block.
Only FULL blocks are hashed and shared, so by default (prefix_match="block") a
30-token prompt at page_size 64 hits nothing, while at page_size 16 it shares
one block.  The prefix must be token-identical: one changed token in block i breaks
every hit from block i on.

prefix_match="token" (beyond vLLM) also reuses a partial block: after the full
blocks match, the cached child block sharing the longest run of leading tokens
with the rest of the prompt is returned as (src_page, num_tokens); the engine
copies that page into a fresh one and prefill resumes mid-block.  So a shared
30-token prefix at page_size 16 hits all 30 tokens.

A lookup never covers the prompt's last token: the engine must compute at least
one position to get logits, so at most len(prompt) - 1 tokens hit.

A boundary check (`set_boundary_check`) lets a hit end only at blocks it
accepts, and then never mid-block: a hybrid model resumes only where a
recurrent-state snapshot exists (kvjax/engine/sched/state_snapshots.py, which also learns
of every forgotten block through `set_forget_hook`).

Pages are owned by BlockAllocator; a cached page nobody holds stays evictable
until allocation needs it (LRU, tail blocks first), and the allocator's evict
hook tells this cache to forget it.

`add_block_listener(stored, removed)` hears of every block as it is cached
(hash, parent hash, its tokens) and forgotten (hash): kvjax/engine/kv_events.py
publishes them as vLLM's KV events.
"""
from __future__ import annotations

import dataclasses
import hashlib
from typing import Callable, Hashable, Optional, Sequence

import numpy as np

from kvjax.engine.sched.pages import BlockAllocator

__all__ = ["PrefixHit", "PrefixCache", "hash_block", "root_hash"]

PREFIX_MATCH_MODES = ("block", "token")


def root_hash(cache_salt: Optional[str] = None) -> bytes:
  """Parent hash of a request's first block; the salt separates tenants."""
  return hashlib.sha256(repr(("kvjax-root", cache_salt)).encode()).digest()


def hash_block(parent: bytes, token_ids: Sequence[int],
               extra_keys: tuple[Hashable, ...] = ()) -> bytes:
  """sha256 over (parent hash, block token ids, extra keys)."""
  h = hashlib.sha256(parent)
  h.update(np.asarray(token_ids, dtype=np.int64).tobytes())
  h.update(repr(extra_keys).encode())
  return h.digest()


@dataclasses.dataclass(frozen=True)
class PrefixHit:
  """Result of a lookup; nothing is held until `PrefixCache.acquire`.

  Attributes:
    num_tokens: tokens whose KV is reused; prefill starts at this position.
    pages: page ids of the matched full blocks, in order.
    block_hashes: their hashes (the request's first len(pages) block hashes).
    copy_src: in token mode, a cached page whose first `copy_tokens` tokens
      continue the prefix; the engine copies it into the request's next page.
    copy_tokens: tokens reused from `copy_src` (0 if none).
    num_queried: prompt tokens the lookup was asked about (hit-rate metric).
  """

  num_tokens: int = 0
  pages: tuple[int, ...] = ()
  block_hashes: tuple[bytes, ...] = ()
  copy_src: Optional[int] = None
  copy_tokens: int = 0
  num_queried: int = 0


class PrefixCache:
  """Maps block hashes to cached pages of one BlockAllocator.

  Args:
    allocator: the page pool; the cache installs its evict hook on it.
    page_size: tokens per page (block).
    prefix_match: "block" shares full blocks only (vLLM, claim C8); "token"
      also reuses a partial block by page copy.
    min_cacheable_tokens: hits shorter than this are discarded (systems that
      only cache long prompts).
  """

  def __init__(self, allocator: BlockAllocator, page_size: int, *,
               prefix_match: str = "block", min_cacheable_tokens: int = 0):
    if page_size < 1:
      raise ValueError(f"page_size must be >= 1, got {page_size}")
    if prefix_match not in PREFIX_MATCH_MODES:
      raise ValueError(f"prefix_match must be one of {PREFIX_MATCH_MODES}, "
                       f"got {prefix_match!r}")
    self.allocator = allocator
    self.page_size = page_size
    self.prefix_match = prefix_match
    self.min_cacheable_tokens = min_cacheable_tokens
    self._page_of: dict[bytes, int] = {}
    # page -> (hash, parent hash, block tokens) for every cached page.
    self._entry: dict[int, tuple[bytes, bytes, tuple[int, ...]]] = {}
    # parent hash -> {child page: None}: candidates for token-mode reuse.
    self._children: dict[bytes, dict[int, None]] = {}
    self.hit_tokens = 0
    self.queried_tokens = 0
    self._boundary_check: Optional[Callable[[bytes], bool]] = None
    self._forget_hook: Callable[[bytes], None] = lambda block_hash: None
    self._listeners: list[tuple[Callable, Callable]] = []
    allocator.set_evict_hook(self._forget)

  def set_boundary_check(self, check: Callable[[bytes], bool]) -> None:
    """Hits end only at a full block whose hash `check` accepts (see the module doc)."""
    self._boundary_check = check

  def set_forget_hook(self, hook: Callable[[bytes], None]) -> None:
    """`hook(block_hash)` runs whenever a cached block is forgotten."""
    self._forget_hook = hook

  def add_block_listener(self, stored: Callable[[bytes, bytes, tuple], None],
                         removed: Callable[[bytes], None]) -> None:
    """stored(hash, parent hash, token ids) as a block is cached; removed(hash) as it is
    forgotten (evicted, discarded or reset)."""
    self._listeners.append((stored, removed))

  def hash_of(self, page: int) -> Optional[bytes]:
    """The hash of the block cached in `page`, or None."""
    entry = self._entry.get(page)
    return None if entry is None else entry[0]

  def page_of(self, block_hash: bytes) -> Optional[int]:
    """The page caching the block `block_hash`, or None."""
    return self._page_of.get(block_hash)

  @property
  def num_cached_pages(self) -> int:
    return len(self._entry)

  @property
  def hit_rate(self) -> float:
    """Hit tokens / queried tokens over every acquired lookup."""
    return self.hit_tokens / self.queried_tokens if self.queried_tokens else 0.0

  def block_hashes(self, token_ids: Sequence[int], num_blocks: int,
                   cache_salt: Optional[str] = None,
                   known: Sequence[bytes] = ()) -> list[bytes]:
    """Hashes of the first `num_blocks` full blocks, reusing `known` ones."""
    hashes = list(known[:num_blocks])
    parent = hashes[-1] if hashes else root_hash(cache_salt)
    g = self.page_size
    for i in range(len(hashes), num_blocks):
      parent = hash_block(parent, token_ids[i * g:(i + 1) * g], (cache_salt,))
      hashes.append(parent)
    return hashes

  def lookup(self, token_ids: Sequence[int],
             cache_salt: Optional[str] = None) -> PrefixHit:
    """Longest cached prefix of `token_ids`; never covers the last token."""
    g = self.page_size
    max_hit = len(token_ids) - 1
    pages, hashes = [], []
    parent = root_hash(cache_salt)
    while (len(pages) + 1) * g <= max_hit:
      i = len(pages)
      h = hash_block(parent, token_ids[i * g:(i + 1) * g], (cache_salt,))
      page = self._page_of.get(h)
      if page is None:
        break
      pages.append(page)
      hashes.append(h)
      parent = h
    src, k = None, 0
    if self._boundary_check is not None:
      while pages and not self._boundary_check(hashes[-1]):
        pages.pop()
        hashes.pop()
    elif self.prefix_match == "token":
      src, k = self._longest_child(parent, token_ids[len(pages) * g:max_hit])
    num_tokens = len(pages) * g + k
    if num_tokens < max(self.min_cacheable_tokens, 1):
      return PrefixHit(num_queried=len(token_ids))
    return PrefixHit(num_tokens, tuple(pages), tuple(hashes), src, k,
                     len(token_ids))

  def without_copy(self, hit: PrefixHit) -> PrefixHit:
    """The hit's full blocks only (a token-mode hit whose copy source cannot be pinned)."""
    num_tokens = len(hit.pages) * self.page_size
    if num_tokens < max(self.min_cacheable_tokens, 1):
      return PrefixHit(num_queried=hit.num_queried)
    return dataclasses.replace(hit, num_tokens=num_tokens, copy_src=None, copy_tokens=0)

  def acquire(self, hit: PrefixHit, dead: range = range(0)) -> None:
    """Holds the hit's full-block pages but the `dead` ones and counts the hit.

    Dead pages lie wholly outside the request's attention window
    (kvjax/engine/sched/scheduler.py): their tokens count as hit, but nothing reads
    them, so they are not held.  The token-mode `copy_src` is not held here
    either: the scheduler pins it only until the engine has copied it.
    """
    self.allocator.incref([p for i, p in enumerate(hit.pages) if i not in dead])
    self.hit_tokens += hit.num_tokens
    self.queried_tokens += hit.num_queried

  def insert(self, block_hash: bytes, parent: bytes,
             token_ids: Sequence[int], page: int) -> bool:
    """Registers a computed full block held in `page`; False if already known.

    A block whose hash is cached under another page (two requests computed it
    at once, or a token-mode copy completed it) stays private to its owner.
    """
    if block_hash in self._page_of or page in self._entry:
      return False
    self.allocator.mark_cached(page)
    self._page_of[block_hash] = page
    self._entry[page] = (block_hash, parent, tuple(int(t) for t in token_ids))
    self._children.setdefault(parent, {})[page] = None
    for stored, _ in self._listeners:
      stored(block_hash, parent, self._entry[page][2])
    return True

  def discard(self, pages: Sequence[int]) -> None:
    """Forgets the cached blocks held in `pages` (their content is not to be reused)."""
    for page in pages:
      if page in self._entry:
        self._forget(page)
        self.allocator.uncache(page)

  def discard_tree(self, root: bytes) -> int:
    """Forgets every cached block descending from `root` (root_hash(salt): the blocks of
    one salt, such as an unloaded LoRA adapter's) -> how many."""
    pages, parents = [], [root]
    while parents:
      for page in self._children.get(parents.pop(), ()):
        pages.append(page)
        parents.append(self._entry[page][0])
    self.discard(pages)
    return len(pages)

  def reset(self) -> None:
    """Forgets every cached block; evictable pages become plain free."""
    for page in list(self._entry):
      self._forget(page)
      self.allocator.uncache(page)

  def check_invariants(self) -> None:
    """AssertionError unless hashes, pages and the allocator agree."""
    assert len(self._page_of) == len(self._entry)
    for page, (block_hash, parent, tokens) in self._entry.items():
      assert self._page_of[block_hash] == page
      assert page in self._children[parent]
      assert len(tokens) == self.page_size
    assert sum(map(len, self._children.values())) == len(self._entry)
    for page in range(1, self.allocator.num_pages):
      assert self.allocator.is_cached(page) == (page in self._entry), (
          f"page {page}: allocator and cache disagree on whether it is cached")

  def _forget(self, page: int) -> None:
    block_hash, parent, _ = self._entry.pop(page)
    del self._page_of[block_hash]
    siblings = self._children[parent]
    del siblings[page]
    if not siblings:
      del self._children[parent]
    self._forget_hook(block_hash)
    for _, removed in self._listeners:
      removed(block_hash)

  def _longest_child(self, parent: bytes,
                     rest: Sequence[int]) -> tuple[Optional[int], int]:
    """Cached child of `parent` whose leading tokens best match `rest`."""
    best, best_k = None, 0
    for page in self._children.get(parent, ()):
      tokens = self._entry[page][2]
      k = 0
      for a, b in zip(tokens, rest):
        if a != b:
          break
        k += 1
      if k > best_k:
        best, best_k = page, k
    return best, best_k
