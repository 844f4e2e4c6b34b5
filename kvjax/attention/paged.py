"""Paged attention in pure jnp: gather each row's pages through its block table.

This is kvjax's reference backend (the default on CPU).  The batch layout is
padded, not ragged: q is [B, T, N, H] and row i of batch row b sits at position
`kv_lens[b] - T + i` (every row counted, padding rows included), so the block
table must cover `kv_lens[b]` tokens.  Pallas backends receive the same call
flattened into the ragged layout (see kvjax/backends.py).
"""
from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp

from kvjax.attention.dense import grouped_attention, padded_visibility

__all__ = ["paged_attention", "gather_pages", "gathered_attention"]


def gather_pages(pages: jax.Array, block_tables: jax.Array,
                 scales: Optional[jax.Array] = None) -> jax.Array:
  """pages [K, P, Z, H] gathered by block_tables [B, W] -> [K, B, W*Z, H] (f32 if scaled).

  Kv-head-major, the order `grouped_attention` multiplies in without a copy.
  """
  num_kv, _, g, h = pages.shape
  b, pmax = block_tables.shape
  gathered = pages[:, block_tables]  # [K, B, W, Z, H]
  if scales is not None:
    gathered = gathered.astype(jnp.float32) * scales[:, block_tables][..., None]
  return gathered.reshape(num_kv, b, pmax * g, h)


def gathered_attention(q: jax.Array, keys_t: jax.Array, values: jax.Array, kv_lens: jax.Array,
                       *, sm_scale: float, sliding_window: Optional[int] = None,
                       soft_cap: Optional[float] = None,
                       sinks: Optional[jax.Array] = None) -> jax.Array:
  """q [B, T, N, H]; keys_t [K, B, H, S], values [K, B, S, H] (row b's positions 0..S-1,
  gathered); kv_lens [B]; sinks [N] or None -> [B, T, N, H].  What paged attention runs after its gather; a
  decode loop that keeps its rows gathered (kvjax/caches/gathered.py) calls it directly."""
  b, t, n, h = q.shape
  num_kv = keys_t.shape[0]
  visible = padded_visibility(kv_lens, t, keys_t.shape[3], sliding_window)  # [B, T, S]
  qg = q.reshape(b, t, num_kv, n // num_kv, h).transpose(2, 0, 3, 1, 4)  # [K, B, Gq, T, H]
  out = grouped_attention(qg, keys_t, values, visible, sm_scale=sm_scale, soft_cap=soft_cap,
                          sinks=None if sinks is None else sinks.reshape(num_kv, -1))
  return out.transpose(1, 3, 0, 2, 4).reshape(b, t, n, h).astype(q.dtype)


def paged_attention(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array,
                    kv_lens: jax.Array, block_tables: jax.Array, *, sm_scale: float,
                    sliding_window: Optional[int] = None, soft_cap: Optional[float] = None,
                    k_scales: Optional[jax.Array] = None,
                    v_scales: Optional[jax.Array] = None,
                    sinks: Optional[jax.Array] = None) -> jax.Array:
  """q [B, T, N, H]; k/v_pages [K, P, Z, H]; kv_lens [B]; block_tables [B, W]; sinks [N] or
  None -> [B, T, N, H]."""
  keys = gather_pages(k_pages, block_tables, k_scales)  # [K, B, S, H]
  values = gather_pages(v_pages, block_tables, v_scales)
  keys_t = jnp.swapaxes(keys, 2, 3)  # [K, B, H, S]: one gather fusion writes it this way
  return gathered_attention(q, keys_t.astype(q.dtype) if k_scales is None else keys_t, values,
                            kv_lens, sm_scale=sm_scale, sliding_window=sliding_window,
                            soft_cap=soft_cap, sinks=sinks)
