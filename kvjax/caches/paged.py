"""`PagedKVCache`: fixed-size K/V pages shared by every sequence (claim C7).

Each row's block table maps its logical page i to a physical page.  Page 0 is
the null page: padding columns write there and unused block-table entries
point there, so padding never overwrites anything real.  Float pages store K/V
as they are; int8 pages add one f32 scale per token per kv head (symmetric,
claim C6: half of bf16's bytes plus 4 B per token per head), the layout every
built-in backend reads.  int4 pages are kvjax/caches/kivi.py.

The page lookup every paged cache shares is here: `physical_pages` (logical
page -> physical page through the block table) and `token_slots` (each
column's page and offset, padding sent to the null page).  The layouts "float"
(the model dtype, the default), "fp32", "bf16", "fp16" and "int8" are
registered at the end (kvjax/caches/layout.py), and the alias "streaming": float
pages under StreamingLLM's 4 attention sinks + 1020 recent tokens (`variant_layout`
names any attention variant as a kv_dtype).
"""
from __future__ import annotations

from typing import Optional

import dataclasses
import functools

import jax
import jax.numpy as jnp
from flax import struct

from kvjax.attention.backends import Backend
from kvjax.attention.variants import AttentionVariant, sinks_window
from kvjax.caches.contiguous import ContiguousKVCache
from kvjax.caches.layout import ArraySpec, KVLayout, PoolSizes, allocate, register, store_name
from kvjax.engine.sched.pages import NULL_PAGE
from kvjax.model.config import ModelConfig
from kvjax.quant.symmetric import quantize
from kvjax.runtime.step_batch import StepBatch

__all__ = ["PagedKVCache", "PagedLayout", "NULL_PAGE", "physical_pages", "token_slots",
           "copy_cache_pages", "clear_cache_pages", "kv_page_arrays", "variant_layout"]


def physical_pages(block_tables: jax.Array, logical: jax.Array) -> jax.Array:
  """block_tables [B, W], logical page ids (B rows, any count) -> physical page ids of the
  same shape (logical ids clipped into W)."""
  logical = jnp.clip(logical, 0, block_tables.shape[1] - 1)
  return jnp.take_along_axis(block_tables, logical, axis=1)


def token_slots(batch: StepBatch, page_size: int) -> tuple[jax.Array, jax.Array]:
  """(page [B, T], offset [B, T]) each column writes; padding columns -> the null page."""
  pages = physical_pages(batch.block_tables, batch.positions // page_size)
  return jnp.where(batch.valid, pages, NULL_PAGE), batch.positions % page_size


class PagedLayout:
  """What every paged cache shares: its per-page arrays `PAGE_ARRAYS`, the first of
  which holds pages along `PAGE_AXIS` with the page's tokens on the next axis, its
  per-slot arrays `SLOT_ARRAYS` (slots along axis 1, after the layer axis), and a
  hybrid's prefix-cache state snapshots `SNAPSHOT_ARRAYS` (snapshots along axis 1)."""

  PAGE_ARRAYS: tuple = ()
  PAGE_AXIS: int = 0
  SLOT_ARRAYS: tuple = ()
  SNAPSHOT_ARRAYS: tuple = ()
  GATHERS_ROWS: bool = False  # a decode loop may keep its rows gathered (caches/gathered.py)

  @property
  def num_pages(self) -> int:
    return getattr(self, self.PAGE_ARRAYS[0]).shape[self.PAGE_AXIS]

  def keep_accepted(self, batch: StepBatch, accepted: jax.Array):
    """After verifying drafts (accepted [B] kept per row): KV pages need nothing, since
    the host's lengths drop the rejected positions (a recurrent state does need it)."""
    return self

  @property
  def page_size(self) -> int:
    return getattr(self, self.PAGE_ARRAYS[0]).shape[self.PAGE_AXIS + 1]


@struct.dataclass
class PagedKVCache(PagedLayout):
  PAGE_ARRAYS = ("k_pages", "v_pages", "k_scales", "v_scales")  # see copy_cache_pages
  PAGE_AXIS = 2
  GATHERS_ROWS = True  # float pages (see gathers_rows)
  # kv heads split over tp (kvjax/parallel/sharding.py)
  HEAD_AXES = {name: 1 for name in PAGE_ARRAYS}
  k_pages: jax.Array  # [L, K, P, Z, H]
  v_pages: jax.Array  # [L, K, P, Z, H]
  k_scales: Optional[jax.Array] = None  # [L, K, P, Z] f32 (int8 pages only)
  v_scales: Optional[jax.Array] = None  # [L, K, P, Z] f32

  @classmethod
  def create(cls, num_layers: int, num_kv_heads: int, num_pages: int, page_size: int,
             head_dim: int, dtype) -> "PagedKVCache":
    """`dtype` int8 quantizes every write (with scales); any float dtype stores K/V as is."""
    store = store_name(dtype)
    specs = _kv_arrays((num_layers, num_kv_heads, num_pages, page_size, head_dim), store)
    return cls(**allocate(_with_scales(specs) if store == "int8" else specs))

  @property
  def gathers_rows(self) -> bool:
    """Whether a decode loop may keep its rows gathered: float pages (int8 ones have
    scales, which the gathered copy does not carry)."""
    return self.GATHERS_ROWS and self.k_scales is None

  def write(self, layer: int, k: jax.Array, v: jax.Array, batch: StepBatch) -> "PagedKVCache":
    """Scatter k, v [B, T, K, H] to their pages; padding columns go to the null page."""
    pages, offsets = token_slots(batch, self.page_size)  # [B, T] each
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
             backend: Backend, **options):
    """Write k, v [B, T, K, H], then q [B, T, N, H] attends -> (cache, out [B, T, N, H]);
    `options` (a layer kind's extras, e.g. sinks; the layer's attention variant) go to the
    backend's attention."""
    cache = self.write(layer, k, v, batch)
    scales = {} if cache.k_scales is None else dict(k_scales=cache.k_scales,
                                                     v_scales=cache.v_scales)
    out = backend.attention(q, cache.k_pages, cache.v_pages, batch, layer=layer,
                            sm_scale=sm_scale, **scales, **options)
    return cache, out


