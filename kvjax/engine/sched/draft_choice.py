"""How many drafts a step's row groups verify: the engine's side of its draft policy.

The decode rows' J is asked before planning (fewer drafts leave budget to
prefill), the prefill rows' after: what their decode group runs now
(kvjax/engine/sched/draft_policy.py).  Prefill rows of an n-gram engine draft nothing (their
drafts come from the host once they decode, kvjax/engine/sched/ngram.py).  A policy object's
choice outside 0..J_max is a ValueError.
"""
from __future__ import annotations

from typing import Optional

__all__ = ["decode_drafts", "prefill_drafts"]


def decode_drafts(policy, scheduler, packing, metrics: dict, num_draft: int) -> int:
  """J of this step's decode rows: the draft policy's choice for the running requests
  that decode (their row bucket and RequestMetrics); num_draft without a policy."""
  decoding = [r for r in scheduler.running if r.is_decoding]
  if policy is None or not decoding:
    return num_draft
  bucket = packing.decode_rows_bucket(len(decoding))
  return _checked(policy.choose(bucket, [metrics[r.request_id] for r in decoding],
                                _drafts_beside_prefill(scheduler, len(decoding))), num_draft)


def prefill_drafts(policy, scheduler, packing, num_draft: int, host_drafts: bool) -> int:
  """J of this step's prefill rows: the policy's for the group of every running request
  (0 with host drafts)."""
  if host_drafts:
    return 0
  if policy is None:
    return num_draft
  bucket = packing.decode_rows_bucket(len(scheduler.running))
  return _checked(policy.prefill_drafts(bucket), num_draft, "prefill ")


def _checked(k: int, num_draft: int, rows: str = "") -> int:  # a policy object's choice
  if not 0 <= k <= num_draft:
    raise ValueError(f"draft policy chose {k} {rows}drafts; it may choose 0..{num_draft}")
  return k


def _drafts_beside_prefill(s, num_decoding: int) -> Optional[int]:
  """The most drafts per decode row that leave this step's budget to every prefill
  token that could run in it (running prompts' rest, prompts a free slot of scheduler
  s could admit); None when no prefill work waits."""
  pending = sum(r.num_tokens - r.num_computed_tokens for r in s.running if not r.is_decoding)
  admittable = list(s.waiting)[:max(0, s.max_num_seqs - len(s.running))]
  pending += sum(r.num_tokens for r in admittable)
  if not pending:
    return None
  return max(0, (s.max_num_batched_tokens - pending) // num_decoding - 1)
