"""Hybrid caches: per-slot recurrent state beside the KV of the full-attention layers.

A hybrid model (Qwen3.5, Qwen3-Next; kvjax/hybrid.py) has two kinds of layer.
Its full-attention layers cache K/V exactly as a dense model's do (pages, or a
contiguous buffer), indexed by their row among the attention layers; its Gated
DeltaNet layers keep, per slot, a conv state (the last Kc - 1 conv inputs) and
a delta-rule state [Nv, Hk, Hv] that do not grow with the context.  One record
holds both and keeps the one contract:

  cache, out = cache.attend(layer, q, k, v, batch, *, sm_scale, window, backend)

for attention layers (the KV base class's attend), while a linear layer passes
its LinearInputs (kvjax/attention/gated_delta.py) as q, with k = v = None,
and `layer` its row among the linear layers; that goes to `linear_attend`,
which reads the rows' slots, runs the rule and writes the new states back.

A row whose step starts at position 0 with real columns is a new (or a
preempted, recomputed) request: it starts from zero states whatever its slot
held.  Padding columns and rows leave the states as they were.  The states are
`SLOT_ARRAYS` (slots on axis 1, after the layer axis), so a failed request's
slot is cleared like an int4 residual (kvjax/caches/paged.py clear_cache_pages).

What a state cannot do: resume mid-sequence from anything but its own last
step.  A prefix-cache hit (KV pages computed by another request) or a
rejected speculative draft (state already advanced past it) would need state
snapshots or rollback, which are not kept; `check_hybrid_engine` refuses those
engine options for hybrid models.

  Ll linear layers, M slots, Kc conv width, X conv channels, Nv value heads,
  Hk / Hv key / value head dims.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from kvjax.attention.gated_delta import LinearInputs, gated_delta_mix
from kvjax.caches.contiguous import ContiguousKVCache
from kvjax.caches.paged import PagedKVCache
from kvjax.config import ModelConfig
from kvjax.step_batch import StepBatch

__all__ = ["RecurrentState", "HybridPagedCache", "HybridContiguousCache", "state_shapes",
           "with_recurrent_state", "check_hybrid_engine"]

STATE_DTYPE = jnp.float32  # the delta-rule state accumulates over the whole context


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

  def attend(self, layer: int, q, k, v, batch: StepBatch, **attention):
    """Attention layers: the KV cache's attend; linear layers (q a LinearInputs): the rule."""
    if isinstance(q, LinearInputs):
      return self.linear_attend(layer, q, batch)
    return super().attend(layer, q, k, v, batch, **attention)

  def linear_attend(self, layer: int, inputs: LinearInputs, batch: StepBatch):
    """Run linear layer `layer` on the rows' slot states -> (cache, out [B, T, Nv, Hv] f32)."""
    slots = batch.slot_ids
    fresh = (batch.starts == 0) & (batch.q_lens > 0)  # [B] a request's first step
    conv = jnp.where(fresh[:, None, None], 0, self.conv_state[layer, slots])
    delta = jnp.where(fresh[:, None, None, None], 0, self.delta_state[layer, slots])
    out, conv, delta = gated_delta_mix(inputs, conv, delta, batch.q_lens)
    return self.replace(conv_state=self.conv_state.at[layer, slots].set(conv),
                        delta_state=self.delta_state.at[layer, slots].set(delta)), out


@struct.dataclass
class HybridPagedCache(RecurrentState, PagedKVCache):
  conv_state: jax.Array = None  # [Ll, M, Kc - 1, X] model dtype
  delta_state: jax.Array = None  # [Ll, M, Nv, Hk, Hv] f32


@struct.dataclass
class HybridContiguousCache(RecurrentState, ContiguousKVCache):
  conv_state: jax.Array = None  # [Ll, M, Kc - 1, X] model dtype
  delta_state: jax.Array = None  # [Ll, M, Nv, Hk, Hv] f32


def with_recurrent_state(kv, cfg: ModelConfig, num_slots: int, dtype):
  """A dense KV cache `kv` (paged or contiguous) -> its hybrid twin with zero states."""
  hybrid = {PagedKVCache: HybridPagedCache, ContiguousKVCache: HybridContiguousCache}[type(kv)]
  conv_shape, delta_shape = state_shapes(cfg, num_slots)
  fields = {name: getattr(kv, name) for name in kv.__dataclass_fields__}
  return hybrid(**fields, conv_state=jnp.zeros(conv_shape, dtype),
                delta_state=jnp.zeros(delta_shape, STATE_DTYPE))


def check_hybrid_engine(cfg: ModelConfig, *, speculative, prefix_cache: bool) -> None:
  """ValueError naming the option an engine cannot yet combine with a hybrid model."""
  draft = getattr(speculative, "config", None)
  if draft is not None and draft.is_hybrid:
    raise ValueError(f"speculative: draft model {draft.name!r} is a hybrid; draft models "
                     "must be dense (their cache is plain KV pages)")
  if not cfg.is_hybrid:
    return
  if speculative is not None:
    drafter = speculative if isinstance(speculative, str) else "a draft model"
    raise ValueError(
        f"speculative={drafter!r} is not supported for hybrid model {cfg.name!r}: a rejected "
        "draft would leave its linear layers' recurrent state advanced past the accepted "
        "tokens (no state rollback yet); use speculative=None")
  if prefix_cache:
    raise ValueError(
        f"prefix_cache=True is not supported for hybrid model {cfg.name!r}: a prefix hit "
        "reuses KV pages but its linear layers would need the recurrent state at the hit "
        "boundary (no state snapshots yet); use prefix_cache=False")
