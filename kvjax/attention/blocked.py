"""Attention over a row's pages block by block, with an online softmax: what a prefill
chunk reads costs its rows' lengths, not the width of their block tables.

The reference backend's gather (kvjax/attention/paged.py) reads every column of
a block table, so the packing buckets table widths (kvjax/engine/sched/batching.py), and with
the gather alone each prefill chunk shape compiled once per width (96 of the
default server's 101 step programs).  Here a `lax.fori_loop` walks the table Wb
pages at a time, from the first block a row's window still sees to the last one
its kv_lens reach (both traced), keeping each query's running max, denominator
and weighted sum.  A
prefill program can then take the widest table whatever its rows hold: one
program per chunk shape.  Decode and verify steps (a few columns) keep the one
gather, which their short loops would not beat (kvjax/runtime/xla_options.py DECODE_COLUMNS),
unless a variant's kv_range bounds them (a sliding window, the model's included): then the
walk reads the window, not the whole table.

A block that a query sees nothing of leaves its state exactly as it was (weights
exp(-inf) = 0, rescale exp(0) = 1), so a query's result does not depend on how
many blocks its batch walks.  The attention variant (kvjax/attention/variants.py; the
model's sliding window is one, `layer_variant`) decides what each query sees; its kv_range
starts the walk at its first block, after a first walk over the blocks of its leading keys
(attention sinks): the blocks between are never read.
Learned sinks start each denominator at exp(0) with the sink as the running max.
Shapes: docs/DIMENSIONS.md.
"""
from __future__ import annotations

from typing import Callable, Optional

import jax
import jax.numpy as jnp

from kvjax.attention.variants import AttentionVariant, first_key, variant_mask, variant_scores
from kvjax.model.invariance import ROW_TILE

__all__ = ["BLOCK_TOKENS", "block_pages", "blocked_attention", "query_tiles"]

# Key positions a block covers at least (Wb = BLOCK_TOKENS / Z pages, one page at least).
BLOCK_TOKENS = 128


