"""Host packing: a scheduled row group -> one padded, bucketed StepBatch.

Shapes are bucketed to powers of two so a run compiles few step programs:
rows from min(8, max_num_seqs) up to max_num_seqs (fewer for long prefill
chunks, at most _MIN_PREFILL_TOKENS of padding-only rows); prefill chunks from
16 tokens up to the token budget; decode rows 1 + J wide for the step's J
(one shape whatever drafts the budget allowed; an adaptive draft policy picks
J in 0..J_max per step, kvjax/engine/sched/draft_policy.py); block tables from 8 pages up
to the widest a row can need.  `Packing.shapes` lists every shape a run can
pack (what Engine.warm_up compiles before serving): at most (row buckets) x
(chunk buckets + 1) x (table buckets) serve steps, plus a multi-step loop per
row and table bucket, each times the draft counts an adaptive draft policy may
pick; fewer, since a long chunk never meets a narrow table and max_model_len
bounds both.  The table width matters because the reference backend's decode
steps gather every column: a decode row of a 192-token context would otherwise
carry the pages a 512-token prefill chunk needs.  Prefill chunks take the widest
table where their attention reads only as far as each row's length (a backend's
`prefill_full_width`, kvjax/attention/blocked.py, on a layout that attends
through it): one program per chunk shape instead of one per width.  Padding
rows use the scratch slot and the null page.  Shapes: docs/DIMENSIONS.md.
"""
from __future__ import annotations

import dataclasses
from typing import NamedTuple, Optional, Sequence

import numpy as np

from kvjax.engine.requests import ScheduledRow, SchedulerOutput
from kvjax.engine.sched.state_snapshots import StepSnapshots
from kvjax.runtime.sampling import SamplingParams
from kvjax.runtime.step_batch import StepBatch, make_step_batch

__all__ = ["bucket", "bucket_sizes", "Packing", "StepShape", "burst_limits"]

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


class StepShape(NamedTuple):
  """A packed row group's program shape (Packing.shapes)."""

  kind: str  # "prefill", "decode" (one serve_step) or "burst" (serve_burst's decode loop)
  rows: int  # B, padding rows included
  columns: int  # T: a prefill chunk bucket, or 1 + J for decode rows
  width: int  # W: block-table columns
  num_draft: int  # J: the drafts its rows verify (decode) or make (prefill): a static arg


@dataclasses.dataclass
class _HostRows:
  """A row group's host arrays; rows not written are padding rows (q_lens 0, the scratch
  slot, the null page)."""

  tokens: np.ndarray  # [B, T] int32
  starts: np.ndarray  # [B] int32
  q_lens: np.ndarray  # [B] int32
  num_draft: np.ndarray  # [B] int32
  slot_ids: np.ndarray  # [B] int32
  next_tokens: np.ndarray  # [B] int32
  tables: np.ndarray  # [B, W] int32
  temperature: np.ndarray  # [B] float32
  top_k: np.ndarray  # [B] int32
  top_p: np.ndarray  # [B] float32
  seeds: np.ndarray  # [B] uint32
  adapters: np.ndarray  # [B] int32 LoRA slot (0: none)
  group_tables: tuple = ()  # one [B, W] int32 table per KV layer group (none: one pool)

  @classmethod
  def padding(cls, b: int, t: int, width: int, scratch_slot: int,
              num_groups: int = 0) -> "_HostRows":
    return cls(tokens=np.zeros((b, t), np.int32), starts=np.zeros(b, np.int32),
               q_lens=np.zeros(b, np.int32), num_draft=np.zeros(b, np.int32),
               slot_ids=np.full(b, scratch_slot, np.int32), next_tokens=np.full(b, -1, np.int32),
               tables=np.zeros((b, width), np.int32), temperature=np.zeros(b, np.float32),
               top_k=np.zeros(b, np.int32), top_p=np.ones(b, np.float32),
               seeds=np.zeros(b, np.uint32), adapters=np.zeros(b, np.int32),
               group_tables=tuple(np.zeros((b, width), np.int32) for _ in range(num_groups)))

  def step_batch(self, snapshot_tables=None, restore=None, lora: bool = False) -> StepBatch:
    sampling = SamplingParams(temperature=self.temperature, top_k=self.top_k, top_p=self.top_p,
                              seeds=self.seeds)
    return make_step_batch(self.tokens, self.starts, self.q_lens, self.tables, self.slot_ids,
                           sampling, num_draft=self.num_draft, next_tokens=self.next_tokens,
                           snapshot_tables=snapshot_tables, restore_snapshots=restore,
                           adapters=self.adapters if lora else None,
                           group_tables=self.group_tables or None)


