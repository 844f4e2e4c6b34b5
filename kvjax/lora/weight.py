"""A projection with LoRA adapter slots: the leaf `layers.dense` adds each row's delta to.

Several adapters live on the device at once as slot tables: a [I, (Sa - 1) * Ra] and
b [(Sa - 1) * Ra, O], slot s >= 1 in rows/columns (s - 1) Ra .. s Ra, ranks zero-padded
to Ra, each adapter's scaling (lora_alpha / r, or / sqrt(r) with rsLoRA) folded into its
b; slot 0 (no adapter) has no columns.  A step gives each row its slot (`route`), so one
step batches rows of different adapters: y = dense(x, base) + (x a[slot]) b[slot] per
row.  Every row goes through every slot's down-projection at once, x a, one plain matmul
[N, I] @ [I, (Sa - 1) * Ra], whose columns of slots other than the row's own are zeroed
before the up-projection: with few slots of small rank (Sa Ra well under I and O) that
is cheaper than gathering each row's a[slot] and b[slot] and multiplying row by row
(punica / S-LoRA's gathered matmul), which XLA:CPU runs as small batched matmuls.  The
delta is added to the projection's output, never merged into the base, so a quantized
base keeps its integer codes and the adapters stay float.
"""
from __future__ import annotations

from typing import Any, Optional

import jax
import jax.numpy as jnp
from flax import struct

__all__ = ["LoraWeight", "lora_delta", "route"]


@struct.dataclass
class LoraWeight:
  base: Any  # [*in, *out] float array or QuantizedWeight
  a: jax.Array  # [I, (Sa - 1) * Ra] down-projections of slots 1.. side by side
  b: jax.Array  # [(Sa - 1) * Ra, O] up-projections times each adapter's scaling
  rank: int = struct.field(pytree_node=False)  # Ra: each slot's columns
  rows: Optional[jax.Array] = None  # [B] int32 slot of each row; None: slot 0 for all

  @property
  def shape(self) -> tuple:
    return self.base.shape

  @property
  def num_slots(self) -> int:
    """Sa: the slots, slot 0 (no adapter, no columns) included."""
    return self.a.shape[1] // self.rank + 1


def lora_delta(x: jax.Array, w: LoraWeight, out_shape: tuple) -> jax.Array:
  """x [B, ..., *in] (contracted axes trailing) -> the rows' adapter deltas [B, ..., *out]
  in the adapters' dtype: (x a[rows[b]]) b[rows[b]] for each row b."""
  size_in = w.a.shape[0]
  x = x.reshape(x.shape[0], -1, size_in).astype(w.a.dtype)  # [B, T, I]
  low = jnp.matmul(x.reshape(-1, size_in), w.a).reshape(x.shape[:2] + (-1,))
  column_slot = jnp.arange(w.a.shape[1], dtype=jnp.int32) // w.rank + 1  # [(Sa - 1) * Ra]
  own = w.rows[:, None, None] == column_slot  # [B, 1, (Sa - 1) * Ra]
  low = jnp.where(own, low, 0).reshape(-1, w.a.shape[1])
  return jnp.matmul(low, w.b).reshape(out_shape)  # [B T, O] -> [B, ..., *out]


def _is_lora(node) -> bool:
  return isinstance(node, LoraWeight)


def route(params, rows: jax.Array):
  """params with every LoraWeight reading slot rows [B] for row b (None: slot 0 for all)."""
  return jax.tree_util.tree_map(lambda w: w.replace(rows=rows) if _is_lora(w) else w,
                                params, is_leaf=_is_lora)
