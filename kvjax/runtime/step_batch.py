"""`StepBatch`: the metadata of one step, built once on the host, read by every layer.

The host (the engine's packing in kvjax/engine/sched/batching.py, or the static batch in
kvjax/runtime/generation.py) decides which tokens each row feeds, where they sit and
which pages they use; the device step only reads this record.  The same
StepBatch goes unchanged to the trunk's attention, the MTP modules' attention
and the verifier; a draft model derives its own columns from it
(`with_columns`), and a multi-step burst moves its rows forward
(`at_starts`).  Nothing here is a source of truth on the device: block tables
and lengths live on the host (the scheduler), and the device state holds only
K/V.

Shapes use the dimension legend of docs/DIMENSIONS.md: B rows, T query
columns, W block-table width (pages per row), J drafts per row.

Layout: padded, not ragged.  Column t of row b sits at sequence position
`positions[b, t] = start_b + t`; the first `q_lens[b]` columns are real, the
rest padding (written to the null page, never read).  `kv_lens[b] = start_b + T`
counts every column, so a padded row's query t sees keys at positions
<= start_b + t; the ragged Pallas kernel gets the same rows flattened at
`cu_q_lens[b] = b * T`.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from kvjax.runtime.sampling import SamplingParams

__all__ = ["StepBatch", "make_step_batch"]


@struct.dataclass
class StepBatch:
  tokens: jax.Array  # [B, T] int32 ids fed; draft columns are filled on the device
  positions: jax.Array  # [B, T] int32 sequence position of each column (= start + t)
  q_lens: jax.Array  # [B] int32 real columns (0: a padding row)
  kv_lens: jax.Array  # [B] int32 = start + T (every column counted, padding too)
  block_tables: jax.Array  # [B, W] int32 physical page of each logical page (0: null page)
  slot_ids: jax.Array  # [B] int32 per-slot state row (drafts, KIVI residual); padding: scratch
  cu_q_lens: jax.Array  # [B + 1] int32 ragged row offsets of the flattened columns (= b * T)
  num_draft: jax.Array  # [B] int32 trailing draft columns among the q_lens real ones
  next_tokens: jax.Array  # [B] int32 known id after a mid-prompt chunk; -1: the row samples
  sampling: SamplingParams  # [B] per-row temperature, top-k, top-p, seed
  # Hybrid models' prefix-cache snapshots (kvjax/caches/recurrent.py); None: none this step.
  snapshot_tables: jax.Array = None  # [B, W] int32 snapshot written at each page's end; -1 none
  restore_snapshots: jax.Array = None  # [B] int32 snapshot a row starts from; -1: its slot's
  # LoRA adapter slot of each row (kvjax/lora/; 0: the base model); None: an engine without.
  adapters: jax.Array = None  # [B] int32
  # One [B, W] int32 block table per KV layer group (kvjax/caches/groups.py), each into
  # its group's pool; None: every layer reads `block_tables`.
  group_tables: tuple = None

  @property
  def starts(self) -> jax.Array:
    """[B] int32 tokens cached before this step (position of column 0)."""
    return self.positions[:, 0]

  @property
  def valid(self) -> jax.Array:
    """[B, T] bool: the column holds a real token."""
    return jnp.arange(self.positions.shape[1])[None, :] < self.q_lens[:, None]

  def at_starts(self, starts: jax.Array, q_lens: jax.Array) -> "StepBatch":
    """The same rows moved to column-0 positions starts [B] with q_lens [B] real columns."""
    t = self.positions.shape[1]
    return self.replace(positions=starts[:, None] + jnp.arange(t, dtype=jnp.int32)[None],
                        kv_lens=starts + t, q_lens=q_lens)

  def with_columns(self, tokens: jax.Array, q_lens: jax.Array) -> "StepBatch":
    """Rows from the same starts with tokens [B, T'] (T' >= T; the tables must cover them)."""
    b, t = tokens.shape
    positions = self.starts[:, None] + jnp.arange(t, dtype=jnp.int32)[None]
    return self.replace(tokens=tokens, positions=positions, kv_lens=positions[:, -1] + 1,
                        q_lens=q_lens, cu_q_lens=jnp.arange(b + 1, dtype=jnp.int32) * t)


def make_step_batch(tokens: np.ndarray, starts, q_lens, block_tables, slot_ids=None,
                    sampling: SamplingParams = None, *, num_draft=None,
                    next_tokens=None, snapshot_tables=None,
                    restore_snapshots=None, adapters=None, group_tables=None) -> StepBatch:
  """Host arrays of padded rows -> StepBatch (positions, kv_lens, cu_q_lens derived once).

  tokens [B, T] (host or device), starts / q_lens / slot_ids [B], block_tables [B, W]; slot_ids
  default to 0..B-1, sampling to greedy, num_draft to 0 and next_tokens to -1
  (every row samples); snapshot_tables / restore_snapshots / adapters / group_tables (one
  [B, W] table per layer group) stay None unless given.
  """
  # Ids already on the device (a sampled token) stay there: no host round trip.
  tokens = tokens.astype(jnp.int32) if isinstance(tokens, jax.Array) else np.asarray(
      tokens, np.int32)
  b, t = tokens.shape
  starts = np.asarray(starts, np.int32)
  zeros = np.zeros(b, np.int32)
  slot_ids = np.arange(b, dtype=np.int32) if slot_ids is None else slot_ids
  sampling = SamplingParams.greedy(b) if sampling is None else sampling
  return StepBatch(
      tokens=tokens,
      positions=starts[:, None] + np.arange(t, dtype=np.int32)[None],
      q_lens=np.asarray(q_lens, np.int32), kv_lens=starts + np.int32(t),
      block_tables=np.asarray(block_tables, np.int32), slot_ids=np.asarray(slot_ids, np.int32),
      cu_q_lens=np.arange(b + 1, dtype=np.int32) * np.int32(t),
      num_draft=zeros if num_draft is None else np.asarray(num_draft, np.int32),
      next_tokens=zeros - 1 if next_tokens is None else np.asarray(next_tokens, np.int32),
      sampling=sampling,
      snapshot_tables=None if snapshot_tables is None else np.asarray(snapshot_tables, np.int32),
      restore_snapshots=(None if restore_snapshots is None
                         else np.asarray(restore_snapshots, np.int32)),
      adapters=None if adapters is None else np.asarray(adapters, np.int32),
      group_tables=None if group_tables is None else tuple(
          np.asarray(table, np.int32) for table in group_tables))