@dataclasses.dataclass(frozen=True)
class Packing:
  """The static quantities of an engine's packing, fixed at construction."""

  max_num_seqs: int  # rows at most; slot max_num_seqs is the padding rows' scratch slot
  max_query: int  # widest prefill chunk, bucketed (bucket(max_num_batched_tokens))
  page_size: int
  max_table_width: int  # W of the widest row: max_pages_per_seq + pages of a padded chunk
  num_draft: int  # J: decode rows are 1 + J wide
  max_num_batched_tokens: int  # the token budget of a step
  max_model_len: int  # prompt + max_new_tokens at most
  prefill_full_width: bool = False  # prefill chunks take max_table_width (module doc)
  lora: bool = False  # rows carry their LoRA adapter slots (kvjax/lora/)
  num_groups: int = 0  # KV layer groups with a table each (kvjax/caches/groups.py; 0: one pool)

  @classmethod
  def create(cls, *, max_num_seqs: int, max_num_batched_tokens: int, page_size: int,
             max_pages_per_seq: int, num_draft: int, max_model_len: int,
             prefill_full_width: bool = False, lora: bool = False,
             num_groups: int = 0) -> "Packing":
    max_query = bucket(max_num_batched_tokens)
    # Block tables cover a padded row's last position too.
    width = max_pages_per_seq + -(-max_query // page_size)
    return cls(max_num_seqs, max_query, page_size, width, num_draft, max_num_batched_tokens,
               max_model_len, prefill_full_width, lora, num_groups)

  # -- the bucketing rules (shape, table_width and shapes all use these) ------------------

  def _columns(self, decode: bool, longest: int, num_draft: Optional[int] = None) -> int:
    """T: decode rows 1 + J wide (J: num_draft, default the engine's); a prefill group's
    longest chunk bucketed."""
    if decode:
      return 1 + (self.num_draft if num_draft is None else num_draft)
    return bucket(longest, self.max_query, min(_MIN_PREFILL_BUCKET, self.max_query))

  def _rows_bucket(self, num_rows: int, decode: bool, t: int) -> int:
    """B: long prefill chunks get fewer padding rows (at most _MIN_PREFILL_TOKENS of them)."""
    least = _MIN_ROWS_BUCKET if decode else max(1, min(_MIN_ROWS_BUCKET, _MIN_PREFILL_TOKENS // t))
    return bucket(num_rows, self.max_num_seqs, min(least, self.max_num_seqs))

  def decode_rows_bucket(self, num_rows: int) -> int:
    """B of a group of num_rows decode rows (what a draft policy keys its costs by)."""
    return self._rows_bucket(num_rows, True, 1 + self.num_draft)

  def _width_bucket(self, pages: int) -> int:
    return bucket(pages, self.max_table_width, min(_MIN_TABLE_BUCKET, self.max_table_width))

  # -- one row group --------------------------------------------------------------------

  def shape(self, rows: Sequence[ScheduledRow], num_draft: Optional[int] = None
            ) -> tuple[int, int]:
    """(B, T) of a row group: decode rows 1 + J wide (J: num_draft, default the
    engine's), prefill chunks bucketed."""
    decode = rows[0].is_decode
    t = self._columns(decode, max(r.num_tokens for r in rows), num_draft)
    return self._rows_bucket(len(rows), decode, t), t

  def prefill_pieces(self, rows: Sequence[ScheduledRow]) -> list[list[int]]:
    """Indices of a prefill group's rows, split into pieces that pad fewer tokens.

    Longest chunks first, each piece takes the most rows that fill its row bucket
    exactly; a remainder below the smallest bucket of its chunk width stays one
    piece, and a split that would not pad fewer tokens is not made.  Chunks of 128,
    128, 128, 96 and 32 tokens run as 4 rows of 128 columns plus the 32 alone (640
    padded tokens) instead of one 8-row batch (1,024); every piece is a shape
    `shapes()` lists.
    """
    if not rows:
      return []
    order = sorted(range(len(rows)), key=lambda i: -rows[i].num_tokens)
    pieces, start, padded = [], 0, 0
    while start < len(order):
      left = len(order) - start
      t = self._columns(False, rows[order[start]].num_tokens)
      size = max(s for s in range(1, left + 1) if self._rows_bucket(s, False, t) == s
                 ) if self._rows_bucket(1, False, t) < left else left
      pieces.append(order[start:start + size])
      padded += self._rows_bucket(size, False, t) * t
      start += size
    # A remainder can pad back up (a non-power-of-two max_num_seqs): then one piece.
    b, t = self.shape(rows)
    return pieces if padded < b * t else [order]

  def table_width(self, tables: np.ndarray, rows: Sequence[ScheduledRow], t: int) -> int:
    """Block-table columns W a row group's step reads, bucketed: each row's padded last
    position start + t - 1 (a burst's: every position reserved) and every page it holds;
    a prefill group's is the widest where `prefill_full_width`."""
    if self.prefill_full_width and not rows[0].is_decode:
      return self.max_table_width
    needed = max(-(-(r.start + t) // self.page_size) for r in rows)
    held = np.flatnonzero(tables.any(axis=0))
    return self._width_bucket(max(needed, int(held[-1]) + 1 if held.size else 0))

  def pack(self, plan: SchedulerOutput, group: Sequence[int],
           verify: Optional[Sequence[int]] = None, num_draft: Optional[int] = None,
           snapshots: Optional[StepSnapshots] = None) -> StepBatch:
    """Rows plan.rows[group] (all decode or all prefill) -> their padded StepBatch.

    verify[j]: drafts row j verifies, at most its planned num_draft (default: all
    planned); num_draft: the step program's J (default the engine's); snapshots: a
    hybrid engine's state snapshots to write and restore (kvjax/engine/sched/state_snapshots.py).
    """
    rows = [plan.rows[i] for i in group]
    verify = [r.num_draft for r in rows] if verify is None else verify
    b, t = self.shape(rows, num_draft)
    tables = [plan.block_tables[group]] + [table[group] for table in plan.group_tables]
    width = max(self.table_width(table, rows, t) for table in tables)
    a = _HostRows.padding(b, t, width, self.max_num_seqs, len(plan.group_tables))
    for padded, table in zip((a.tables,) + a.group_tables, tables):
      padded[:len(rows), :min(width, table.shape[1])] = table[:, :width]
    for j, row in enumerate(rows):
      a.tokens[j, :len(row.token_ids)] = row.token_ids
      drafts = min(row.num_draft, verify[j])
      a.q_lens[j], a.num_draft[j], a.slot_ids[j], a.starts[j] = (
          len(row.token_ids) + drafts, drafts, row.slot, row.start)
      if not row.sample:
        a.next_tokens[j] = row.request.token_ids[row.start + row.num_tokens]
      s = row.request.sampling
      a.temperature[j], a.top_k[j], a.top_p[j], a.seeds[j] = (s.temperature, s.top_k, s.top_p,
                                                              s.seed)
      a.adapters[j] = row.request.lora_slot
    if snapshots is None:
      return a.step_batch(lora=self.lora)
    restore = np.full(b, -1, np.int32)
    restore[:len(rows)] = [snapshots.restore.get(r.request_id, -1) for r in rows]
    return a.step_batch(snapshots.tables(a.tables), restore, self.lora)

  # -- every row group ------------------------------------------------------------------

  def shapes(self, draft_counts: Optional[Sequence[int]] = None, bursts: bool = False
             ) -> list[StepShape]:
    """Every (kind, B, T, W, J) a run of this packing can pack, from the rules above.

    draft_counts: the J a row group's program may run, decode and prefill alike
    (default: the engine's J; a draft policy's prefill rows draft what their decode
    group runs, kvjax/engine/sched/draft_policy.py).  bursts: also the multi-step loop's
    groups (every running request decoding, 1 + J_max tokens each within the
    budget).  What bounds them: a fed position is at most max_model_len - 2 (the
    last generated token is never fed), so a row starts at most there and a chunk
    is at most max_model_len - 1 tokens; rows take a token of the budget at least.
    """
    budget, most_fed = self.max_num_batched_tokens, self.max_model_len - 1
    shortest = {}  # prefill T -> the shortest longest-chunk that packs to it
    for n in range(1, min(budget, most_fed) + 1):
      shortest.setdefault(self._columns(False, n), n)
    groups = []
    for j in (self.num_draft,) if draft_counts is None else sorted(set(draft_counts)):
      groups += [("prefill", t, budget - n + 1, j) for t, n in shortest.items()]
      t = self._columns(True, 1, j)
      groups.append(("decode", t, budget, j))
      if bursts:
        groups.append(("burst", t, budget // (1 + self.num_draft), j))
    out = []
    for kind, t, most_rows, j in groups:
      decode = kind != "prefill"
      row_buckets = {self._rows_bucket(r, decode, t)
                     for r in range(1, min(most_rows, self.max_num_seqs) + 1)}
      # Pages read: from a row at start 0 to one at the last fed position.
      pages = range(-(-t // self.page_size), -(-(most_fed - 1 + t) // self.page_size) + 1)
      widths = {self._width_bucket(p) for p in pages}
      if self.prefill_full_width and not decode:
        widths = {self.max_table_width}
      out += [StepShape(kind, b, t, w, j) for b in sorted(row_buckets) for w in sorted(widths)]
    return out

  def padding(self, shape: StepShape, snapshots: bool = False) -> StepBatch:
    """A StepBatch of shape's B rows, every one a padding row: what pack() builds
    around its rows (Engine.warm_up runs the step programs on it, which write only
    the scratch slot and the null page).  snapshots: with a hybrid engine's snapshot
    fields (none written, none restored), as its packing always passes them."""
    a = _HostRows.padding(shape.rows, shape.columns, shape.width, self.max_num_seqs,
                          self.num_groups)
    if not snapshots:
      return a.step_batch(lora=self.lora)
    no_snapshots = np.full(a.tables.shape, -1, np.int32)
    return a.step_batch(no_snapshots, np.full(shape.rows, -1, np.int32), self.lora)


def burst_limits(rows: Sequence[ScheduledRow], b: int) -> tuple[np.ndarray, np.ndarray]:
  """A burst's per-row limits: (tokens still allowed [B], stop ids [B, E] -1 padded)."""
  left = np.zeros(b, np.int32)
  stops = [sorted(r.request.stop_token_ids) for r in rows]
  stop_ids = np.full((b, bucket(max(map(len, stops), default=0))), -1, np.int32)
  for j, (row, ids) in enumerate(zip(rows, stops)):
    left[j] = row.request.max_new_tokens - row.request.num_output_tokens
    stop_ids[j, :len(ids)] = ids
  return left, stop_ids
