"""Attention over MLA's latent pages, in pure jnp (the reference backend's `mla_attention`).

Multi-head latent attention (DeepSeek-V2/V3; the block is kvjax/model/decoder.py
`mla_attention`) caches one latent row [R + Hr] per token, shared by every
head, instead of K and V: with the up-projections absorbed into the query and
the output, attention is MQA over a single "kv head" whose keys are the whole
row and whose values are its first R dims.  The latent pages themselves are
kvjax/caches/mla.py.  Prefill chunks walk the table a block at a time, as
paged GQA's do (kvjax/attention/blocked.py).  The layer's attention variant applies as on
every path (its model window joined with an attention= variant): the query heads are
one kv head's group, so a score's head index is the query head's own, 0..N-1.
"""
from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp

from kvjax.attention.blocked import block_pages, blocked_attention
from kvjax.attention.dense import masked_attention, padded_scores, padded_visibility
from kvjax.attention.paged import block_of, padded_tables
from kvjax.attention.variants import AttentionVariant
from kvjax.runtime.xla_options import DECODE_COLUMNS

__all__ = ["mla_paged_attention"]


def mla_paged_attention(q: jax.Array, pages: jax.Array, kv_lens: jax.Array,
                        block_tables: jax.Array, *, value_dim: int, sm_scale: float,
                        layer: Optional[int] = None, q_lens: Optional[jax.Array] = None,
                        variant: Optional[AttentionVariant] = None) -> jax.Array:
  """q [B, T, N, R + Hr]; pages [P, Z, R + Hr], or every layer's [L, P, Z, R + Hr] with
  `layer`; kv_lens [B]; block_tables [B, W]; q_lens [B] or None; the layer's attention
  variant or None -> [B, T, N, R]
  (R = value_dim): gather the rows' pages, padded layout.  Every layer's pages let a
  prefill chunk's block loop index the layer in its body (kvjax/attention/paged.py)."""
  b, t = q.shape[:2]
  pick = (lambda x: x) if layer is None else (lambda x: x[layer])
  if t > DECODE_COLUMNS:
    page_size = pages.shape[-2]
    wb = block_pages(page_size)
    tables, num_blocks = padded_tables(block_tables, wb)

    def read_block(c):
      entries = pick(pages)[block_of(tables, c, wb)].reshape(b, -1, pages.shape[-1])
      return jnp.swapaxes(entries, 1, 2)[None], entries[None, :, :, :value_dim]  # Sb keys

    qg = q.transpose(0, 2, 1, 3)[None]  # [1, B, N, T, R + Hr]: one kv head, N per group
    out = blocked_attention(qg, read_block, kv_lens, q_lens, num_blocks, wb * page_size,
                            sm_scale=sm_scale, value_dim=value_dim, variant=variant)
    return out[0].transpose(0, 2, 1, 3).astype(q.dtype)
  entries = pick(pages)[block_tables]  # [B, W, Z, R + Hr]
  entries = entries.reshape(b, -1, 1, entries.shape[-1])  # [B, S, 1, R + Hr]
  s = entries.shape[1]
  visible = padded_visibility(kv_lens, t, s, variant)  # [B, T, S]
  return masked_attention(q, entries, entries[..., :value_dim], visible, sm_scale=sm_scale,
                          score_mod=padded_scores(kv_lens, t, s, variant))
