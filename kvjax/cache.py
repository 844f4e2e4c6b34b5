"""KV cache pytrees and the `attend` that writes new K/V then attends over them.

Two layouts, one contract (`cache, out = cache.attend(layer, q, k, v, batch, ...)`):

* `PagedKVCache`: fixed-size pages shared by all sequences; each sequence's
  block table maps logical page i to a physical page (claim C7).  Page 0 is the
  null page: padding rows write there and unused block-table entries point
  there, so nothing real is ever overwritten by padding.
* `ContiguousKVCache`: one max-length buffer per slot, the baseline that
  PagedAttention replaces (claim C7's ~60% waste).
"""
from __future__ import annotations

from typing import Callable, Optional

import jax
import jax.numpy as jnp
from flax import struct

from kvjax.attention.dense import masked_attention, visibility_mask
from kvjax.pages import NULL_PAGE
from kvjax.quant.symmetric import quantize

__all__ = ["StepBatch", "PagedKVCache", "ContiguousKVCache", "NULL_PAGE", "copy_cache_pages"]



@struct.dataclass
class StepBatch:
  """Where the rows of one step sit.  Row i of batch row b is at positions[b, i]."""
  slot_ids: jax.Array  # [B] int32 state slot of each batch row
  q_lens: jax.Array  # [B] int32 real (non-padding) query rows
  positions: jax.Array  # [B, T] int32 = context_len + i
  kv_lens: jax.Array  # [B] int32 = context_len + T (every row counted, padding too)
  block_tables: jax.Array  # [B, Pmax] int32 (paged only; [B, 0] otherwise)

  @property
  def valid(self) -> jax.Array:
    """[B, T] bool: row holds a real token."""
    return jnp.arange(self.positions.shape[1])[None, :] < self.q_lens[:, None]


@struct.dataclass
class PagedKVCache:
  """Float pages, or int8 pages with one f32 scale per token per kv head (symmetric).

  int8 is the layout the Pallas kernel reads (claim C6: half of bf16's bytes plus
  4 B of scale per token per head); int4 lives in kvjax/quant/kv.py.
  """
  PAGE_ARRAYS = ("k_pages", "v_pages", "k_scales", "v_scales")  # see copy_cache_pages
  PAGE_AXIS = 2
  k_pages: jax.Array  # [L, K, P, G, H]
  v_pages: jax.Array  # [L, K, P, G, H]
  k_scales: Optional[jax.Array] = None  # [L, K, P, G] f32 (int8 pages only)
  v_scales: Optional[jax.Array] = None  # [L, K, P, G] f32

  @classmethod
  def create(cls, num_layers: int, num_kv_heads: int, num_pages: int, page_size: int,
             head_dim: int, dtype) -> "PagedKVCache":
    """`dtype` int8 quantizes every write; any float dtype stores K/V as is."""
    shape = (num_layers, num_kv_heads, num_pages, page_size, head_dim)
    scales = lambda: jnp.ones(shape[:-1], jnp.float32) if jnp.dtype(dtype) == jnp.int8 else None
    return cls(k_pages=jnp.zeros(shape, dtype), v_pages=jnp.zeros(shape, dtype),
               k_scales=scales(), v_scales=scales())  # distinct buffers: both are donated

  @property
  def page_size(self) -> int:
    return self.k_pages.shape[3]

  @property
  def num_pages(self) -> int:
    return self.k_pages.shape[2]

  def write(self, layer: int, k: jax.Array, v: jax.Array, batch: StepBatch) -> "PagedKVCache":
    """Scatter k, v [B, T, K, H] to their slots; padding rows go to the null page."""
    g = self.page_size
    logical = jnp.clip(batch.positions // g, 0, batch.block_tables.shape[1] - 1)
    pages = jnp.take_along_axis(batch.block_tables, logical, axis=1)  # [B, T]
    pages = jnp.where(batch.valid, pages, NULL_PAGE)
    offsets = batch.positions % g  # [B, T]
    if self.k_scales is None:
      return self.replace(
          k_pages=self.k_pages.at[layer, :, pages, offsets].set(k.astype(self.k_pages.dtype)),
          v_pages=self.v_pages.at[layer, :, pages, offsets].set(v.astype(self.v_pages.dtype)))
    (k, k_scale), (v, v_scale) = quantize(k, 8, -1), quantize(v, 8, -1)  # scales [B, T, K]
    return self.replace(
        k_pages=self.k_pages.at[layer, :, pages, offsets].set(k),
        v_pages=self.v_pages.at[layer, :, pages, offsets].set(v),
        k_scales=self.k_scales.at[layer, :, pages, offsets].set(k_scale),
        v_scales=self.v_scales.at[layer, :, pages, offsets].set(v_scale))

  def attend(self, layer: int, q, k, v, batch: StepBatch, *, sm_scale: float,
             window: Optional[int], backend: Callable):
    cache = self.write(layer, k, v, batch)
    scales = {} if cache.k_scales is None else dict(k_scales=cache.k_scales[layer],
                                                     v_scales=cache.v_scales[layer])
    out = backend(q, cache.k_pages[layer], cache.v_pages[layer], batch.kv_lens,
                  batch.block_tables, sm_scale=sm_scale, sliding_window=window, **scales)
    return cache, out


def copy_cache_pages(cache, src: jax.Array, dst: jax.Array):
  """Copy pages src [C] -> dst [C], every layer, in each array of `cache.PAGE_ARRAYS`.

  A paged cache lists its per-page arrays (pages, scales; None ones are
  skipped) and their page axis `PAGE_AXIS`; per-slot state is not a page and
  is left alone.
  """
  lead = (slice(None),) * cache.PAGE_AXIS

  def copy(x):
    return None if x is None else x.at[lead + (dst,)].set(x[lead + (src,)])

  return cache.replace(**{name: copy(getattr(cache, name)) for name in cache.PAGE_ARRAYS})


@struct.dataclass
class ContiguousKVCache:
  k: jax.Array  # [L, slots, S, K, H]
  v: jax.Array  # [L, slots, S, K, H]

  @classmethod
  def create(cls, num_layers: int, num_kv_heads: int, num_slots: int, max_len: int,
             head_dim: int, dtype) -> "ContiguousKVCache":
    shape = (num_layers, num_slots, max_len, num_kv_heads, head_dim)
    return cls(k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype))

  def attend(self, layer: int, q, k, v, batch: StepBatch, *, sm_scale: float,
             window: Optional[int], backend: Callable = None):
    del backend  # a contiguous buffer needs no page gather
    slots = batch.slot_ids[:, None]  # [B, 1]
    # Padding rows land past the buffer end and are dropped.
    positions = jnp.where(batch.valid, batch.positions, self.k.shape[2])
    cache = self.replace(
        k=self.k.at[layer, slots, positions].set(k.astype(self.k.dtype), mode="drop"),
        v=self.v.at[layer, slots, positions].set(v.astype(self.v.dtype), mode="drop"))
    keys = cache.k[layer, batch.slot_ids]  # [B, S, K, H]
    values = cache.v[layer, batch.slot_ids]
    s = keys.shape[1]
    k_positions = jnp.broadcast_to(jnp.arange(s)[None], (keys.shape[0], s))
    visible = visibility_mask(batch.positions, k_positions,
                              k_positions < batch.kv_lens[:, None], window)
    return cache, masked_attention(q, keys, values, visible, sm_scale=sm_scale)
