"""Multi-head latent attention (DeepSeek-V2/V3): cache one latent per token, not K/V.

What is cached, per token and layer: the compressed latent c = RMSNorm(x W_dkv)
[R] (R = kv_lora_rank) and one rope key k_r = rope(x W_kr) [Hr] shared by all
heads, R + Hr values against MHA's 2 N H (DeepSeek-V2: 576 vs 32,768; claim C6).
Head n's key would be [c W_uk[n]; k_r] and its value c W_uv[n], but those are
never materialized: with the up-projections absorbed,
  q_n . k_n = (q_nope_n W_uk[n]^T) . c + q_rope_n . k_r
  out_n     = (sum_s p_s c_s) W_uv[n]
so attention is MQA over a single "kv head" of width R + Hr whose values are
its first R dims.  The block hands that to the same `attend` callback as GQA
(q [B, T, N, R + Hr], k [B, T, 1, R + Hr], v = k[..., :R]), so the no-cache
forward and the contiguous cache need no MLA code; the paged cache is
`MLAPagedCache` below, one page array instead of two.  Absorption is used in
prefill too: more FLOPs there than expanding (R > Hn), one code path.

Rope: HF DeepSeek rotates interleaved pairs (x0, x1), (x2, x3), ... of the rope
dims; kvjax rotates halves.  The loader (kvjax/weights/hf.py) permutes the rope
output columns of the q and kv_a projections to evens-then-odds, which makes
the two conventions agree exactly; q . k is unchanged by the shared permutation.
"""
from __future__ import annotations

from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
from flax import struct

from kvjax.attention.dense import masked_attention, visibility_mask
from kvjax.attention.paged import paged_attention
from kvjax.cache import NULL_PAGE, StepBatch
from kvjax.config import ModelConfig
from kvjax.layers import apply_rope, rms_norm
from kvjax.params import MLAParams

__all__ = ["MLAPagedCache", "mla_attention", "mla_paged_attention", "LORA_NORM_EPS"]

# HF builds q_a_layernorm / kv_a_layernorm with the RMSNorm default, not rms_norm_eps.
LORA_NORM_EPS = 1e-6


def mla_attention(cfg: ModelConfig, a: MLAParams, h: jax.Array, positions: jax.Array,
                  inv_freq: jax.Array, cache: Any, layer: int, attend: Callable):
  """h [B, T, D] -> (cache, out [B, T, D]) through the latent cache."""
  hn, r = cfg.qk_nope_head_dim, cfg.kv_lora_rank
  if a.wq is not None:
    q = jnp.einsum("btd,dnh->btnh", h, a.wq)  # [B, T, N, Hn + Hr]
  else:
    q_low = rms_norm(h @ a.wq_a, a.q_norm, LORA_NORM_EPS)  # [B, T, Rq]
    q = jnp.einsum("btr,rnh->btnh", q_low, a.wq_b)
  q_nope, q_rope = q[..., :hn], apply_rope(q[..., hn:], positions, inv_freq)
  kv = h @ a.wkv_a  # [B, T, R + Hr]
  latent = rms_norm(kv[..., :r], a.kv_norm, LORA_NORM_EPS)  # [B, T, R]
  k_rope = apply_rope(kv[:, :, None, r:], positions, inv_freq)  # [B, T, 1, Hr]
  q_latent = jnp.einsum("btnh,rnh->btnr", q_nope, a.wk_b)  # absorbed W_uk: [B, T, N, R]
  queries = jnp.concatenate([q_latent, q_rope], axis=-1)  # [B, T, N, R + Hr]
  entry = jnp.concatenate([latent[:, :, None], k_rope], axis=-1)  # [B, T, 1, R + Hr]
  with jax.named_scope(f"attention_{layer}"):
    cache, out = attend(cache, layer, queries, entry, entry[..., :r])  # [B, T, N, R]
  out = jnp.einsum("btnr,rnv->btnv", out, a.wv_b)  # absorbed W_uv: [B, T, N, Hv]
  return cache, jnp.einsum("btnv,nvd->btd", out, a.wo)


def mla_paged_attention(q: jax.Array, pages: jax.Array, kv_lens: jax.Array,
                        block_tables: jax.Array, *, value_dim: int, sm_scale: float,
                        sliding_window: Optional[int] = None) -> jax.Array:
  """q [B, T, N, R + Hr]; pages [P, G, R + Hr]; kv_lens [B]; block_tables [B, Pmax]
  -> [B, T, N, R] (R = value_dim): pure-jnp gather, positions as in paged.py."""
  b, t = q.shape[:2]
  entries = pages[block_tables]  # [B, Pmax, G, R + Hr]
  entries = entries.reshape(b, -1, 1, entries.shape[-1])  # [B, S, 1, R + Hr]
  s = entries.shape[1]
  q_positions = kv_lens[:, None] - t + jnp.arange(t)[None, :]  # [B, T]
  k_positions = jnp.broadcast_to(jnp.arange(s)[None, :], (b, s))  # [B, S]
  visible = visibility_mask(q_positions, k_positions, k_positions < kv_lens[:, None],
                            sliding_window)
  return masked_attention(q, entries, entries[..., :value_dim], visible, sm_scale=sm_scale)


@struct.dataclass
class MLAPagedCache:
  """Latent pages: one [G, R + Hr] row per token, shared by every head."""
  PAGE_ARRAYS = ("pages",)  # see kvjax/cache.py copy_cache_pages
  PAGE_AXIS = 1
  pages: jax.Array  # [L, P, G, R + Hr]
  value_dim: int = struct.field(pytree_node=False, default=0)  # R

  @classmethod
  def create(cls, cfg: ModelConfig, num_pages: int, page_size: int, dtype, *,
             with_mtp: bool = False) -> "MLAPagedCache":
    width = cfg.kv_lora_rank + cfg.qk_rope_head_dim
    layers = cfg.cache_layers(with_mtp)
    return cls(pages=jnp.zeros((layers, num_pages, page_size, width), dtype),
               value_dim=cfg.kv_lora_rank)

  @property
  def page_size(self) -> int:
    return self.pages.shape[2]

  @property
  def num_pages(self) -> int:
    return self.pages.shape[1]

  def write(self, layer: int, entry: jax.Array, batch: StepBatch) -> "MLAPagedCache":
    """Scatter entry [B, T, R + Hr] to its slots; padding rows go to the null page."""
    g = self.page_size
    logical = jnp.clip(batch.positions // g, 0, batch.block_tables.shape[1] - 1)
    pages = jnp.take_along_axis(batch.block_tables, logical, axis=1)  # [B, T]
    pages = jnp.where(batch.valid, pages, NULL_PAGE)
    return self.replace(pages=self.pages.at[layer, pages, batch.positions % g].set(
        entry.astype(self.pages.dtype)))

  def attend(self, layer: int, q, k, v, batch: StepBatch, *, sm_scale: float,
             window: Optional[int], backend: Callable):
    """q [B, T, N, R + Hr], k [B, T, 1, R + Hr]; v is k[..., :R] and is not stored."""
    del v
    if backend is not paged_attention:
      raise ValueError("MLA caches latents; only the 'reference' attention backend reads them")
    cache = self.write(layer, k[:, :, 0], batch)
    out = mla_paged_attention(q, cache.pages[layer], batch.kv_lens, batch.block_tables,
                              value_dim=self.value_dim, sm_scale=sm_scale,
                              sliding_window=window)
    return cache, out