def block_pages(page_size: int) -> int:
  """Wb: pages of one KV block."""
  return max(1, BLOCK_TOKENS // page_size)


def blocked_attention(qg: jax.Array, read_block: Callable[[jax.Array], tuple],
                      kv_lens: jax.Array, q_lens: Optional[jax.Array], num_blocks: int,
                      block_size: int, *, sm_scale: float, soft_cap: Optional[float] = None,
                      sinks: Optional[jax.Array] = None,
                      value_dim: int, variant: Optional[AttentionVariant] = None) -> jax.Array:
  """qg [K, B, Gq, T, H]; read_block(c) -> (k_t [K, B, H, Sb], v [K, B, Sb, Hv]) of key
  positions c*Sb .. (c+1)*Sb - 1 (Sb = block_size); kv_lens [B] (padded layout: query t
  of row b at kv_lens[b] - T + t); q_lens [B] real columns (None: every row real); at
  most num_blocks blocks; sinks [K, Gq] or None; an attention variant or None
  -> f32 [K, B, Gq, T, Hv].

  Walks blocks first..last (traced): last covers the longest row, first is the
  earliest block the variant's kv_range lets a real row reach (0 without); the blocks of
  the variant's leading keys before it.
  """
  num_kv, b, group, t, h = qg.shape
  q_positions = kv_lens[:, None] - t + jnp.arange(t)[None, :]  # [B, T]
  last = jnp.minimum(-(-jnp.max(kv_lens) // block_size), num_blocks)
  first = jnp.zeros((), jnp.int32)
  earliest = first_key(variant, q_positions)  # [B] or None: keys before it are hidden
  if earliest is not None:
    if q_lens is not None:  # padding rows (start 0) would pin the walk at block 0
      earliest = jnp.where(q_lens > 0, earliest, jnp.iinfo(jnp.int32).max)
    first = jnp.minimum(jnp.min(earliest) // block_size, last)
  q = qg.reshape(num_kv, b, group * t, h)

  def body(c, carry):
    row_max, denom, acc = carry  # [K, B, Gq, T, 1] x2, [K, B, Gq, T, Hv]
    k_t, v = read_block(c)
    scores = jnp.einsum("kbih,kbhs->kbis", q, k_t, preferred_element_type=jnp.float32)
    scores = scores.reshape(num_kv, b, group, t, -1) * sm_scale  # [K, B, Gq, T, Sb]
    if soft_cap is not None:
      scores = soft_cap * jnp.tanh(scores / soft_cap)
    k_positions = c * block_size + jnp.arange(scores.shape[-1])  # [Sb]
    score_mod = variant_scores(variant, q_positions, k_positions[None])
    if score_mod is not None:
      scores = score_mod(scores)
    visible = (k_positions[None, None] <= q_positions[:, :, None]) & (
        k_positions[None, None] < kv_lens[:, None, None])  # [B, T, Sb]
    masked = variant_mask(variant, q_positions[:, :, None], k_positions[None, None])
    if masked is not None:
      visible &= masked
    scores = jnp.where(visible[None, :, None], scores, -jnp.inf)
    new_max = jnp.maximum(row_max, jnp.max(scores, axis=-1, keepdims=True))
    shift = jnp.where(jnp.isfinite(new_max), new_max, 0.0)
    rescale = jnp.exp(row_max - shift)  # 0 while nothing was seen, 1 if the max held
    weights = jnp.exp(scores - shift)  # exactly 0 where not visible
    out = jnp.einsum("kbis,kbsh->kbih", weights.reshape(num_kv, b, group * t, -1),
                     v.astype(jnp.float32)).reshape(num_kv, b, group, t, -1)
    return (new_max, denom * rescale + jnp.sum(weights, axis=-1, keepdims=True),
            acc * rescale + out)

  stats = (num_kv, b, group, t, 1)
  if sinks is None:
    row_max, denom = jnp.full(stats, -jnp.inf, jnp.float32), jnp.zeros(stats, jnp.float32)
  else:  # a key every query sees, whose value is zero
    row_max = jnp.broadcast_to(sinks.astype(jnp.float32)[:, None, :, None, None], stats)
    denom = jnp.ones(stats, jnp.float32)
  acc = jnp.zeros((num_kv, b, group, t, value_dim), jnp.float32)
  carry = (row_max, denom, acc)
  leading = 0 if variant is None else variant.leading_keys
  if leading and earliest is not None:  # the leading keys' blocks before the window's
    leading_blocks = -(-leading // block_size)
    carry = jax.lax.fori_loop(0, jnp.minimum(leading_blocks, first), body, carry)
  _, denom, acc = jax.lax.fori_loop(first, last, body, carry)
  return acc / jnp.where(denom == 0.0, 1.0, denom)


def query_tiles(attend: Callable[..., jax.Array], qg: jax.Array, kv_lens: jax.Array
                ) -> jax.Array:
  """attend(q [K, B, Gq, ROW_TILE, H], kv_lens=) over qg [K, B, Gq, T, H]'s columns
  ROW_TILE at a time -> f32 [K, B, Gq, T, Hv]: every query's scores and weighted sums
  are the same matmul shapes whatever T (batch-invariant steps, kvjax/model/invariance.py).
  Columns padded in front sit at earlier positions (their output is dropped); a tile
  ending at column e reads as if its row's length were kv_lens - T + e: the keys
  past it are ones no query of the tile sees."""
  num_kv, b, group, t, h = qg.shape
  pad = -t % ROW_TILE
  tiles = (t + pad) // ROW_TILE
  padded = jnp.pad(qg, ((0, 0), (0, 0), (0, 0), (pad, 0), (0, 0)))
  q = jnp.moveaxis(padded.reshape(num_kv, b, group, tiles, ROW_TILE, h), 3, 0)
  # Each tile's row lengths: one row per tile, one column per batch row.
  ends = kv_lens[None, :] - t + ROW_TILE * jnp.arange(1, tiles + 1)[:, None] - pad
  out = jax.lax.map(lambda tile: attend(tile[0], kv_lens=tile[1]), (q, ends))
  return jnp.moveaxis(out, 0, 3).reshape(num_kv, b, group, t + pad, -1)[:, :, :, pad:]
