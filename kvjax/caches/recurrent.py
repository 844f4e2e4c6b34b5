"""Hybrid caches: per-slot recurrent state beside the KV of the full-attention layers.

A hybrid model (Qwen3.5, Qwen3-Next; kvjax/model/hybrid.py) has two kinds of layer.
Its full-attention layers cache K/V exactly as a dense model's do (pages, or a
contiguous buffer), indexed by their row among the attention layers; its Gated
DeltaNet layers keep, per slot, a conv state (the last Kc - 1 conv inputs) and
a delta-rule state [Nv, Hk, Hv] that do not grow with the context.  One record
holds both and keeps the one contract:

  cache, out = cache.attend(layer, q, k, v, batch, *, sm_scale, backend, variant=None)

for attention layers (the KV base class's attend), while a linear layer calls

  cache, out = cache.linear_attend(layer, inputs, batch, backend)

with its LinearInputs (kvjax/attention/gated_delta.py) and `layer` its row
among the linear layers: it reads the rows' slots, runs the rule and writes
the new states back.

A row whose step starts at position 0 with real columns is a new (or a
preempted, recomputed) request: it starts from zero states whatever its slot
held.  Padding columns and rows leave the states as they were.  The states are
`SLOT_ARRAYS` (slots on axis 1, after the layer axis), so a failed request's
slot is cleared like an int4 residual (kvjax/caches/paged.py clear_cache_pages).

Prefix caching (kvjax/engine/sched/state_snapshots.py): a state cannot be rebuilt from KV
pages, so the paged twin also keeps Q snapshots, the states right after
page boundaries.  A step's `snapshot_tables` [B, W] names, per logical page,
the snapshot to write when a row's real columns reach that page's last
position (-1: none); `restore_snapshots` [B] names the snapshot a row starts
from instead of its slot's state (-1: none), e.g. the first chunk after a
prefix hit.  Both are None when nothing is captured or restored.

Speculative decoding: a verify row's state runs through its drafts before
anyone knows which are accepted, so with speculation on the paged twin also
keeps, per slot, the J + 1 states after each verify column (`verify_conv`,
`verify_delta`), and `keep_accepted` (after acceptance, in the same step)
sets each verify row's state to the one after its last accepted column: as if
the rejected drafts had never run.

  Ll linear layers, M slots, Q snapshots, Y captures per row, Kc conv width,
  X conv channels, Nv value heads, Hk / Hv key / value head dims.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import struct

from kvjax.attention.gated_delta import LinearInputs, gated_delta_mix
from kvjax.caches.contiguous import ContiguousKVCache
from kvjax.caches.layout import ArraySpec, PoolSizes, allocate
from kvjax.caches.paged import PagedKVCache
from kvjax.model.config import ModelConfig
from kvjax.runtime.step_batch import StepBatch

__all__ = ["RecurrentState", "HybridPagedCache", "HybridContiguousCache", "state_shapes",
           "state_arrays", "with_recurrent_state", "check_hybrid_engine"]

STATE_DTYPE = "fp32"  # the delta-rule state accumulates over the whole context


def state_shapes(cfg: ModelConfig, num_slots: int) -> tuple[tuple, tuple]:
  """(conv_state [Ll, M, Kc - 1, X], delta_state [Ll, M, Nv, Hk, Hv]) shapes for cfg."""
  channels = 2 * cfg.linear_num_key_heads * cfg.linear_key_head_dim + (
      cfg.linear_num_value_heads * cfg.linear_value_head_dim)
  lead = (cfg.num_linear_layers, num_slots)
  return (lead + (cfg.linear_conv_kernel - 1, channels),
          lead + (cfg.linear_num_value_heads, cfg.linear_key_head_dim,
                  cfg.linear_value_head_dim))


class RecurrentState:
  """The linear layers' half of a hybrid cache (mixed into a KV cache class that
  declares `conv_state` and `delta_state` fields)."""

  SLOT_ARRAYS = ("conv_state", "delta_state")
  num_verify_states = 0  # J + 1 where speculation keeps a state per verify column

  def linear_attend(self, layer: int, inputs: LinearInputs, batch: StepBatch, backend):
    """Run linear layer `layer` on the rows' slot states with the backend's delta rule
    -> (cache, out [B, T, Nv, Hv] f32)."""
    mix = functools.partial(gated_delta_mix, rule=backend.delta_rule)
    slots = batch.slot_ids
    conv, delta = self.conv_state[layer, slots], self.delta_state[layer, slots]
    if batch.restore_snapshots is not None:
      restore = batch.restore_snapshots >= 0  # [B]
      source = jnp.maximum(batch.restore_snapshots, 0)
      conv = jnp.where(restore[:, None, None], self.snapshot_conv[layer, source], conv)
      delta = jnp.where(restore[:, None, None, None], self.snapshot_delta[layer, source], delta)
    fresh = (batch.starts == 0) & (batch.q_lens > 0)  # [B] a request's first step
    conv = jnp.where(fresh[:, None, None], 0, conv)
    delta = jnp.where(fresh[:, None, None, None], 0, delta)
    snapshot = batch.snapshot_tables is not None
    verify = self.num_verify_states > 0
    if not (snapshot or verify):
      out, conv, delta = mix(inputs, conv, delta, batch.q_lens)
      return self.replace(conv_state=self.conv_state.at[layer, slots].set(conv),
                          delta_state=self.delta_state.at[layer, slots].set(delta)), out
    columns, targets = self._captures(batch) if snapshot else (None, None)
    if verify:  # the states after a verify row's J + 1 columns (none for other rows)
      base = batch.q_lens - 1 - batch.num_draft  # [B] the column of the last known token
      after = base[:, None] + jnp.arange(self.num_verify_states)[None, :]  # [B, J + 1]
      after = jnp.where((batch.num_draft > 0)[:, None] & (after < batch.q_lens[:, None]),
                        after, -1)
      columns = after if columns is None else jnp.concatenate([columns, after], axis=1)
    out, conv, delta, (conv_at, delta_at) = mix(inputs, conv, delta, batch.q_lens, columns)
    new = dict(conv_state=self.conv_state.at[layer, slots].set(conv),
               delta_state=self.delta_state.at[layer, slots].set(delta))
    if verify:
      j1 = self.num_verify_states
      new.update(verify_conv=self.verify_conv.at[layer, slots].set(conv_at[:, -j1:]),
                 verify_delta=self.verify_delta.at[layer, slots].set(delta_at[:, -j1:]))
      conv_at, delta_at = conv_at[:, :-j1], delta_at[:, :-j1]
    if snapshot:
      new.update(
          snapshot_conv=self.snapshot_conv.at[layer, targets].set(conv_at, mode="drop"),
          snapshot_delta=self.snapshot_delta.at[layer, targets].set(delta_at, mode="drop"))
    return self.replace(**new), out

  def keep_accepted(self, batch: StepBatch, accepted: jax.Array):
    """After verification: each verify row's slot state becomes the state after its last
    accepted column (accepted [B] drafts kept), dropping what its rejected drafts wrote."""
    if not self.num_verify_states:
      return self
    slots = batch.slot_ids
    keep = (batch.num_draft > 0)[None, :]  # [1, B]
    conv = self.verify_conv[:, slots, accepted]  # [Ll, B, Kc - 1, X]: after column base + a
    delta = self.verify_delta[:, slots, accepted]  # [Ll, B, Nv, Hk, Hv]
    return self.replace(
        conv_state=self.conv_state.at[:, slots].set(
            jnp.where(keep[..., None, None], conv, self.conv_state[:, slots])),
        delta_state=self.delta_state.at[:, slots].set(
            jnp.where(keep[..., None, None, None], delta, self.delta_state[:, slots])))

  def _captures(self, batch: StepBatch) -> tuple[jax.Array, jax.Array]:
    """(columns [B, Y], snapshots [B, Y]) of the page boundaries the rows' real columns
    reach: column t ends logical page (start + t + 1) / page_size - 1 when that is
    whole.  A boundary without a snapshot (or past q_lens) gets column -1 and target Q,
    which `.at[].set(mode="drop")` skips."""
    z = self.page_size
    t = batch.positions.shape[1]
    first = (-batch.starts - 1) % z  # [B] the first column ending a page
    columns = first[:, None] + z * jnp.arange(-(-t // z))[None, :]  # [B, Y]
    page = (batch.starts[:, None] + columns + 1) // z - 1
    targets = jnp.take_along_axis(batch.snapshot_tables,
                                  jnp.clip(page, 0, batch.snapshot_tables.shape[1] - 1), axis=1)
    keep = (columns < batch.q_lens[:, None]) & (targets >= 0)
    num_snapshots = self.snapshot_delta.shape[1]
    return jnp.where(keep, columns, -1), jnp.where(keep, targets, num_snapshots)


@struct.dataclass
class HybridPagedCache(RecurrentState, PagedKVCache):
  SNAPSHOT_ARRAYS = ("snapshot_conv", "snapshot_delta")
  GATHERS_ROWS = False  # its loops carry recurrent state the gathered copy does not

  conv_state: jax.Array = None  # [Ll, M, Kc - 1, X] model dtype
  delta_state: jax.Array = None  # [Ll, M, Nv, Hk, Hv] f32
  snapshot_conv: jax.Array = None  # [Ll, Q, Kc - 1, X] model dtype, prefix-cache snapshots
  snapshot_delta: jax.Array = None  # [Ll, Q, Nv, Hk, Hv] f32
  verify_conv: jax.Array = None  # [Ll, M, J + 1, Kc - 1, X] states after each verify column
  verify_delta: jax.Array = None  # [Ll, M, J + 1, Nv, Hk, Hv] f32 (speculation only)

  @property
  def num_verify_states(self) -> int:
    return 0 if self.verify_delta is None else self.verify_delta.shape[2]


@struct.dataclass
class HybridContiguousCache(RecurrentState, ContiguousKVCache):
  conv_state: jax.Array = None  # [Ll, M, Kc - 1, X] model dtype
  delta_state: jax.Array = None  # [Ll, M, Nv, Hk, Hv] f32


def state_arrays(cfg: ModelConfig, store: str, sizes: PoolSizes, paged: bool = True) -> dict:
  """The recurrent arrays of a hybrid's cache: per slot ("slot": conv states at `store`,
  the model dtype, and f32 delta states), paged only: `num_snapshots` prefix-cache
  snapshots ("snapshot") and, with speculation, `num_verify_states` = J + 1 states per
  slot ("verify")."""
  conv_shape, delta_shape = state_shapes(cfg, sizes.num_slots)
  arrays = {"conv_state": ArraySpec(conv_shape, store, role="slot"),
            "delta_state": ArraySpec(delta_shape, STATE_DTYPE, role="slot")}
  if not paged:
    if sizes.num_snapshots or sizes.num_verify_states:
      raise ValueError("prefix-cache snapshots and verify states need a paged cache")
    return arrays
  conv_snap, delta_snap = state_shapes(cfg, sizes.num_snapshots)
  arrays.update(snapshot_conv=ArraySpec(conv_snap, store, role="snapshot"),
                snapshot_delta=ArraySpec(delta_snap, STATE_DTYPE, role="snapshot"))
  if sizes.num_verify_states:
    verify = lambda shape: shape[:2] + (sizes.num_verify_states,) + shape[2:]
    arrays.update(verify_conv=ArraySpec(verify(conv_shape), store, role="verify"),
                  verify_delta=ArraySpec(verify(delta_shape), STATE_DTYPE, role="verify"))
  return arrays


def with_recurrent_state(kv, cfg: ModelConfig, store: str, sizes: PoolSizes):
  """A dense KV cache `kv` (paged or contiguous) -> its hybrid twin with zero states
  (`state_arrays` at `store`, the model dtype's short name)."""
  hybrid = {PagedKVCache: HybridPagedCache, ContiguousKVCache: HybridContiguousCache}[type(kv)]
  fields = {name: getattr(kv, name) for name in kv.__dataclass_fields__}
  return hybrid(**fields, **allocate(state_arrays(cfg, store, sizes,
                                                  paged=hybrid is HybridPagedCache)))


def check_hybrid_engine(*, speculative) -> None:
  """ValueError unless a draft model is dense (its cache is plain KV pages)."""
  draft = getattr(speculative, "config", None)
  if draft is not None and draft.is_hybrid:
    raise ValueError(f"speculative: draft model {draft.name!r} is a hybrid; draft models "
                     "must be dense (their cache is plain KV pages)")
