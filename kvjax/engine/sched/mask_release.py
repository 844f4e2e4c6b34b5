"""Pages released from a monotone attention variant's mask (kvjax/attention/variants.py).

A variant declared `monotone=True` promises that a key hidden from a query stays hidden
from every later query.  Every query of a request from now on sits at or after its
`num_computed_tokens` s, so a written page (all its keys < s) whose keys the mask hides
from the query at s, in every cache layer, is never read again: it returns to the pool
exactly as a page behind a sliding window does (kvjax/engine/sched/request_pages.py; a cached block
stays cached, evictable, and its block-table entry becomes the null page, which the
mask hides).

Monotonicity makes "page i is dead from position q" monotone in q, so each page has one
first dead position, found once by a bisection over positions that evaluates the mask
with numpy on the host for all pages still unknown at once; `dead_pages(start)` is then
one comparison per page, and `max_pages_held` (what sizes the pool and admits a
request) the most live pages at the starts where a row's last page is new.  The layout's
own release (the model's window) still applies:
a page is dead if either rule says so.  A variant that is not monotone, a layer with
none, or a mask-less variant (a score only) releases nothing beyond the layout's.
"""
from __future__ import annotations

import dataclasses
import threading
from typing import Optional, Sequence

import numpy as np

from kvjax.caches.layout import PageRelease
from kvjax.model.config import ModelConfig

__all__ = ["MaskRelease", "mask_release"]

_NEVER = np.iinfo(np.int64).max  # a page some query may always see


@dataclasses.dataclass(frozen=True)
class MaskRelease(PageRelease):
  """`base`'s dead pages plus those every layer's monotone `masks` hide from `start` on;
  positions stop below `max_positions`."""

  base: PageRelease = PageRelease(1)
  masks: tuple = ()  # (q_pos, kv_pos) -> bool, one per distinct variant
  max_positions: int = 1
  # first_dead[i]: the first query position from which page i is dead (_NEVER: none),
  # grown as requests get longer; shared by every request (it depends on positions only).
  _first_dead: list = dataclasses.field(default_factory=lambda: [np.zeros(0, np.int64)],
                                        compare=False, hash=False, repr=False)
  _lock: threading.Lock = dataclasses.field(default_factory=threading.Lock, compare=False,
                                            hash=False, repr=False)

  def dead_pages(self, start: int) -> Sequence[int]:
    written = start // self.page_size  # pages wholly before start
    dead = self._first_dead_of(written)[:written] <= start
    base = self.base.dead_pages(start)
    dead[slice(base.start, base.stop, base.step) if isinstance(base, range) else list(base)] = 1
    count = int(dead.sum())
    if dead[:count].all():  # the common case (windows): a prefix, kept a range
      return range(count)
    return tuple(np.flatnonzero(dead).tolist())

  def max_pages_held(self, num_tokens: int, max_num_batched_tokens: int) -> int:
    """The most a row of n <= max_num_batched_tokens positions from any start s holds:
    pages up to its last fed position less those dead at s.  Between the starts where that
    last page is new (s + n - 1 a page start) the pages held only fall, so those starts
    (and s = 0) bound it."""
    last = num_tokens - 2  # the last fed position
    if last < 0:
      return 0
    n, z = max_num_batched_tokens, self.page_size
    starts = {0} | {max(0, first - n + 1) for first in range(0, last + 1, z)}
    held = max(min(s + n - 1, last) // z + 1 - len(self.dead_pages(s))
               for s in starts if s <= last)
    return min(held, self.base.max_pages_held(num_tokens, max_num_batched_tokens))

  def _first_dead_of(self, num_pages: int) -> np.ndarray:
    with self._lock:
      known = self._first_dead[0]
      if len(known) < num_pages:
        wanted = max(num_pages, 2 * len(known))
        fresh = self._bisect(np.arange(len(known), wanted))
        self._first_dead[0] = known = np.concatenate([known, fresh])
      return known

  def _hidden(self, q: np.ndarray, pages: np.ndarray) -> np.ndarray:
    """q [P] positions, pages [P] -> [P] bool: every key of the page is hidden from q."""
    keys = pages[:, None] * self.page_size + np.arange(self.page_size)[None, :]  # [P, Z]
    seen = np.zeros(keys.shape, bool)
    for mask in self.masks:
      seen |= np.broadcast_to(np.asarray(mask(q[:, None], keys), bool), keys.shape)
    return ~(seen & (keys <= q[:, None])).any(axis=1)

  def _bisect(self, pages: np.ndarray) -> np.ndarray:
    """[P] first dead position of each page: the least q >= the page's end at which its
    keys are hidden (a monotone predicate of q), or _NEVER if hidden at no position."""
    lo = (pages + 1) * self.page_size  # a page is released only once written
    last = self.max_positions - 1
    hi = np.full(pages.shape, max(last, 0), np.int64)
    never = (lo > last) | ~self._hidden(hi, pages)
    hi = np.maximum(hi, lo)
    while (searching := ~never & (lo < hi)).any():
      mid = (lo + hi) // 2
      hidden = self._hidden(mid, pages)
      hi = np.where(searching & hidden, mid, hi)
      lo = np.where(searching & ~hidden, mid + 1, lo)
    return np.where(never, _NEVER, lo)


def mask_release(base: PageRelease, cfg: ModelConfig, *, draft: Optional[ModelConfig],
                 layers: Optional[Sequence[int]] = None) -> PageRelease:
  """`base` plus release from the attention variants when every cache layer reading the
  pages has a monotone one with a mask: cfg's `layers` (default all; a KV layer group's,
  kvjax/caches/groups.py) and every layer of the `draft` model's config, which reads the
  same pages through its own cache (None: no draft model); else `base` itself.  A page is
  released only once every one of those masks hides it."""
  layers = range(cfg.num_cache_layers) if layers is None else layers
  variants = [cfg.variant_of_layer(layer) for layer in layers]
  if draft is not None:
    variants += [draft.variant_of_layer(layer) for layer in range(draft.num_cache_layers)]
  if not all(v is not None and v.monotone and v.mask is not None for v in variants):
    return base
  masks = tuple(dict.fromkeys(v.mask for v in variants))
  return MaskRelease(base.page_size, base, masks, cfg.max_position_embeddings)
