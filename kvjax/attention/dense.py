"""Dense masked attention over explicit key positions (no pages).

Used by the no-cache forward (keys are the query tokens themselves) and by the
contiguous cache (keys are a per-row [S] buffer).  Query row i of batch row b sits
at `q_positions[b, i]`; key j at `k_positions[b, j]`; it is visible iff it is
valid, not in the future and the attention variant's mask shows it
(kvjax/attention/variants.py; the model's sliding window is one), whose score applies too.

`grouped_attention` is the shared core (the paged reference backend calls it
too), written kv-head-major ([K, B, ...]) so both matmuls batch over leading
(K, B) axes, and normalizing the [.., Hv] output instead of the [.., S] weights.
Keys come transposed, [K, B, H, S], so the score matmul is a plain [Gq*T, H] @ [H, S]
per (kv head, row): XLA's CPU dots ran the form with a transposed operand slower
(Intel Xeon, 2 cores: one attention at K=2, B=8, Gq=4, T=1, S=256, H=32 took 120 vs
86 us; a batch-8 kvjax.generate decode step 1.46 vs 1.33 ms, batch 1 unchanged).
"""
from __future__ import annotations

from typing import Callable, Optional

import jax
import jax.numpy as jnp

from kvjax.attention.variants import AttentionVariant, variant_mask, variant_scores

__all__ = ["masked_attention", "grouped_attention", "visibility_mask", "padded_visibility",
           "padded_positions", "padded_scores"]


def visibility_mask(q_positions: jax.Array, k_positions: jax.Array,
                    k_valid: jax.Array,
                    variant: Optional[AttentionVariant] = None) -> jax.Array:
  """[B, T, S] bool: causal (and the variant's mask) visibility."""
  qp = q_positions[:, :, None]  # [B, T, 1]
  kp = k_positions[:, None, :]  # [B, 1, S]
  visible = (kp <= qp) & k_valid[:, None, :]
  masked = variant_mask(variant, qp, kp)
  return visible if masked is None else visible & masked


def padded_positions(kv_lens: jax.Array, t: int, s: int) -> tuple[jax.Array, jax.Array]:
  """(q_positions [B, T], k_positions [B, S]) of kv_lens [B] padded rows: query t at
  kv_lens - T + t, key j at j (kvjax/runtime/step_batch.py)."""
  b = kv_lens.shape[0]
  q_positions = kv_lens[:, None] - t + jnp.arange(t)[None, :]  # [B, T]
  return q_positions, jnp.broadcast_to(jnp.arange(s)[None, :], (b, s))


def padded_visibility(kv_lens: jax.Array, t: int, s: int,
                      variant: Optional[AttentionVariant] = None) -> jax.Array:
  """[B, T, S] visibility of kv_lens [B] padded rows (padded_positions).

  The layout every paged read shares (kvjax/runtime/step_batch.py): keys past kv_lens
  are invalid, the rest causal and masked by the variant.
  """
  q_positions, k_positions = padded_positions(kv_lens, t, s)
  return visibility_mask(q_positions, k_positions, k_positions < kv_lens[:, None], variant)


def padded_scores(kv_lens: jax.Array, t: int, s: int,
                  variant: Optional[AttentionVariant]) -> Optional[Callable]:
  """The variant's score over padded rows' [K, B, Gq, T, S] scores, or None."""
  return variant_scores(variant, *padded_positions(kv_lens, t, s))


def grouped_attention(q: jax.Array, k_t: jax.Array, v: jax.Array, visible: jax.Array, *,
                      sm_scale: float, soft_cap: Optional[float] = None,
                      sinks: Optional[jax.Array] = None,
                      score_mod: Optional[Callable] = None) -> jax.Array:
  """q [K, B, Gq, T, H], k_t [K, B, H, S], v [K, B, S, Hv], visible [B, T, S]
  -> f32 [K, B, Gq, T, Hv].

  Softmax normalization is applied after the value matmul (on [.., Hv], not
  [.., S]); rows with no visible key (padding) get zeros instead of NaN.
  `sinks` [K, Gq] (gpt-oss's learned per-head sinks) add one logit per head to
  each softmax denominator: a key every query sees whose value is zero.
  `score_mod` (an attention variant's, variants.variant_scores) maps the scaled
  [K, B, Gq, T, S] scores after the soft-cap.
  """
  num_kv, b, group, t, h = q.shape
  scores = jnp.einsum("kbih,kbhs->kbis", q.reshape(num_kv, b, group * t, h), k_t,
                      preferred_element_type=jnp.float32)
  scores = scores.reshape(num_kv, b, group, t, -1) * sm_scale  # [K, B, Gq, T, S]
  if soft_cap is not None:
    scores = soft_cap * jnp.tanh(scores / soft_cap)
  if score_mod is not None:
    scores = score_mod(scores)
  scores = jnp.where(visible[None, :, None], scores, -jnp.inf)
  row_max = jnp.max(scores, axis=-1, keepdims=True)
  if sinks is not None:
    sink = sinks.astype(jnp.float32)[:, None, :, None, None]  # [K, 1, Gq, 1, 1]
    row_max = jnp.maximum(row_max, sink)
  row_max = jnp.where(jnp.isfinite(row_max), row_max, 0.0)
  weights = jnp.exp(scores - row_max)  # exactly 0 where not visible
  denom = jnp.sum(weights, axis=-1, keepdims=True)
  if sinks is not None:
    denom = denom + jnp.exp(sink - row_max)
  out = jnp.einsum("kbis,kbsh->kbih", weights.reshape(num_kv, b, group * t, -1),
                   v.astype(jnp.float32))
  out = out.reshape(num_kv, b, group, t, -1)
  return out / jnp.where(denom == 0.0, 1.0, denom)


def masked_attention(q: jax.Array, k: jax.Array, v: jax.Array, visible: jax.Array, *,
                     sm_scale: float, soft_cap: Optional[float] = None,
                     sinks: Optional[jax.Array] = None,
                     score_mod: Optional[Callable] = None) -> jax.Array:
  """q [B, T, N, H], k [B, S, K, H], v [B, S, K, Hv], visible [B, T, S], sinks [N] or None
  -> [B, T, N, Hv] (q's dtype); score_mod as in grouped_attention.

  Hv may differ from H (MLA attends with latent values narrower than its keys).
  """
  b, t, n, h = q.shape
  num_kv = k.shape[2]
  qg = q.reshape(b, t, num_kv, n // num_kv, h).transpose(2, 0, 3, 1, 4)  # [K, B, Gq, T, H]
  out = grouped_attention(qg, k.transpose(2, 0, 3, 1), v.transpose(2, 0, 1, 3), visible,
                          sm_scale=sm_scale, soft_cap=soft_cap,
                          sinks=None if sinks is None else sinks.reshape(num_kv, -1),
                          score_mod=score_mod)
  return out.transpose(1, 3, 0, 2, 4).reshape(b, t, n, v.shape[-1]).astype(q.dtype)
