"""`KIVIPagedKVCache`: int4 K/V pages in the KIVI style, page-compatible.

KIVI's observation: keys have outlier *channels*
(quantize them per channel, across tokens) while values do not (per token).  A
per-channel scale needs a group of tokens, so the group is a page:
  * tokens of a slot's current, incomplete page stay in full precision in a
    per-slot residual [Z, K, H] (KIVI's full-precision window of recent tokens,
    here the 0..Z-1 tokens since the last page boundary);
  * when a write completes a page, the page is quantized from the residual plus
    the new tokens: keys with one scale and offset per (page, head, channel),
    values with one per (token, head); it is never requantized afterwards.
    Both are affine, as in KIVI: each group's [min, max] split into 15 steps
    (kvjax/quant/affine.py), so a skewed group uses all 16 codes.
So only full pages are quantized, exactly the pages a prefix cache can share
(claim C8), and a page's codes do not depend on how the prompt was chunked.
Codes are packed two per int8 byte along H (kvjax/quant/symmetric.py), so the
values take the ledger's ideal 1/2 byte; scales and offsets add 8H/Z bytes per
token per head for keys (per page, amortized over Z tokens) and 8 for values, and the
residual a fixed L x M x Z x K x H x 2 floats independent of context length.
Registered as layout "int4" (kvjax/caches/layout.py).
"""
from __future__ import annotations

from typing import Optional

import functools

import jax
import jax.numpy as jnp
from flax import struct

from kvjax.attention.backends import Backend
from kvjax.attention.dense import masked_attention, padded_scores, padded_visibility
from kvjax.attention.variants import AttentionVariant
from kvjax.caches.layout import ArraySpec, KVLayout, PoolSizes, allocate, register, store_name
from kvjax.caches.paged import NULL_PAGE, PagedLayout, physical_pages
from kvjax.model.config import ModelConfig
from kvjax.quant.affine import quantize_affine
from kvjax.quant.symmetric import pack_int4, unpack_int4
from kvjax.runtime.step_batch import StepBatch

__all__ = ["KIVIPagedKVCache"]


