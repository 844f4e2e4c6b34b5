"""A projection with LoRA adapter slots: the leaf `layers.dense` adds each row's delta to.

Several adapters live on the device at once as slot tables: a [Sa, I, Ra] and
b [Sa, Ra, O], slot 0 all zeros (no adapter), ranks zero-padded to Ra, each
adapter's scaling (lora_alpha / r, or / sqrt(r) with rsLoRA) folded into its b.
A step gives each row its slot (`route`), so one step batches rows of
different adapters: y = dense(x, base) + (x a[slot]) b[slot] per row, the
gathered low-rank matmul of punica / S-LoRA.  The delta is added to the
projection's output, never merged into the base, so a quantized base keeps its
integer codes and the adapters stay float.
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
  a: jax.Array  # [Sa, I, Ra] down-projections; slot 0 zeros
  b: jax.Array  # [Sa, Ra, O] up-projections times each adapter's scaling; slot 0 zeros
  rows: Optional[jax.Array] = None  # [B] int32 slot of each row; None: slot 0 for all

  @property
  def shape(self) -> tuple:
    return self.base.shape


def lora_delta(x: jax.Array, w: LoraWeight, out_shape: tuple) -> jax.Array:
  """x [B, ..., *in] (contracted axes trailing) -> the rows' adapter deltas [B, ..., *out]
  in the adapters' dtype: (x a[rows[b]]) b[rows[b]] for each row b."""
  size_in = w.a.shape[1]
  x = x.reshape(x.shape[0], -1, size_in).astype(w.a.dtype)  # [B, T, I]
  low = jnp.matmul(x, w.a[w.rows])  # [B, T, Ra]
  return jnp.matmul(low, w.b[w.rows]).reshape(out_shape)  # [B, T, O] -> [B, ..., *out]


def _is_lora(node) -> bool:
  return isinstance(node, LoraWeight)


def route(params, rows: jax.Array):
  """params with every LoraWeight reading slot rows [B] for row b (None: slot 0 for all)."""
  return jax.tree_util.tree_map(lambda w: w.replace(rows=rows) if _is_lora(w) else w,
                                params, is_leaf=_is_lora)
