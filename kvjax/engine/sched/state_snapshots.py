"""Recurrent-state snapshots: exact prefix caching for hybrid models at page granularity.

A hybrid model's Gated DeltaNet layers (kvjax/model/hybrid.py) summarize the whole
prefix in a fixed-size state that cannot be rebuilt from KV pages, so a
prefix hit must also restore the state at the hit's end.  The device keeps Q
snapshots (HybridPagedCache.snapshot_conv / snapshot_delta,
kvjax/caches/recurrent.py); this pool decides, on the host, which boundary
each one holds:

  plan     before a step, every page boundary a scheduled row's columns may
           reach gets a free snapshot (evicting the least recently used one
           if none is free), written on the device right after that page's
           last token; a row that starts just after a prefix hit restores the
           snapshot at the hit's end instead of its slot's state.
  settle   after the step, a snapshot whose page became a cached block is kept,
           keyed by that block's hash (the prefix cache's chain, salt
           included); the others go back to the free list.
  lookup   the prefix cache ends a hit only at a block with a snapshot
           (`PrefixCache.set_boundary_check`), so a hit at 16-token pages shares
           every whole page up to the last snapshotted boundary: a 40-token
           shared prefix hits 32 tokens, where a design that grows pages until
           one holds a state (vLLM's hybrid allocator, up to 2,048 tokens) hits
           0.  Token mode cannot resume mid-page (no state there): it resumes
           at that boundary too and recomputes the tail.
  forget   a block leaving the prefix cache frees its snapshot.

Outputs equal those without the prefix cache: a snapshot is the state the
request itself would have had at that position (the chunked rule computes it
inside its chunk, kvjax/attention/gated_delta.py).  A snapshot costs the
per-request state bytes (kvjax/parallel/ledger.py state_bytes_per_request) per cached
boundary; `EngineConfig.prefix_snapshots` bounds how many are kept.
"""
from __future__ import annotations

import collections
import dataclasses
from typing import Optional, Sequence

import numpy as np

from kvjax.engine.requests import ScheduledRow
from kvjax.engine.sched.prefix_cache import PrefixCache

__all__ = ["SnapshotPool", "StepSnapshots"]


@dataclasses.dataclass(frozen=True)
class StepSnapshots:
  """One step's snapshot metadata, read by the packing (kvjax/engine/sched/batching.py)."""

  slot_of_page: np.ndarray  # [P] int32 snapshot written at the end of each physical page; -1
  restore: dict  # request id -> snapshot its first chunk after a prefix hit starts from

  def tables(self, block_tables: np.ndarray) -> np.ndarray:
    """block_tables [B, W] -> snapshot_tables [B, W] (-1 where nothing is written)."""
    return self.slot_of_page[block_tables]


class SnapshotPool:
  """Which of `capacity` device snapshots holds which cached block's end state.

  Installs its hooks on `prefix_cache` (the engine's scheduler's).
  """

  def __init__(self, prefix_cache: PrefixCache, capacity: int, num_pages: int):
    if capacity < 1:
      raise ValueError(f"a snapshot pool needs capacity >= 1, got {capacity}")
    self.prefix_cache = prefix_cache
    self.capacity = capacity
    self.page_size = prefix_cache.page_size
    self._free = list(range(capacity - 1, -1, -1))  # pop() hands out 0 first
    self._slot_of: collections.OrderedDict[bytes, int] = collections.OrderedDict()  # LRU first
    self._pending: dict[int, int] = {}  # page -> snapshot written at its end this step
    self._slot_of_page = np.full(num_pages, -1, np.int32)
    self.num_restored = 0
    prefix_cache.set_boundary_check(self._slot_of.__contains__)
    prefix_cache.set_forget_hook(self._forget)

  @property
  def num_kept(self) -> int:
    """Snapshots holding a cached block's end state."""
    return len(self._slot_of)

  def plan(self, rows: Sequence[ScheduledRow]) -> StepSnapshots:
    """Snapshots to write and restore in the step running `rows`."""
    assert not self._pending, "plan() again before settle()"
    g = self.page_size
    restore = {}
    for row in rows:
      req = row.request
      if not row.is_decode and row.start == req.num_cached_tokens > 0:
        block = req.block_hashes[row.start // g - 1]
        restore[req.request_id] = self._slot_of[block]
        self._slot_of.move_to_end(block)
    protected = set(restore.values())
    for row in rows:
      # Logical page j ends in this step when start < (j + 1) g <= start + num_tokens.
      for j in range(row.start // g, (row.start + row.num_tokens) // g):
        slot = self._take(protected)
        if slot is None:
          break
        page = row.request.pages[j]
        self._pending[page] = slot
        self._slot_of_page[page] = slot
    self.num_restored += len(restore)
    return StepSnapshots(self._slot_of_page.copy(), restore)

  def settle(self) -> None:
    """After the step's outputs are applied: keep the snapshots of newly cached blocks."""
    for page, slot in self._pending.items():
      self._slot_of_page[page] = -1
      block = self.prefix_cache.hash_of(page)
      if block is None or block in self._slot_of:  # not cached (yet), or cached elsewhere
        self._free.append(slot)
      else:
        self._slot_of[block] = slot
    self._pending.clear()

  def check_invariants(self) -> None:
    """AssertionError unless every snapshot is free, kept once, or pending."""
    used = list(self._slot_of.values()) + list(self._pending.values()) + self._free
    assert sorted(used) == list(range(self.capacity)), used
    assert all(self.prefix_cache.page_of(block) is not None for block in self._slot_of)

  def _take(self, protected: set) -> Optional[int]:
    """A free snapshot, else the least recently used unprotected kept one, else None."""
    if self._free:
      return self._free.pop()
    for block, slot in self._slot_of.items():
      if slot not in protected:
        del self._slot_of[block]
        return slot
    return None

  def _forget(self, block: bytes) -> None:
    slot = self._slot_of.pop(block, None)
    if slot is not None:
      self._free.append(slot)
