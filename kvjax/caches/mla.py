"""`MLAPagedCache`: MLA's latent pages, one [R + Hr] row per token shared by every head.

What is cached per token and layer: the compressed latent c = RMSNorm(x W_dkv)
[R] (R = kv_lora_rank) and one rope key k_r [Hr], R + Hr values against MHA's
2 N H (DeepSeek-V2: 576 vs 32,768; claim C6).  The block (kvjax/model/decoder.py
`mla_attention`) hands `attend` keys k [B, T, 1, R + Hr] with v = k[..., :R];
only k is stored, one page array instead of two, and the backend's
`mla_attention` reads it (kvjax/attention/mla.py for the reference).  Registered
as layout "latent", the default of attention_type "mla" (kvjax/caches/layout.py).
"""
from __future__ import annotations

from typing import Optional

import jax
from flax import struct

from kvjax.attention.backends import Backend
from kvjax.attention.variants import AttentionVariant
from kvjax.caches.contiguous import ContiguousKVCache
from kvjax.caches.layout import ArraySpec, KVLayout, PoolSizes, allocate, register, store_name
from kvjax.caches.paged import PagedLayout, token_slots
from kvjax.model.config import ModelConfig
from kvjax.runtime.step_batch import StepBatch

__all__ = ["MLAPagedCache"]


@struct.dataclass
class MLAPagedCache(PagedLayout):
  PAGE_ARRAYS = ("pages",)  # see kvjax/caches/paged.py copy_cache_pages
  PAGE_AXIS = 1
  pages: jax.Array  # [L, P, Z, R + Hr]
  value_dim: int = struct.field(pytree_node=False, default=0)  # R

  @classmethod
  def create(cls, cfg: ModelConfig, num_pages: int, page_size: int, dtype, *,
             with_mtp: bool = False) -> "MLAPagedCache":
    sizes = PoolSizes(num_pages, page_size, 0, with_mtp)
    return cls(**allocate(latent_arrays(cfg, store_name(dtype), sizes)),
               **cls.static_fields(cfg))

  @staticmethod
  def static_fields(cfg: ModelConfig) -> dict:
    return {"value_dim": cfg.kv_lora_rank}

  def write(self, layer: int, entry: jax.Array, batch: StepBatch) -> "MLAPagedCache":
    """Scatter entry [B, T, R + Hr] to its pages; padding columns go to the null page."""
    pages, offsets = token_slots(batch, self.page_size)
    return self.replace(pages=self.pages.at[layer, pages, offsets].set(
        entry.astype(self.pages.dtype)))

  def attend(self, layer: int, q, k, v, batch: StepBatch, *, sm_scale: float,
             backend: Backend, variant: Optional[AttentionVariant] = None):
    """q [B, T, N, R + Hr], k [B, T, 1, R + Hr]; v is k[..., :R] and is not stored;
    `variant`: the layer's (its model window joined with an attention= variant)."""
    del v
    backend.check_mla()
    cache = self.write(layer, k[:, :, 0], batch)
    out = backend.mla_attention(q, cache.pages, batch, layer=layer, value_dim=self.value_dim,
                                sm_scale=sm_scale, variant=variant)
    return cache, out


def latent_arrays(cfg: ModelConfig, store: str, sizes: PoolSizes) -> dict:
  """pages [L, P, Z, R + Hr] at `store`."""
  shape = (cfg.cache_layers(sizes.with_mtp), sizes.num_pages, sizes.page_size,
           cfg.kv_lora_rank + cfg.qk_rope_head_dim)
  return {"pages": ArraySpec(shape, store)}


def _contiguous(cfg: ModelConfig, num_slots: int, max_len: int, dtype,
                **options) -> ContiguousKVCache:
  """One latent "kv head": keys [latent; rope key], values the latent (stored twice; the
  contiguous cache is a baseline, MLAPagedCache stores it once)."""
  r = cfg.kv_lora_rank
  return ContiguousKVCache.create(cfg.num_layers, 1, num_slots, max_len,
                                  r + cfg.qk_rope_head_dim, dtype, value_dim=r)


register(KVLayout("latent", latent_arrays, MLAPagedCache, attention="mla", default=True,
                  check_backend=Backend.check_mla, contiguous=_contiguous,
                  prefill_full_width=True, variants=True))
