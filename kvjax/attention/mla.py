"""Attention over MLA's latent pages, in pure jnp (the reference backend's `mla_attention`).

Multi-head latent attention (DeepSeek-V2/V3; the block is kvjax/model.py
`mla_attention`) caches one latent row [R + Hr] per token, shared by every
head, instead of K and V: with the up-projections absorbed into the query and
the output, attention is MQA over a single "kv head" whose keys are the whole
row and whose values are its first R dims.  The latent pages themselves are
kvjax/caches/mla.py.
"""
from __future__ import annotations

from typing import Optional

import jax

from kvjax.attention.dense import masked_attention, padded_visibility

__all__ = ["mla_paged_attention"]


def mla_paged_attention(q: jax.Array, pages: jax.Array, kv_lens: jax.Array,
                        block_tables: jax.Array, *, value_dim: int, sm_scale: float,
                        sliding_window: Optional[int] = None) -> jax.Array:
  """q [B, T, N, R + Hr]; pages [P, Z, R + Hr]; kv_lens [B]; block_tables [B, W]
  -> [B, T, N, R] (R = value_dim): gather the rows' pages, padded layout."""
  b, t = q.shape[:2]
  entries = pages[block_tables]  # [B, W, Z, R + Hr]
  entries = entries.reshape(b, -1, 1, entries.shape[-1])  # [B, S, 1, R + Hr]
  visible = padded_visibility(kv_lens, t, entries.shape[1], sliding_window)  # [B, T, S]
  return masked_attention(q, entries, entries[..., :value_dim], visible, sm_scale=sm_scale)
