"""Fused speculative verification (rejection sampling, claim C10) as a Pallas kernel.

The accept rule, in three lines (Leviathan et al. / Chen et al.):
  accept draft i with probability min(1, p_target(x_i) / p_draft(x_i));
  at the first rejection emit one token from normalize(max(0, p_target - p_draft)), stop;
  if all num_draft drafts are accepted, emit a bonus token from target row num_draft.
Greedy rows (temperature 0): accept while draft == argmax(target), then emit argmax.
A zero draft probability (or a draft id outside [0, V)) is a rejection.

Randomness is drawn outside the kernel from `key` with jax.random (one uniform
per draft, one Gumbel vector per row), so the kernel and the reference consume
identical noise and can be compared exactly.  Sampling is Gumbel-max:
argmax_v(log q_v + g_v) draws v ~ q / sum(q) for any unnormalized q >= 0, so
the residual never needs normalizing and q_v = 0 is never drawn.  NaN scores
and vocab padding are -inf; a row with no finite score yields id 0, so no id is
ever >= V.  Fixed shapes, no host sync: the kernel returns (num_accepted,
emitted token) per row and the wrapper lays out tokens [B, K+1] padded with -1.

Dimension legend: B rows, K draft tokens per row, V vocab.
Kernel (grid over B): for each draft row k < num_draft, while still accepting,
one pass over the vocab in `block_v` tiles computes logsumexp(logits / T) and the
argmax; the accept test reads two scalars.  One more pass over the stop row
samples the emitted token.
"""
from __future__ import annotations

import functools
from typing import Optional

import jax
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton
import jax.numpy as jnp

__all__ = ["rejection_sample", "rejection_sample_reference", "draw_noise"]

_NEG_INF = float("-inf")


def draw_noise(key: jax.Array, batch: int, num_draft_max: int, vocab: int):
  """Uniforms [B, K] for the accept tests and Gumbel noise [B, V] for the one emission."""
  k_acc, k_gum = jax.random.split(key)
  u = jax.random.uniform(k_acc, (batch, num_draft_max), jnp.float32)  # [B, K]
  g = jax.random.gumbel(k_gum, (batch, vocab), jnp.float32)  # [B, V]
  return u, g


def _rs_kernel(
    draft_ref,  # [K] int32
    nd_ref,  # [1] int32
    temp_ref,  # [1] f32
    u_ref,  # [K] f32
    logits_ref,  # [K + 1, V]
    *rest,
    block_v: int,
    has_draft_probs: bool,
):
  if has_draft_probs:
    dprobs_ref, gumbel_ref, nacc_ref, tok_ref = rest  # [K, V], [V], [1], [1]
  else:
    dprobs_ref = None
    gumbel_ref, nacc_ref, tok_ref = rest
  num_k, vocab = logits_ref.shape[0] - 1, logits_ref.shape[1]
  n_tiles = pl.cdiv(vocab, block_v)
  lane = lax.broadcasted_iota(jnp.int32, (block_v,), 0)  # [Tv]

  temp = temp_ref[0]
  greedy = temp <= 0.0
  inv_t = jnp.where(greedy, 1.0, 1.0 / jnp.where(greedy, 1.0, temp))
  num_draft = nd_ref[0]

  def load_tile(ref, row, tile, fill):
    """Tile `tile` of ref[row] (or of the 1-D ref when row is None), masked past V."""
    v = tile * block_v + lane
    ok = v < vocab
    idx = pl.ds(tile * block_v, block_v)
    view = ref.at[idx] if row is None else ref.at[row, idx]  # one indexer (Triton)
    x = pltriton.load(view, mask=ok, other=fill).astype(jnp.float32)  # [Tv]
    return v, ok, x

  def argmax_update(best, idx, v, ok, score):
    score = jnp.where(ok & ~jnp.isnan(score), score, _NEG_INF)  # [Tv]
    tile_best = score.max()
    tile_idx = jnp.min(jnp.where(score == tile_best, v, vocab))
    better = tile_best > best  # strict: first index wins across tiles
    return jnp.where(better, tile_best, best), jnp.where(better, tile_idx, idx)

  def row_stats(row, n):
    """(logsumexp(logits[row] * inv_t), argmax(logits[row])) over n tiles."""
    def body(tile, carry):
      m, s, best, idx = carry
      v, ok, x = load_tile(logits_ref, row, tile, _NEG_INF)
      z = jnp.where(ok, x * inv_t, _NEG_INF)
      m_new = jnp.maximum(m, z.max())
      m_safe = jnp.where(m_new == _NEG_INF, 0.0, m_new)
      s = s * jnp.exp(m - m_safe) + jnp.where(ok, jnp.exp(z - m_safe), 0.0).sum()
      best, idx = argmax_update(best, idx, v, ok, x)
      return m_new, s, best, idx
    init = (jnp.float32(_NEG_INF), jnp.float32(0.0), jnp.float32(_NEG_INF), jnp.int32(0))
    m, s, _, idx = lax.fori_loop(jnp.int32(0), n, body, init)  # bounds: one int type
    return m + jnp.log(s), idx

  def accept_body(k, carry):
    still, n_acc, stop_lse = carry
    active = still & (k < num_draft)
    lse, amax = row_stats(k, jnp.where(active, jnp.int32(n_tiles), jnp.int32(0)))
    d = draft_ref[k]
    d_ok = (d >= 0) & (d < vocab)
    d_c = jnp.clip(d, 0, vocab - 1)
    p_t = jnp.exp(logits_ref[k, d_c].astype(jnp.float32) * inv_t - lse)
    p_d = dprobs_ref[k, d_c].astype(jnp.float32) if has_draft_probs else jnp.float32(1.0)
    u = u_ref[k]
    ok = jnp.where(greedy, d_c == amax, (p_d > 0.0) & (u * p_d < p_t)) & d_ok & active
    stop_lse = jnp.where(active & ~ok, lse, stop_lse)
    return still & ok, n_acc + ok.astype(jnp.int32), stop_lse

  _, n_acc, stop_lse = lax.fori_loop(
      0, num_k, accept_body, (jnp.bool_(True), jnp.int32(0), jnp.float32(0.0)))
  rejected = n_acc < num_draft  # else: bonus row num_draft
  row = n_acc
  d_stop = jnp.clip(draft_ref[jnp.minimum(row, num_k - 1)], 0, vocab - 1)
  dp_row = jnp.minimum(row, num_k - 1)

  def emit_body(tile, carry):
    best, idx = carry
    v, ok, x = load_tile(logits_ref, row, tile, 0.0)
    _, _, g = load_tile(gumbel_ref, None, tile, 0.0)
    p_t = jnp.exp(x * inv_t - stop_lse)
    if has_draft_probs:
      _, _, p_d = load_tile(dprobs_ref, dp_row, tile, 0.0)
    else:
      p_d = (v == d_stop).astype(jnp.float32)
    residual = jnp.log(jnp.maximum(p_t - p_d, 0.0))
    sampled = jnp.where(rejected, residual, x * inv_t) + g
    return argmax_update(best, idx, v, ok, jnp.where(greedy, x, sampled))

  _, token = lax.fori_loop(0, n_tiles, emit_body, (jnp.float32(_NEG_INF), jnp.int32(0)))
  nacc_ref[0] = n_acc
  tok_ref[0] = token