def copy_cache_pages(cache, src: jax.Array, dst: jax.Array):
  """Copy pages src -> dst (page ids, one per copy), every layer, in each array of
  `cache.PAGE_ARRAYS`.

  A paged cache lists its per-page arrays (pages, scales; None ones are
  skipped) and their page axis `PAGE_AXIS`; per-slot state is not a page and
  is left alone.
  """
  lead = (slice(None),) * cache.PAGE_AXIS

  def copy(x):
    return None if x is None else x.at[lead + (dst,)].set(x[lead + (src,)])

  return cache.replace(**{name: copy(getattr(cache, name)) for name in cache.PAGE_ARRAYS})


def clear_cache_pages(cache, pages: jax.Array, slots: jax.Array):
  """Zero `pages` (page ids) in every array of `cache.PAGE_ARRAYS` and `slots` (slot ids)
  in `SLOT_ARRAYS`.

  A request whose logits went non-finite has written NaN or inf K/V; attention
  weighs a masked position by exactly 0, but 0 * NaN is NaN, so a stale
  non-finite value in a reused page (or slot residual) would poison whoever
  reads that page next.  Clearing what only the failed request held keeps the
  pool clean (kvjax/engine/engine.py).
  """
  page_lead = (slice(None),) * cache.PAGE_AXIS

  def clear(x, lead, index):
    return None if x is None else x.at[lead + (index,)].set(0)

  cleared = {name: clear(getattr(cache, name), page_lead, pages) for name in cache.PAGE_ARRAYS}
  cleared.update({name: clear(getattr(cache, name), (slice(None),), slots)
                  for name in cache.SLOT_ARRAYS})
  return cache.replace(**cleared)


def _kv_arrays(shape: tuple, store: str) -> dict:
  """k_pages, v_pages of `shape` [L, K, P, Z, H] stored as `store`."""
  return {"k_pages": ArraySpec(shape, store), "v_pages": ArraySpec(shape, store)}


def _with_scales(specs: dict) -> dict:
  """int8 pages plus one f32 scale [L, K, P, Z] per token per kv head (claim C6)."""
  scales = ArraySpec(specs["k_pages"].shape[:-1], "fp32", scales=True, fill=1)
  return {**specs, "k_scales": scales, "v_scales": scales}


def kv_page_arrays(cfg: ModelConfig, store: str, sizes: PoolSizes) -> dict:
  """cfg's k_pages, v_pages [L, K, P, Z, H] stored as `store`."""
  return _kv_arrays((cfg.cache_layers(sizes.with_mtp), cfg.num_kv_heads, sizes.num_pages,
                     sizes.page_size, cfg.head_dim), store)


def _int8_arrays(cfg: ModelConfig, store: str, sizes: PoolSizes) -> dict:
  return _with_scales(kv_page_arrays(cfg, "int8", sizes))


def _contiguous(cfg: ModelConfig, num_slots: int, max_len: int, dtype,
                **options) -> ContiguousKVCache:
  """The C7 baseline: every slot reserves max_len tokens of the trunk's layers."""
  return ContiguousKVCache.create(cfg.cache_layers(False), cfg.num_kv_heads, num_slots,
                                  max_len, cfg.head_dim, dtype)


def _reads(kv_dtype):
  return functools.partial(Backend.check_kv_dtype, kv_dtype=kv_dtype)


def _without_windows(cfg: ModelConfig) -> None:
  """ValueError if cfg has sliding windows: they would hide keys an alias's variant keeps."""
  if cfg.sliding_window is not None or any(w is not None for w in cfg.layer_windows or ()):
    raise ValueError(f"a kv layout with an attention variant needs a model without sliding "
                     f"windows; {cfg.name!r} has them")


def variant_layout(variant: AttentionVariant, name: Optional[str] = None,
                   store: Optional[str] = None) -> KVLayout:
  """Float pages (`store`: "fp32", "bf16", "fp16"; None: the model dtype) whose every layer
  runs `variant`, named `name` (None: the variant's name): an alias, the variant by a
  kv_dtype name.  A monotone variant's hidden pages are released as the attention=
  variant's are (kvjax/engine/sched/mask_release.py)."""
  return dataclasses.replace(_FLOAT_LAYOUTS[store or "float"], name=name or variant.name,
                             default=False, variant=variant, check_model=_without_windows)


_FLOAT_LAYOUTS = {"float": register(KVLayout(
    "float", kv_page_arrays, PagedKVCache, default=True, hybrid=True, contiguous=_contiguous,
    prefill_full_width=True, variants=True))}
for _store in ("fp32", "bf16", "fp16"):
  _FLOAT_LAYOUTS[_store] = register(KVLayout(
      _store, kv_page_arrays, PagedKVCache, store=_store, hybrid=True, contiguous=_contiguous,
      check_backend=_reads(_store), prefill_full_width=True, variants=True))
register(KVLayout("int8", _int8_arrays, PagedKVCache, store="int8", hybrid=True,
                  check_backend=_reads("int8"), prefill_full_width=True, variants=True))
register(variant_layout(sinks_window(4, 1020), name="streaming"))  # StreamingLLM's sizes
