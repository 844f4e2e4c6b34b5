"""Multi-step decode plans (vLLM's multi-step scheduling): `num_scheduler_steps` S > 1.

When every running request decodes and no waiting request could be admitted meanwhile
(none waits, or every slot is taken), one plan covers up to S decode steps that the
engine runs in one device loop, feeding each step's emitted token to the next; host
scheduling and dispatch then cost once per S tokens.  A burst row reserves pages for
every position it may write (at most S x (1 + K) and at most its remaining
max_new_tokens) only if they are free without preempting anyone; otherwise the step is
a single one.  The tokens of a burst arrive together, so a request that stops early
(EOS) holds its slot until the burst ends.
"""
from __future__ import annotations

from typing import Optional, Sequence

import numpy as np

from kvjax.engine.requests import Request, ScheduledRow
from kvjax.engine.sched.group_pages import GroupPages

__all__ = ["plan_burst"]


def plan_burst(running: Sequence[Request], has_waiting: bool, groups: GroupPages, k: int, *,
               max_num_seqs: int, num_steps: int, max_num_batched_tokens: int
               ) -> Optional[tuple[list[ScheduledRow], int]]:
  """The rows of a burst of every running request verifying k drafts, and its steps; or
  None (a single step instead).  The burst's pages are given to its rows (all or none)."""
  if (num_steps < 2 or not running or not all(r.is_decoding for r in running)
      or (has_waiting and len(running) < max_num_seqs)
      or len(running) * (1 + k) > max_num_batched_tokens):
    return None
  lefts = [r.max_new_tokens - r.num_output_tokens for r in running]
  # A row writes at most the budget (the window bound of max_pages_held).
  steps = min(num_steps, max(lefts), max_num_batched_tokens // (1 + k))
  if steps < 2:
    return None
  spans = [min(steps * (1 + k), left) for left in lefts]
  # All or none (nobody is preempted for a burst).
  needs = [groups.need(r, r.num_computed_tokens + n) for r, n in zip(running, spans)]
  if not groups.can_allocate(needs):
    return None
  for req, need in zip(running, needs):
    groups.give(req, need)
  rows = []
  for req, n, left in zip(running, spans, lefts):
    start = req.num_computed_tokens
    rows.append(ScheduledRow(req, req.slot, start, n, min(k, left - 1),
                             np.asarray(req.token_ids[start:], np.int32), sample=True,
                             is_decode=True, num_steps=steps))
  return rows, steps