def _check(draft_tokens, draft_probs, target_logits, num_draft, temperature):
  if draft_tokens.ndim != 2 or draft_tokens.dtype != jnp.int32:
    raise ValueError(f"draft_tokens must be int32 [B, K], got {draft_tokens.dtype} "
                     f"{draft_tokens.shape}")
  batch, num_k = draft_tokens.shape
  if target_logits.ndim != 3 or target_logits.shape[:2] != (batch, num_k + 1):
    raise ValueError(f"target_logits.shape {target_logits.shape} != [B, K+1, V] with "
                     f"B={batch}, K+1={num_k + 1}")
  if not jnp.issubdtype(target_logits.dtype, jnp.floating):
    raise ValueError(f"target_logits.dtype must be floating, got {target_logits.dtype}")
  vocab = target_logits.shape[2]
  if draft_probs is not None and draft_probs.shape != (batch, num_k, vocab):
    raise ValueError(f"draft_probs.shape {draft_probs.shape} != [B, K, V] = "
                     f"{(batch, num_k, vocab)}")
  if num_draft.shape != (batch,) or num_draft.dtype != jnp.int32:
    raise ValueError(f"num_draft must be int32 [B]={batch}, got {num_draft.dtype} "
                     f"{num_draft.shape}")
  if jnp.shape(temperature) != (batch,):
    raise ValueError(f"temperature must have shape [B]=({batch},), got "
                     f"{jnp.shape(temperature)}")
  if num_k < 1:
    raise ValueError(f"need at least one draft slot, got K={num_k}")
  return batch, num_k, vocab


def _layout_tokens(draft_tokens, n_acc, token):
  """tokens[b, i] = draft i (< n_acc), the emitted token (== n_acc), -1 after."""
  batch, num_k = draft_tokens.shape
  pos = jnp.arange(num_k + 1, dtype=jnp.int32)[None, :]  # [1, K+1]
  drafts = jnp.pad(draft_tokens, ((0, 0), (0, 1)), constant_values=-1)  # [B, K+1]
  tokens = jnp.where(pos < n_acc[:, None], drafts, -1)
  return jnp.where(pos == n_acc[:, None], token[:, None], tokens).astype(jnp.int32)


