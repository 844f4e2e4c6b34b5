"""Paged attention in pure jnp: gather each row's pages through its block table.

This is kvjax's reference backend (the default on CPU).  The batch layout is
padded, not ragged: q is [B, T, N, H] and row i of batch row b sits at position
`kv_lens[b] - T + i` (every row counted, padding rows included), so the block
table must cover `kv_lens[b]` tokens.  Decode and verify steps (at most
DECODE_COLUMNS columns) gather every column of the table at once; prefill
chunks, and decode steps under a variant's kv_range (a sliding window, the
model's included), walk it a block at a time from the window's first block up to their
rows' lengths, after the blocks of the variant's leading keys (sinks)
(kvjax/attention/blocked.py), so their cost does not grow with the table's width.
Pallas backends receive the same call flattened into the ragged layout (see
kvjax/attention/backends.py).
"""
from __future__ import annotations

import functools
from typing import Optional

import jax
import jax.numpy as jnp

from kvjax.attention.blocked import block_pages, blocked_attention, query_tiles
from kvjax.attention.dense import grouped_attention, padded_scores, padded_visibility
from kvjax.attention.variants import AttentionVariant
from kvjax.model import invariance
from kvjax.runtime.xla_options import DECODE_COLUMNS

__all__ = ["paged_attention", "gather_pages", "gathered_attention", "gathered_blocks_attention",
           "padded_tables", "block_of"]


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
                       *, sm_scale: float, soft_cap: Optional[float] = None,
                       sinks: Optional[jax.Array] = None,
                       variant: Optional[AttentionVariant] = None) -> jax.Array:
  """q [B, T, N, H]; keys_t [K, B, H, S], values [K, B, S, H] (row b's positions 0..S-1,
  gathered); kv_lens [B]; sinks [N] or None; an attention variant or None -> [B, T, N, H].
  What paged attention runs after its gather; a decode loop that keeps its rows gathered
  (kvjax/caches/gathered.py) calls it directly, so it applies the variant too."""
  b, t, n, h = q.shape
  num_kv, s = keys_t.shape[0], keys_t.shape[3]
  visible = padded_visibility(kv_lens, t, s, variant)  # [B, T, S]
  qg = q.reshape(b, t, num_kv, n // num_kv, h).transpose(2, 0, 3, 1, 4)  # [K, B, Gq, T, H]
  out = grouped_attention(qg, keys_t, values, visible, sm_scale=sm_scale, soft_cap=soft_cap,
                          sinks=None if sinks is None else sinks.reshape(num_kv, -1),
                          score_mod=padded_scores(kv_lens, t, s, variant))
  return out.transpose(1, 3, 0, 2, 4).reshape(b, t, n, h).astype(q.dtype)


def paged_attention(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array,
                    kv_lens: jax.Array, block_tables: jax.Array, *, sm_scale: float,
                    layer: Optional[int] = None, soft_cap: Optional[float] = None,
                    k_scales: Optional[jax.Array] = None,
                    v_scales: Optional[jax.Array] = None,
                    sinks: Optional[jax.Array] = None,
                    q_lens: Optional[jax.Array] = None,
                    variant: Optional[AttentionVariant] = None) -> jax.Array:
  """q [B, T, N, H]; k/v_pages [K, P, Z, H], or every layer's [L, K, P, Z, H] with `layer`
  (scales likewise); kv_lens [B]; block_tables [B, W]; sinks [N] or None; q_lens [B] real
  columns (lets a windowed prefill skip what padding rows would pin); an attention variant
  (kvjax/attention/variants.py) or None -> [B, T, N, H].

  Given every layer's pages, a prefill chunk's block loop indexes the layer inside
  its body: slicing it out first would copy the layer's whole pool each call (a
  loop operand cannot fuse into the gather that reads it).
  """
  pick = (lambda x: x) if layer is None else (lambda x: None if x is None else x[layer])
  # Batch-invariant steps walk fixed blocks whatever the table width (kvjax/model/invariance.py).
  # A decode step under a variant's kv_range (a window, the model's included) walks from the
  # window's first block (after its leading keys' blocks, e.g. sinks): the gather would read
  # every column, released pages included, so its cost would grow with the context the
  # window hides.
  if q.shape[1] > DECODE_COLUMNS or invariance.is_on() or (
      variant is not None and variant.kv_range is not None):
    return _blocked(q, k_pages, v_pages, kv_lens, block_tables, q_lens, pick, sm_scale=sm_scale,
                    soft_cap=soft_cap, k_scales=k_scales, v_scales=v_scales, sinks=sinks,
                    variant=variant)
  k_pages, v_pages, k_scales, v_scales = map(pick, (k_pages, v_pages, k_scales, v_scales))
  keys = gather_pages(k_pages, block_tables, k_scales)  # [K, B, S, H]
  values = gather_pages(v_pages, block_tables, v_scales)
  keys_t = jnp.swapaxes(keys, 2, 3)  # [K, B, H, S]: one gather fusion writes it this way
  return gathered_attention(q, keys_t.astype(q.dtype) if k_scales is None else keys_t, values,
                            kv_lens, sm_scale=sm_scale, soft_cap=soft_cap, sinks=sinks,
                            variant=variant)


def padded_tables(block_tables: jax.Array, pages_per_block: int) -> tuple[jax.Array, int]:
  """block_tables [B, W] -> (the table widened with null pages to whole blocks of
  pages_per_block, its number of blocks)."""
  w = block_tables.shape[1]
  num_blocks = -(-w // pages_per_block)
  return jnp.pad(block_tables, ((0, 0), (0, num_blocks * pages_per_block - w))), num_blocks


def block_of(tables: jax.Array, c: jax.Array, pages_per_block: int) -> jax.Array:
  """Columns of KV block c of a padded_tables table -> [B, Wb]."""
  return jax.lax.dynamic_slice_in_dim(tables, c * pages_per_block, pages_per_block, axis=1)


def gathered_blocks_attention(q: jax.Array, keys_t: jax.Array, values: jax.Array,
                              kv_lens: jax.Array, q_lens: Optional[jax.Array] = None, *,
                              page_size: int, sm_scale: float,
                              soft_cap: Optional[float] = None, sinks: Optional[jax.Array] = None,
                              variant: Optional[AttentionVariant] = None) -> jax.Array:
  """gathered_attention's batch-invariant form: keys_t [K, B, H, S], values [K, B, S, H]
  (S whole blocks of pages of page_size: decode_loop_cache gathers padded_tables) walked
  in the fixed blocks a batch-invariant step reads its pages in -> [B, T, N, H].  A decode
  loop's step then does the arithmetic of a step that reads pages, without the per-layer
  gather of every step."""
  block_size = block_pages(page_size) * page_size

  def read_block(c):
    start = c * block_size
    return (jax.lax.dynamic_slice_in_dim(keys_t, start, block_size, axis=3),
            jax.lax.dynamic_slice_in_dim(values, start, block_size, axis=2))

  return _walk(q, read_block, kv_lens, q_lens, keys_t.shape[0], keys_t.shape[3] // block_size,
               block_size, values.shape[-1], sm_scale=sm_scale, soft_cap=soft_cap, sinks=sinks,
               variant=variant)


def _blocked(q, k_pages, v_pages, kv_lens, block_tables, q_lens, pick, *, sm_scale, soft_cap,
             k_scales, v_scales, sinks, variant):
  """paged_attention of a prefill chunk, block by block (kvjax/attention/blocked.py);
  pick(array) -> the layer's [K, P, Z, ...] (indexed inside the loop body)."""
  page_size = k_pages.shape[-2]
  wb = block_pages(page_size)
  tables, num_blocks = padded_tables(block_tables, wb)

  def read_block(c):
    columns = block_of(tables, c, wb)
    keys_t = jnp.swapaxes(gather_pages(pick(k_pages), columns, pick(k_scales)), 2, 3)
    return (keys_t.astype(q.dtype) if k_scales is None else keys_t,  # [K, B, H, Sb]
            gather_pages(pick(v_pages), columns, pick(v_scales)))

  return _walk(q, read_block, kv_lens, q_lens, k_pages.shape[-4], num_blocks, wb * page_size,
               v_pages.shape[-1], sm_scale=sm_scale, soft_cap=soft_cap, sinks=sinks,
               variant=variant)


def _walk(q, read_block, kv_lens, q_lens, num_kv, num_blocks, block_size, value_dim, *,
          sm_scale, soft_cap, sinks, variant):
  """q [B, T, N, H] attending read_block(c)'s K kv heads block by block (batch-invariant
  steps: ROW_TILE query columns at a time) -> [B, T, N, Hv]."""
  b, t, n, h = q.shape
  qg = q.reshape(b, t, num_kv, n // num_kv, h).transpose(2, 0, 3, 1, 4)  # [K, B, Gq, T, H]
  attend = functools.partial(blocked_attention, read_block=read_block, q_lens=q_lens,
                             num_blocks=num_blocks, block_size=block_size,
                             sm_scale=sm_scale, soft_cap=soft_cap, value_dim=value_dim,
                             sinks=None if sinks is None else sinks.reshape(num_kv, -1),
                             variant=variant)
  out = query_tiles(attend, qg, kv_lens) if invariance.is_on() and t > 1 else \
      attend(qg, kv_lens=kv_lens)
  return out.transpose(1, 3, 0, 2, 4).reshape(b, t, n, -1).astype(q.dtype)
