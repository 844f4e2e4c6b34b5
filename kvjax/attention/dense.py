"""Dense masked attention over explicit key positions (no pages).

Used by the no-cache forward (keys are the query tokens themselves) and by the
contiguous cache (keys are a per-row [S] buffer).  Query row i of batch row b sits
at `q_positions[b, i]`; key j at `k_positions[b, j]`; it is visible iff it is
valid, not in the future and (with a window W) fewer than W tokens back.
"""
from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp

__all__ = ["masked_attention", "visibility_mask"]


def visibility_mask(q_positions: jax.Array, k_positions: jax.Array,
                    k_valid: jax.Array, window: Optional[int]) -> jax.Array:
  """[B, T, S] bool: causal (and sliding-window) visibility."""
  qp = q_positions[:, :, None]  # [B, T, 1]
  kp = k_positions[:, None, :]  # [B, 1, S]
  visible = (kp <= qp) & k_valid[:, None, :]
  if window is not None:
    visible &= kp > qp - window
  return visible


def masked_attention(q: jax.Array, k: jax.Array, v: jax.Array, visible: jax.Array, *,
                     sm_scale: float, soft_cap: Optional[float] = None) -> jax.Array:
  """q, k [.., H], v [B, S, K, Hv], visible [B, T, S] -> [B, T, N, Hv] (q's dtype).

  Hv may differ from H (MLA attends with latent values narrower than its keys).
  """
  b, t, n, h = q.shape
  num_kv = k.shape[2]
  qg = q.reshape(b, t, num_kv, n // num_kv, h)  # [B, T, K, Q, H]
  scores = jnp.einsum("btkqh,bskh->bkqts", qg, k,
                      preferred_element_type=jnp.float32) * sm_scale
  if soft_cap is not None:
    scores = soft_cap * jnp.tanh(scores / soft_cap)
  mask = visible[:, None, None, :, :]  # [B, 1, 1, T, S]
  scores = jnp.where(mask, scores, -jnp.inf)
  row_max = jnp.max(scores, axis=-1, keepdims=True)
  # Rows with no visible key (padding) get zeros instead of NaN.
  row_max = jnp.where(jnp.isfinite(row_max), row_max, 0.0)
  weights = jnp.where(mask, jnp.exp(scores - row_max), 0.0)
  denom = jnp.sum(weights, axis=-1, keepdims=True)
  weights = weights / jnp.where(denom == 0.0, 1.0, denom)
  out = jnp.einsum("bkqts,bskh->btkqh", weights, v.astype(jnp.float32))
  return out.reshape(b, t, n, v.shape[-1]).astype(q.dtype)