@functools.partial(jax.jit, static_argnames=("interpret", "block_v", "num_warps"))
def rejection_sample(
    draft_tokens: jax.Array,  # [B, K] int32
    draft_probs: Optional[jax.Array],  # [B, K, V] or None (one-hot drafter)
    target_logits: jax.Array,  # [B, K+1, V]
    num_draft: jax.Array,  # [B] int32 in 0..K
    key: jax.Array,  # PRNG key
    *,
    temperature: jax.Array,  # [B] f32, 0 = greedy
    interpret: bool = False,
    block_v: int = 2048,
    num_warps: int = 4,
):
  """Returns (tokens [B, K+1] int32 padded with -1, num_accepted [B] int32)."""
  batch, num_k, vocab = _check(draft_tokens, draft_probs, target_logits, num_draft,
                               temperature)
  if block_v < 16 or block_v & (block_v - 1):
    raise ValueError(f"block_v={block_v} must be a power of two >= 16")
  u, g = draw_noise(key, batch, num_k, vocab)
  temperature = jnp.asarray(temperature, jnp.float32)
  has_dp = draft_probs is not None
  row = lambda *shape: pl.BlockSpec((None,) + shape, lambda b: (b,) + (0,) * len(shape))
  in_specs = [row(num_k), row(1), row(1), row(num_k), row(num_k + 1, vocab)]
  operands = [draft_tokens, num_draft[:, None], temperature[:, None], u, target_logits]
  if has_dp:
    in_specs.append(row(num_k, vocab))
    operands.append(draft_probs)
  in_specs.append(row(vocab))
  operands.append(g)
  n_acc, token = pl.pallas_call(
      functools.partial(_rs_kernel, block_v=block_v, has_draft_probs=has_dp),
      grid=(batch,),
      in_specs=in_specs,
      out_specs=[row(1), row(1)],
      out_shape=[jax.ShapeDtypeStruct((batch, 1), jnp.int32)] * 2,
      interpret=interpret,
      compiler_params=None if interpret else pltriton.CompilerParams(
          num_warps=num_warps, num_stages=1),
      name="rejection_sample",
  )(*operands)
  n_acc, token = n_acc[:, 0], token[:, 0]
  return _layout_tokens(draft_tokens, n_acc, token), n_acc


@jax.jit
def rejection_sample_reference(draft_tokens, draft_probs, target_logits, num_draft, key,
                               *, temperature):
  """Pure-jnp oracle of `rejection_sample` (same noise, same rule)."""
  batch, num_k, vocab = _check(draft_tokens, draft_probs, target_logits, num_draft,
                               temperature)
  u, g = draw_noise(key, batch, num_k, vocab)  # [B, K], [B, V]
  temperature = jnp.asarray(temperature, jnp.float32)
  greedy = temperature <= 0.0  # [B]
  inv_t = jnp.where(greedy, 1.0, 1.0 / jnp.where(greedy, 1.0, temperature))
  x = target_logits.astype(jnp.float32)  # [B, K+1, V]
  z = x * inv_t[:, None, None]
  lse = jax.nn.logsumexp(z, axis=-1)  # [B, K+1]
  finite_x = jnp.where(jnp.isnan(x), -jnp.inf, x)
  amax = jnp.argmax(finite_x, axis=-1).astype(jnp.int32)  # [B, K+1]

  d_ok = (draft_tokens >= 0) & (draft_tokens < vocab)
  d_c = jnp.clip(draft_tokens, 0, vocab - 1)  # [B, K]
  z_d = jnp.take_along_axis(z[:, :num_k], d_c[..., None], axis=-1)[..., 0]
  p_t = jnp.exp(z_d - lse[:, :num_k])  # [B, K]
  if draft_probs is None:
    p_d = jnp.ones_like(p_t)
  else:
    p_d = jnp.take_along_axis(draft_probs.astype(jnp.float32), d_c[..., None],
                              axis=-1)[..., 0]
  ok = jnp.where(greedy[:, None], d_c == amax[:, :num_k], (p_d > 0.0) & (u * p_d < p_t))
  ok = ok & d_ok & (jnp.arange(num_k)[None, :] < num_draft[:, None])
  n_acc = jnp.cumprod(ok.astype(jnp.int32), axis=1).sum(axis=1).astype(jnp.int32)  # [B]

  rejected = n_acc < num_draft
  rows = jnp.arange(batch)
  x_row = x[rows, n_acc]  # [B, V]
  dp_row = jnp.minimum(n_acc, num_k - 1)
  p_t_row = jnp.exp(x_row * inv_t[:, None] - lse[rows, n_acc][:, None])
  if draft_probs is None:
    p_d_row = jax.nn.one_hot(d_c[rows, dp_row], vocab, dtype=jnp.float32)
  else:
    p_d_row = draft_probs[rows, dp_row].astype(jnp.float32)
  residual = jnp.log(jnp.maximum(p_t_row - p_d_row, 0.0))
  sampled = jnp.where(rejected[:, None], residual, x_row * inv_t[:, None]) + g
  score = jnp.where(greedy[:, None], x_row, sampled)
  score = jnp.where(jnp.isnan(score), -jnp.inf, score)
  token = jnp.argmax(score, axis=-1).astype(jnp.int32)  # [B]; all -inf -> 0
  return _layout_tokens(draft_tokens, n_acc, token), n_acc
