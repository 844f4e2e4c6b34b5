"""`ContiguousKVCache`: one max-length K/V buffer per slot, the baseline paging replaces
(claim C7's ~60% waste).  Same `attend` contract as the paged caches; no pages,
so the backend is not needed (the StepBatch's block tables are [B, 0])."""
from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp
from flax import struct

from kvjax.attention.dense import masked_attention, padded_scores, padded_visibility
from kvjax.attention.variants import AttentionVariant
from kvjax.runtime.step_batch import StepBatch

__all__ = ["ContiguousKVCache"]


@struct.dataclass
class ContiguousKVCache:
  k: jax.Array  # [L, M, S, K, H]
  v: jax.Array  # [L, M, S, K, Hv]

  @classmethod
  def create(cls, num_layers: int, num_kv_heads: int, num_slots: int, max_len: int,
             head_dim: int, dtype, value_dim: Optional[int] = None) -> "ContiguousKVCache":
    shape = (num_layers, num_slots, max_len, num_kv_heads)
    return cls(k=jnp.zeros(shape + (head_dim,), dtype),
               v=jnp.zeros(shape + (value_dim or head_dim,), dtype))

  def attend(self, layer: int, q, k, v, batch: StepBatch, *, sm_scale: float,
             backend=None, sinks: Optional[jax.Array] = None,
             variant: Optional[AttentionVariant] = None):
    """Write k [B, T, K, H], v [B, T, K, Hv] into each row's slot; q attends the slot's
    buffer (`sinks` [N]: a layer kind's learned sink logits, kvjax/model/learned_sinks.py;
    `variant`: the layer's attention variant's mask and score, kvjax/attention/variants.py,
    its model window included)."""
    del backend  # a contiguous buffer needs no page gather
    slots = batch.slot_ids[:, None]  # [B, 1]
    # Padding columns land past the buffer end and are dropped.
    positions = jnp.where(batch.valid, batch.positions, self.k.shape[2])
    cache = self.replace(
        k=self.k.at[layer, slots, positions].set(k.astype(self.k.dtype), mode="drop"),
        v=self.v.at[layer, slots, positions].set(v.astype(self.v.dtype), mode="drop"))
    keys = cache.k[layer, batch.slot_ids]  # [B, S, K, H]
    values = cache.v[layer, batch.slot_ids]
    t, s = q.shape[1], keys.shape[1]
    visible = padded_visibility(batch.kv_lens, t, s, variant)
    return cache, masked_attention(q, keys, values, visible, sm_scale=sm_scale, sinks=sinks,
                                   score_mod=padded_scores(batch.kv_lens, t, s, variant))
