"""EngineStats: what an Engine or a Router reports of its scheduler, one read-only record.

`engine.stats()` is a snapshot: gauges (requests running and waiting, pages held and
usable) and cumulative counters (preemptions, prefix-cache hit and queried tokens).
Structured outputs add the requests under a constraint (a gauge) and the token masks
filled and their host seconds (counters).  A Router's is the sum of its replicas'
(`+`), so a server loop, its /metrics and `kvjax bench` read one record whichever
they drive, never a scheduler.
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import numpy as np

__all__ = ["EngineStats"]


@dataclasses.dataclass(frozen=True)
class EngineStats:
  running: int = 0  # requests holding a slot
  waiting: int = 0  # requests queued for one (preempted ones included)
  pages_used: int = 0  # KV pages held by requests (in every KV layer group's pool)
  pages_usable: int = 0  # KV pages the pools can hand out (all but each null page)
  num_preemptions: int = 0
  prefix_hit_tokens: int = 0  # prompt tokens found in the prefix cache (0 without one)
  prefix_queried_tokens: int = 0  # prompt tokens looked up in it
  constrained: int = 0  # requests decoding under a constraint (kvjax/constraints)
  masks_filled: int = 0  # (row, position) token masks their matchers filled
  mask_seconds: float = 0.0  # host seconds spent filling them
  # MoE models: tokens each layer routed to each expert, cumulative [L, Ne] (else None)
  expert_tokens: Optional[np.ndarray] = None

  @classmethod
  def of(cls, scheduler, constraints=None, expert_tokens=None) -> EngineStats:
    """The numbers of a kvjax/engine/sched/scheduler.py Scheduler and, when given, the engine's
    ConstraintBook (kvjax/constraints/book.py) and its expert token counts now."""
    cache = scheduler.prefix_cache
    book = {} if constraints is None else dict(
        constrained=len(constraints.matchers), masks_filled=constraints.masks_filled,
        mask_seconds=constraints.mask_s)
    return cls(running=len(scheduler.running), waiting=len(scheduler.waiting),
               pages_used=sum(group.allocator.num_used for group in scheduler.groups),
               pages_usable=sum(group.allocator.num_usable for group in scheduler.groups),
               num_preemptions=scheduler.num_preemptions,
               prefix_hit_tokens=cache.hit_tokens if cache else 0,
               prefix_queried_tokens=cache.queried_tokens if cache else 0,
               expert_tokens=None if expert_tokens is None else expert_tokens.copy(), **book)

  @property
  def utilization(self) -> float:
    """Fraction of usable pages held by requests (the KV utilization metric)."""
    return self.pages_used / self.pages_usable if self.pages_usable else 0.0

  def __add__(self, other: EngineStats) -> EngineStats:
    """Two pools' stats as one (a Router's replicas; None expert counts add as zeros)."""
    def add(a, b):
      return a if b is None else b if a is None else a + b
    return EngineStats(*(add(getattr(self, f.name), getattr(other, f.name))
                         for f in dataclasses.fields(self)))

  def counted_since(self, before: EngineStats) -> dict[str, int]:
    """The counters' growth since `before`, as kvjax.engine.metrics.summarize's keywords."""
    return {name: getattr(self, name) - getattr(before, name)
            for name in ("prefix_hit_tokens", "prefix_queried_tokens", "num_preemptions")}
