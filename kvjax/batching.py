"""Host packing: a scheduled row group -> one padded, bucketed StepBatch.

Shapes are bucketed to powers of two so a run compiles few step programs:
rows from min(8, max_num_seqs) up to max_num_seqs (fewer for long prefill
chunks, at most _MIN_PREFILL_TOKENS of padding-only rows); prefill chunks from
16 tokens up to the token budget; decode rows 1 + J wide for the step's J
(one shape whatever drafts the budget allowed; an adaptive draft policy picks
J in 0..J_max per step, kvjax/draft_policy.py); block tables from 8 pages up
to the widest a row can need.  A run then compiles at most (row buckets) x
(chunk buckets + 1) x (table buckets) serve steps, plus a multi-step loop per
row and table bucket, each times (J_max + 1) with an adaptive draft policy.  The table width matters because the reference backend gathers
every column: a decode row of a 192-token context would otherwise carry the
pages a 512-token prefill chunk needs.  Padding rows use the scratch slot and
the null page.  Shapes: docs/DIMENSIONS.md.
"""
from __future__ import annotations

import dataclasses
from typing import Optional, Sequence

import numpy as np

from kvjax.requests import ScheduledRow, SchedulerOutput
from kvjax.sampling import SamplingParams
from kvjax.state_snapshots import StepSnapshots
from kvjax.step_batch import StepBatch, make_step_batch

__all__ = ["bucket", "bucket_sizes", "Packing", "burst_limits"]

_MIN_ROWS_BUCKET = 8
_MIN_PREFILL_BUCKET = 16
_MIN_PREFILL_TOKENS = 128
_MIN_TABLE_BUCKET = 8  # pages


def bucket(n: int, maximum: Optional[int] = None, minimum: int = 1) -> int:
  """Smallest power of two >= n (at least `minimum`), capped at `maximum`."""
  b = max(minimum, 1)
  while b < n:
    b *= 2
  return b if maximum is None else min(b, maximum)


def bucket_sizes(maximum: int, minimum: int = 1) -> list[int]:
  """Every value `bucket(n, maximum, minimum)` can return: shapes to warm up."""
  return sorted({bucket(n, maximum, minimum) for n in range(1, maximum + 1)})


@dataclasses.dataclass(frozen=True)
class Packing:
  """The static quantities of an engine's packing, fixed at construction."""

  max_num_seqs: int  # rows at most; slot max_num_seqs is the padding rows' scratch slot
  max_query: int  # widest prefill chunk, bucketed (bucket(max_num_batched_tokens))
  page_size: int
  max_table_width: int  # W of the widest row: max_pages_per_seq + pages of a padded chunk
  num_draft: int  # J: decode rows are 1 + J wide

  @classmethod
  def create(cls, *, max_num_seqs: int, max_num_batched_tokens: int, page_size: int,
             max_pages_per_seq: int, num_draft: int) -> "Packing":
    max_query = bucket(max_num_batched_tokens)
    # Block tables cover a padded row's last position too.
    width = max_pages_per_seq + -(-max_query // page_size)
    return cls(max_num_seqs, max_query, page_size, width, num_draft)

  def shape(self, rows: Sequence[ScheduledRow], num_draft: Optional[int] = None
            ) -> tuple[int, int]:
    """(B, T) of a row group: decode rows 1 + J wide (J: num_draft, default the
    engine's), prefill chunks bucketed."""
    min_rows = _MIN_ROWS_BUCKET
    if rows[0].is_decode:
      t = 1 + (self.num_draft if num_draft is None else num_draft)
    else:
      t = bucket(max(r.num_tokens for r in rows), self.max_query,
                 min(_MIN_PREFILL_BUCKET, self.max_query))
      min_rows = max(1, min(min_rows, _MIN_PREFILL_TOKENS // t))
    return bucket(len(rows), self.max_num_seqs, min(min_rows, self.max_num_seqs)), t

  def table_width(self, tables: np.ndarray, rows: Sequence[ScheduledRow], t: int) -> int:
    """Block-table columns W a row group's step reads, bucketed: each row's padded last
    position start + t - 1 (a burst's: every position reserved) and every page it holds."""
    needed = max(-(-(r.start + t) // self.page_size) for r in rows)
    held = np.flatnonzero(tables.any(axis=0))
    needed = max(needed, int(held[-1]) + 1 if held.size else 0)
    return bucket(needed, self.max_table_width, min(_MIN_TABLE_BUCKET, self.max_table_width))

  def pack(self, plan: SchedulerOutput, group: Sequence[int],
           verify: Optional[Sequence[int]] = None, num_draft: Optional[int] = None,
           snapshots: Optional[StepSnapshots] = None) -> StepBatch:
    """Rows plan.rows[group] (all decode or all prefill) -> their padded StepBatch.

    verify[j]: drafts row j verifies, at most its planned num_draft (default: all
    planned); num_draft: the step program's J (default the engine's); snapshots: a
    hybrid engine's state snapshots to write and restore (kvjax/state_snapshots.py).
    """
    rows = [plan.rows[i] for i in group]
    verify = [r.num_draft for r in rows] if verify is None else verify
    b, t = self.shape(rows, num_draft)
    width = self.table_width(plan.block_tables[group], rows, t)
    tokens = np.zeros((b, t), np.int32)
    q_lens, num_draft, starts = (np.zeros(b, np.int32) for _ in range(3))
    slot_ids = np.full(b, self.max_num_seqs, np.int32)  # padding: the scratch slot
    next_tokens = np.full(b, -1, np.int32)
    tables = np.zeros((b, width), np.int32)
    held = plan.block_tables[group][:, :width]
    tables[:len(rows), :held.shape[1]] = held
    temperature, top_p = np.zeros(b, np.float32), np.ones(b, np.float32)
    top_k, seeds = np.zeros(b, np.int32), np.zeros(b, np.uint32)
    for j, row in enumerate(rows):
      tokens[j, :len(row.token_ids)] = row.token_ids
      drafts = min(row.num_draft, verify[j])
      q_lens[j], num_draft[j], slot_ids[j], starts[j] = (
          len(row.token_ids) + drafts, drafts, row.slot, row.start)
      if not row.sample:
        next_tokens[j] = row.request.token_ids[row.start + row.num_tokens]
      s = row.request.sampling
      temperature[j], top_k[j], top_p[j], seeds[j] = s.temperature, s.top_k, s.top_p, s.seed
    sampling = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, seeds=seeds)
    snapshot_tables = restore = None
    if snapshots is not None:
      snapshot_tables = snapshots.tables(tables)
      restore = np.full(b, -1, np.int32)
      restore[:len(rows)] = [snapshots.restore.get(r.request_id, -1) for r in rows]
    return make_step_batch(tokens, starts, q_lens, tables, slot_ids, sampling,
                           num_draft=num_draft, next_tokens=next_tokens,
                           snapshot_tables=snapshot_tables, restore_snapshots=restore)


def burst_limits(rows: Sequence[ScheduledRow], b: int) -> tuple[np.ndarray, np.ndarray]:
  """A burst's per-row limits: (tokens still allowed [B], stop ids [B, E] -1 padded)."""
  left = np.zeros(b, np.int32)
  stops = [sorted(r.request.stop_token_ids) for r in rows]
  stop_ids = np.full((b, bucket(max(map(len, stops)))), -1, np.int32)
  for j, (row, ids) in enumerate(zip(rows, stops)):
    left[j] = row.request.max_new_tokens - row.request.num_output_tokens
    stop_ids[j, :len(ids)] = ids
  return left, stop_ids
