"""KV caches: one contract, four layouts (and a decode loop's gathered view).

Every cache is a frozen pytree with
  cache, out = cache.attend(layer, q, k, v, batch, *, sm_scale, window, backend)
which writes the step's new k, v [B, T, K, H] for `batch` (a StepBatch,
kvjax/step_batch.py) and attends q [B, T, N, H] over everything the rows can
see; the cache goes in and comes out, nothing is mutated.  Paged caches also
list their per-page arrays (`PAGE_ARRAYS`, `PAGE_AXIS`) and per-slot arrays
(`SLOT_ARRAYS`) for page copies and for clearing a failed request's pages.

  paged.py       PagedKVCache: float or int8 pages (claims C6, C7); the shared
                 page lookup (`physical_pages`, `token_slots`) and page copies
  kivi.py        KIVIPagedKVCache: int4 pages, keys per channel, values per token
  mla.py         MLAPagedCache: one latent row per token (DeepSeek MLA)
  contiguous.py  ContiguousKVCache: one max-length buffer per slot (C7's baseline)
  recurrent.py   HybridPagedCache / HybridContiguousCache: either of those for a
                 hybrid's attention layers plus per-slot Gated DeltaNet states
  gathered.py    GatheredKVCache: a device decode loop's rows' float pages gathered
                 once before the loop and written back after it (same contract),
                 for backends whose paged attention is a gather (the reference)

kv_dtype says how pages store K/V: None keeps the model dtype; "fp32",
"bf16", "fp16" (or "float32", "bfloat16", "float16") store that float; "int8" is PagedKVCache with scales; "int4" is
KIVIPagedKVCache.  Which backend reads which store is the backend's record
(kvjax/backends.py).
"""
from __future__ import annotations

import functools
from typing import Optional

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from kvjax.backends import Backend
from kvjax.caches.contiguous import ContiguousKVCache
from kvjax.caches.kivi import KIVIPagedKVCache
from kvjax.caches.mla import MLAPagedCache
from kvjax.caches.paged import NULL_PAGE, PagedKVCache, clear_cache_pages, copy_cache_pages
from kvjax.caches.recurrent import check_hybrid_engine, with_recurrent_state
from kvjax.config import ModelConfig, short_dtype_name
from kvjax.sharding import cache_shardings

__all__ = ["KV_DTYPES", "CACHE_KINDS", "PagedKVCache", "KIVIPagedKVCache", "MLAPagedCache",
           "ContiguousKVCache", "NULL_PAGE", "copy_cache_pages", "clear_cache_pages", "check_cache_support",
           "create_paged_cache", "create_contiguous_cache", "check_hybrid_engine"]

KV_DTYPES = ("fp32", "bf16", "fp16", "int8", "int4")
CACHE_KINDS = ("paged", "contiguous", "none")
_FLOATS = {"fp32": jnp.float32, "bf16": jnp.bfloat16, "fp16": jnp.float16}


def check_cache_support(kv_dtype: Optional[str], cfg: ModelConfig, cache: str,
                        backend: Backend) -> None:
  """ValueError naming the problem unless `cache` pages stored as kv_dtype can serve cfg
  through `backend`."""
  kv_dtype = short_dtype_name(kv_dtype)
  if cache not in CACHE_KINDS:
    raise ValueError(f"unknown cache {cache!r}; use one of {CACHE_KINDS}")
  if cfg.attention_type == "mla" and cache == "paged":
    backend.check_mla()
  if kv_dtype is None:
    return
  if cfg.is_hybrid and kv_dtype == "int4":
    raise ValueError(f"kv_dtype 'int4' is not supported for hybrid model {cfg.name!r} (its "
                     "per-slot residual and recurrent state are not combined); use int8")
  if kv_dtype not in KV_DTYPES:
    raise ValueError(f"unsupported kv_dtype {kv_dtype!r}; use None or one of {KV_DTYPES}")
  if cfg.attention_type == "mla":
    raise ValueError(f"kv_dtype {kv_dtype!r} is not supported for MLA (its latent cache "
                     "keeps the model dtype); use kv_dtype=None")
  if cache != "paged":
    if kv_dtype in _FLOATS:
      return
    raise ValueError(f"kv_dtype {kv_dtype!r} needs cache='paged', got cache={cache!r}")
  backend.check_kv_dtype(kv_dtype)


def create_paged_cache(cfg: ModelConfig, kv_dtype: Optional[str], num_slots: int,
                       num_pages: int, page_size: int, dtype, *, with_mtp: bool = False,
                       mesh: Optional[Mesh] = None, num_snapshots: int = 0,
                       num_verify_states: int = 0):
  """Empty pages for cfg's attention and kv_dtype (None: `dtype`).

  The MTP modules' KV layers are allocated only `with_mtp` (speculative
  drafting): a plain decoder never writes them (claim C11's memory cost).
  `num_slots` rows of per-slot state (int4's residual) sit beside the pages,
  and a hybrid's `num_snapshots` prefix-cache state snapshots and, with
  speculation, `num_verify_states` (J + 1) states per slot for rollback.
  On a `mesh` each device allocates only its kv heads (kvjax/sharding.py).
  """
  build = functools.partial(_create_paged_cache, cfg, kv_dtype, num_slots, num_pages,
                            page_size, dtype, with_mtp=with_mtp, num_snapshots=num_snapshots,
                            num_verify_states=num_verify_states)
  if mesh is None:
    return build()
  return jax.jit(build, out_shardings=cache_shardings(jax.eval_shape(build), mesh))()


def _create_paged_cache(cfg: ModelConfig, kv_dtype: Optional[str], num_slots: int,
                        num_pages: int, page_size: int, dtype, *, with_mtp: bool,
                        num_snapshots: int, num_verify_states: int):
  kv_dtype = short_dtype_name(kv_dtype)
  if cfg.attention_type == "mla":
    return MLAPagedCache.create(cfg, num_pages, page_size, dtype, with_mtp=with_mtp)
  args = (cfg.cache_layers(with_mtp), cfg.num_kv_heads, num_pages, page_size, cfg.head_dim)
  if kv_dtype == "int4":
    return KIVIPagedKVCache.create(*args, num_slots=num_slots, residual_dtype=dtype)
  store = {None: dtype, "int8": jnp.int8, **_FLOATS}[kv_dtype]
  pages = PagedKVCache.create(*args, store)
  if not cfg.is_hybrid:
    return pages
  return with_recurrent_state(pages, cfg, num_slots, dtype, num_snapshots, num_verify_states)


def create_contiguous_cache(cfg: ModelConfig, num_slots: int, max_len: int, dtype,
                            kv_dtype: Optional[str] = None) -> ContiguousKVCache:
  """Every slot reserves max_len tokens of the trunk's layers (the C7 baseline)."""
  dtype = _FLOATS.get(short_dtype_name(kv_dtype), dtype)
  if cfg.attention_type == "mla":
    # One latent "kv head": keys [latent; rope key], values the latent (stored twice;
    # the contiguous cache is a baseline, MLAPagedCache stores it once).
    r = cfg.kv_lora_rank
    return ContiguousKVCache.create(cfg.num_layers, 1, num_slots, max_len,
                                    r + cfg.qk_rope_head_dim, dtype, value_dim=r)
  buffers = ContiguousKVCache.create(cfg.cache_layers(False), cfg.num_kv_heads, num_slots,
                                     max_len, cfg.head_dim, dtype)
  return with_recurrent_state(buffers, cfg, num_slots, dtype) if cfg.is_hybrid else buffers