@struct.dataclass
class KIVIPagedKVCache(PagedLayout):
  # Per-page arrays (kvjax/caches/paged.py copy_cache_pages); the residual belongs to a slot.
  PAGE_ARRAYS = ("k_pages", "v_pages", "k_scales", "v_scales", "k_offsets", "v_offsets")
  PAGE_AXIS = 2
  SLOT_ARRAYS = ("k_residual", "v_residual")
  # kv-head axes, split over tp (kvjax/parallel/sharding.py)
  HEAD_AXES = {**{name: 1 for name in PAGE_ARRAYS}, **{name: 3 for name in SLOT_ARRAYS}}

  k_pages: jax.Array  # [L, K, P, Z, H/2] int8, two int4 codes per byte
  v_pages: jax.Array  # [L, K, P, Z, H/2]
  k_scales: jax.Array  # [L, K, P, H] f32, per channel over the page's Z tokens
  v_scales: jax.Array  # [L, K, P, Z] f32, per token
  k_offsets: jax.Array  # [L, K, P, H] f32: key = code * scale + offset
  v_offsets: jax.Array  # [L, K, P, Z] f32
  k_residual: jax.Array  # [L, M, Z, K, H] the current incomplete page, full precision
  v_residual: jax.Array  # [L, M, Z, K, H]

  @classmethod
  def create(cls, num_layers: int, num_kv_heads: int, num_pages: int, page_size: int,
             head_dim: int, *, num_slots: int, residual_dtype) -> "KIVIPagedKVCache":
    return cls(**allocate(_arrays(num_layers, num_kv_heads, num_pages, page_size, head_dim,
                                  num_slots, store_name(residual_dtype))))

  def write(self, layer: int, k: jax.Array, v: jax.Array, batch: StepBatch):
    """Append k, v [B, T, K, H]; quantize every page this step completes.

    Per row, a buffer of whole pages starts at the page holding the row's first
    new token: the slot's residual, then the new tokens after it.  Buffer pages
    that end at or before the row's new length are quantized into the pool; the
    page holding the new length becomes the residual.  Rows of one batch must
    use distinct slots (rows with q_len 0 leave their slot untouched).
    """
    b, t = k.shape[:2]
    z = self.page_size
    start = batch.positions[:, 0]  # [B] tokens cached before this step
    end = start + batch.q_lens  # [B]
    base = start // z * z  # [B] first position of the buffer
    n_buf = (t - 1) // z + 2  # pages covering the residual plus T tokens
    rows = jnp.arange(b)[:, None]
    index = jnp.where(batch.valid, (start - base)[:, None] + jnp.arange(t)[None], n_buf * z)
    tail = lambda x: x.reshape((b, n_buf, z) + x.shape[2:])  # [B, n_buf, Z, K, H]

    def buffer(residual, new):
      buf = jnp.zeros((b, n_buf * z) + new.shape[2:], residual.dtype)
      buf = buf.at[:, :z].set(residual[layer, batch.slot_ids])
      return tail(buf.at[rows, index].set(new.astype(residual.dtype), mode="drop"))

    k_buf, v_buf = buffer(self.k_residual, k), buffer(self.v_residual, v)
    k_codes, k_scale, k_offset = quantize_affine(k_buf, 4, axis=2)  # [B, n_buf, K, H]
    v_codes, v_scale, v_offset = quantize_affine(v_buf, 4, axis=4)  # [B, n_buf, Z, K]
    first_page = base // z  # [B]
    logical = first_page[:, None] + jnp.arange(n_buf)[None]  # [B, n_buf]
    complete = (logical + 1) * z <= end[:, None]
    physical = jnp.where(complete, physical_pages(batch.block_tables, logical), NULL_PAGE)
    to_pages = lambda codes: pack_int4(codes.transpose(0, 1, 3, 2, 4))  # [B, n_buf, K, Z, H/2]
    current = (end - base) // z  # [B] buffer page that becomes the residual
    take = lambda buf: jnp.take_along_axis(buf, current[:, None, None, None, None], 1)[:, 0]
    slots = jnp.where(batch.q_lens > 0, batch.slot_ids, self.k_residual.shape[1])
    return self.replace(
        k_pages=self.k_pages.at[layer, :, physical].set(to_pages(k_codes)),
        v_pages=self.v_pages.at[layer, :, physical].set(to_pages(v_codes)),
        k_scales=self.k_scales.at[layer, :, physical].set(k_scale),
        v_scales=self.v_scales.at[layer, :, physical].set(v_scale.transpose(0, 1, 3, 2)),
        k_offsets=self.k_offsets.at[layer, :, physical].set(k_offset),
        v_offsets=self.v_offsets.at[layer, :, physical].set(v_offset.transpose(0, 1, 3, 2)),
        k_residual=self.k_residual.at[layer, slots].set(take(k_buf), mode="drop"),
        v_residual=self.v_residual.at[layer, slots].set(take(v_buf), mode="drop"))

  def read(self, layer: int, batch: StepBatch) -> tuple[jax.Array, jax.Array]:
    """Dequantized keys, values [B, W*Z, K, H] f32, the residual in its page."""
    tables = batch.block_tables  # [B, W]
    end = batch.positions[:, 0] + batch.q_lens
    is_residual = (jnp.arange(tables.shape[1])[None] == (end // self.page_size)[:, None])

    def gather(pages, scales, offsets, residual, scale_axis):
      codes = unpack_int4(pages[layer][:, tables]).astype(jnp.float32)  # [K, B, W, Z, H]
      per_group = lambda x: jnp.expand_dims(x[layer][:, tables], scale_axis)
      values = codes * per_group(scales) + per_group(offsets)
      values = values.transpose(1, 2, 3, 0, 4)  # [B, W, Z, K, H]
      recent = residual[layer, batch.slot_ids].astype(jnp.float32)[:, None]  # [B, 1, Z, K, H]
      values = jnp.where(is_residual[:, :, None, None, None], recent, values)
      return values.reshape((values.shape[0], -1) + values.shape[3:])

    return (gather(self.k_pages, self.k_scales, self.k_offsets, self.k_residual, 3),
            gather(self.v_pages, self.v_scales, self.v_offsets, self.v_residual, 4))

  def attend(self, layer: int, q, k, v, batch: StepBatch, *, sm_scale: float,
             backend: Backend, variant: Optional[AttentionVariant] = None):
    """Write k, v [B, T, K, H]; q [B, T, N, H] attends the dequantized pages densely
    (with the layer's attention variant's mask and score, its model window included)."""
    del backend  # dequantized here, attended densely
    cache = self.write(layer, k, v, batch)
    keys, values = cache.read(layer, batch)  # [B, S, K, H] f32
    t, s = q.shape[1], keys.shape[1]
    visible = padded_visibility(batch.kv_lens, t, s, variant)
    return cache, masked_attention(q, keys, values, visible, sm_scale=sm_scale,
                                   score_mod=padded_scores(batch.kv_lens, t, s, variant))


def _arrays(layers: int, num_kv: int, p: int, z: int, h: int, num_slots: int,
            store: str) -> dict:
  """Packed int4 pages, their scales and offsets (module doc), the per-slot residual at
  `store`."""
  if h % 2:
    raise ValueError(f"int4 KV packs pairs along head_dim; got odd head_dim {h}")
  pages = ArraySpec((layers, num_kv, p, z, h // 2), "int8")
  residual = ArraySpec((layers, num_slots, z, num_kv, h), store, role="slot")
  per_channel, per_token = (layers, num_kv, p, h), (layers, num_kv, p, z)
  return {"k_pages": pages, "v_pages": pages,
          "k_scales": ArraySpec(per_channel, "fp32", scales=True, fill=1),
          "v_scales": ArraySpec(per_token, "fp32", scales=True, fill=1),
          "k_offsets": ArraySpec(per_channel, "fp32", scales=True),
          "v_offsets": ArraySpec(per_token, "fp32", scales=True),
          "k_residual": residual, "v_residual": residual}


def kivi_arrays(cfg: ModelConfig, store: str, sizes: PoolSizes) -> dict:
  return _arrays(cfg.cache_layers(sizes.with_mtp), cfg.num_kv_heads, sizes.num_pages,
                 sizes.page_size, cfg.head_dim, sizes.num_slots, store)


register(KVLayout(
    "int4", kivi_arrays, KIVIPagedKVCache, variants=True,
    check_backend=functools.partial(Backend.check_kv_dtype, kv_dtype="int4"),
    no_speculation="a rejected draft that completed a page leaves the slot's full-precision "
                   "residual holding the wrong page; use kv_dtype='int8' or no speculation",
    no_token_prefix="a resumed page's leading tokens must sit in the slot's full-precision "
                    "residual, not in a copied, already-quantized page; use "
                    "prefix_match='block' or prefix_cache=False"))
