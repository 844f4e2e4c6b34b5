"""KV caches: one contract, layouts declared as spec records (and a decode loop's view).

Every cache is a frozen pytree with
  cache, out = cache.attend(layer, q, k, v, batch, *, sm_scale, backend, variant=None)
which writes the step's new k, v [B, T, K, H] for `batch` (a StepBatch,
kvjax/runtime/step_batch.py) and attends q [B, T, N, H] over everything the rows can
see, `variant` (kvjax/attention/variants.py layer_variant: the model's window and the
attention= variant) deciding which keys; the cache goes in and comes out, nothing is
mutated.  Paged caches also
list their per-page arrays (`PAGE_ARRAYS`, `PAGE_AXIS`) and per-slot arrays
(`SLOT_ARRAYS`) for page copies and for clearing a failed request's pages.

  paged.py       PagedKVCache: float or int8 pages (claims C6, C7); the shared
                 page lookup (`physical_pages`, `token_slots`) and page copies;
                 `variant_layout`: an attention variant named as a kv_dtype
                 ("streaming": StreamingLLM's sinks + window)
  kivi.py        KIVIPagedKVCache: int4 pages, keys per channel, values per token
  mla.py         MLAPagedCache: one latent row per token (DeepSeek MLA)
  contiguous.py  ContiguousKVCache: one max-length buffer per slot (C7's baseline)
  recurrent.py   HybridPagedCache / HybridContiguousCache: either of those for a
                 hybrid's attention layers plus per-slot Gated DeltaNet states
  gathered.py    GatheredKVCache: a device decode loop's rows' float pages gathered
                 once before the loop and written back after it (same contract),
                 for backends whose paged attention is a gather (the reference)
  groups.py      GroupedKVCache: one page pool and block table per group of layers with
                 the same window (Gemma 3's sliding and global layers)
  layout.py      KVLayout: the spec record every layout registers by name (its
                 arrays, bytes, capabilities, host-side page manager and cache class)

kv_dtype names the layout: None is the model's default ("float" pages at the
model dtype; "latent" for MLA); "fp32", "bf16", "fp16" (or "float32", ...) store
that float; "int8" is PagedKVCache with scales; "int4" is KIVIPagedKVCache; any
other registered name (`layout_names()`), or a KVLayout record.  Every module in
this package is imported here, so a layout registers itself by existing: a new
layout is one new file (docs/EXTENDING.md).
"""
from __future__ import annotations

import importlib
import pkgutil
from typing import Optional, Union

import jax
from jax.sharding import Mesh

from kvjax.attention.backends import Backend
from kvjax.caches.contiguous import ContiguousKVCache
from kvjax.caches.kivi import KIVIPagedKVCache
from kvjax.caches.layout import (STORE_DTYPES, KVLayout, PoolSizes, get_layout, layout_names,
                                 store_name)
from kvjax.caches.mla import MLAPagedCache
from kvjax.caches.paged import NULL_PAGE, PagedKVCache, clear_cache_pages, copy_cache_pages
from kvjax.caches.recurrent import check_hybrid_engine, with_recurrent_state
from kvjax.model.config import ModelConfig
from kvjax.parallel.sharding import cache_shardings

for _module in pkgutil.iter_modules(__path__):  # each layout module registers its records
  importlib.import_module(f"{__name__}.{_module.name}")

__all__ = ["CACHE_KINDS", "PagedKVCache", "KIVIPagedKVCache", "MLAPagedCache",
           "ContiguousKVCache", "NULL_PAGE", "copy_cache_pages", "clear_cache_pages",
           "check_cache_support", "create_paged_cache", "create_contiguous_cache",
           "check_hybrid_engine", "KVLayout", "get_layout", "layout_names"]

CACHE_KINDS = ("paged", "contiguous", "none")
KVDtype = Union[None, str, KVLayout]


def check_cache_support(kv_dtype: KVDtype, cfg: ModelConfig, cache: str,
                        backend: Backend) -> KVLayout:
  """The layout kv_dtype names for cfg; ValueError naming the problem unless `cache`
  in that layout can serve cfg through `backend`."""
  if cache not in CACHE_KINDS:
    raise ValueError(f"unknown cache {cache!r}; use one of {CACHE_KINDS}")
  layout = get_layout(kv_dtype, cfg)
  if cache == "contiguous" and layout.contiguous is None:
    raise ValueError(f"kv_dtype {layout.name!r} needs cache='paged', got cache={cache!r}")
  if cache == "paged":
    layout.check_backend(backend)
  if cfg.variant_names:
    if not layout.variants:
      raise ValueError(f"kv_dtype {layout.name!r} does not apply attention variants "
                       f"(attention={', '.join(cfg.variant_names)}); use kv_dtype None, "
                       f"'bf16', 'int8' or 'int4'")
    if cache == "paged":
      backend.check_variants(cfg.variant_names)
  return layout


def create_paged_cache(cfg: ModelConfig, kv_dtype: KVDtype, num_slots: int,
                       num_pages: int, page_size: int, dtype, *, with_mtp: bool = False,
                       mesh: Optional[Mesh] = None, num_snapshots: int = 0,
                       num_verify_states: int = 0):
  """Empty pages of kv_dtype's layout for cfg (model dtype `dtype`).

  The MTP modules' KV layers are allocated only `with_mtp` (speculative
  drafting): a plain decoder never writes them (claim C11's memory cost).
  `num_slots` rows of per-slot state (int4's residual) sit beside the pages,
  and a hybrid's `num_snapshots` prefix-cache state snapshots and, with
  speculation, `num_verify_states` (J + 1) states per slot for rollback.
  On a `mesh` each device allocates only its kv heads (kvjax/parallel/sharding.py).
  """
  layout = get_layout(kv_dtype, cfg)
  sizes = PoolSizes(num_pages, page_size, num_slots, with_mtp, num_snapshots,
                    num_verify_states)

  def build():
    cache = layout.create(cfg, sizes, dtype)
    return with_recurrent_state(cache, cfg, store_name(dtype), sizes) if cfg.is_hybrid \
        else cache

  if mesh is None:
    return build()
  return jax.jit(build, out_shardings=cache_shardings(jax.eval_shape(build), mesh))()


def create_contiguous_cache(cfg: ModelConfig, num_slots: int, max_len: int, dtype,
                            kv_dtype: KVDtype = None):
  """Every slot reserves max_len tokens (the C7 baseline), in kv_dtype's contiguous twin."""
  layout = get_layout(kv_dtype, cfg)
  buffers = layout.create_contiguous(cfg, num_slots, max_len,
                                     STORE_DTYPES.get(layout.store, dtype))
  if not cfg.is_hybrid:
    return buffers
  return with_recurrent_state(buffers, cfg, store_name(dtype), PoolSizes(0, 1, num_slots))
