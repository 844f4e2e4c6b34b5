"""Speculative verification (rejection sampling, claim C10) with Pallas vocab kernels.

The accept rule, in three lines (Leviathan et al. / Chen et al.):
  accept draft i with probability min(1, p_target(x_i) / p_draft(x_i));
  at the first rejection emit one token from normalize(max(0, p_target - p_draft)), stop;
  if all num_draft drafts are accepted, emit a bonus token from target row num_draft.
Greedy rows (temperature 0): accept while draft == argmax(target), then emit argmax.
A zero draft probability (or a draft id outside [0, V)) is a rejection.

Randomness is drawn outside the kernels with jax.random from one key per row
(`keys` [B]: one uniform per draft, one Gumbel vector per row), so kernels and
reference consume identical noise and can be compared exactly, and a row's
draws depend on its own key only, never on the batch it shares.  Sampling is Gumbel-max:
argmax_v(log q_v + g_v) draws v ~ q / sum(q) for any unnormalized q >= 0, so
the residual never needs normalizing and q_v = 0 is never drawn.  NaN scores
and vocab padding are -inf; a row with no finite score yields id 0, so no id is
ever >= V.  Fixed shapes, no host sync.

Dimension legend (kvjax's docs/DIMENSIONS.md): B rows, J draft tokens per row, V
vocab, C vocab chunks, Tv vocab tile.
Two Pallas passes, each parallel over (row, vocab chunk) and looping over
`block_v` tiles inside a chunk; the [B, J+1, C] partials are combined in XLA:
  1. `_stats_kernel`: per target row, max and sum of exp(logits / temperature) (-> logsumexp)
     and the first argmax of the logits.
  2. the accept test needs two scalars per draft (`_accept`, shared with the
     reference), then `_emit_kernel` takes the Gumbel argmax over the stop row's
     residual (or bonus, or greedy) scores.
A first version ran one program per row with sequential vocab passes; on the
H200 (B=64, J=4, V=151,936, bf16 logits) it took 0.60 ms against 0.20 ms for
the XLA reference.  Split across (row, chunk) programs it takes 0.18 ms, with
tokens and accept counts equal to the reference's on every row
(results/kernel_bench.json, checks.rs_*).
"""
from __future__ import annotations

import functools
from typing import Optional

import jax
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton
import jax.numpy as jnp

__all__ = ["rejection_sample", "rejection_sample_reference", "greedy_verify", "draw_noise"]

_NEG_INF = float("-inf")


def draw_noise(keys: jax.Array, num_draft_max: int, vocab: int):
  """Per-row keys [B] -> uniforms [B, J] for the accept tests, Gumbel noise [B, V] to emit."""
  if keys.ndim != 1 and not (keys.ndim == 2 and keys.dtype == jnp.uint32):
    raise ValueError(f"keys must hold one PRNG key per row ([B]), got shape {keys.shape}")

  def one(key):
    k_acc, k_gum = jax.random.split(key)
    return (jax.random.uniform(k_acc, (num_draft_max,), jnp.float32),
            jax.random.gumbel(k_gum, (vocab,), jnp.float32))

  return jax.vmap(one)(keys)


def _inv_temperature(temperature):
  greedy = temperature <= 0.0
  return greedy, jnp.where(greedy, 1.0, 1.0 / jnp.where(greedy, 1.0, temperature))


def _tile_loader(vocab, block_v):
  lane = lax.broadcasted_iota(jnp.int32, (block_v,), 0)  # [Tv]

  def load(ref, row, tile, fill):
    """Tile `tile` of ref[row] (of the 1-D ref when row is None), masked past V."""
    v = tile * block_v + lane
    ok = v < vocab
    idx = pl.ds(tile * block_v, block_v)
    view = ref.at[idx] if row is None else ref.at[row, idx]  # one indexer (Triton)
    x = pltriton.load(view, mask=ok, other=fill).astype(jnp.float32)  # [Tv]
    return v, ok, x
  return load


def _argmax_update(best, idx, v, ok, score, vocab):
  """Running (max, first index of max); NaN and padding count as -inf."""
  score = jnp.where(ok & ~jnp.isnan(score), score, _NEG_INF)  # [Tv]
  tile_best = score.max()
  tile_idx = jnp.min(jnp.where(score == tile_best, v, vocab))
  better = tile_best > best  # strict: the first index wins across tiles
  return jnp.where(better, tile_best, best), jnp.where(better, tile_idx, idx)


def _stats_kernel(temp_ref, logits_ref, m_ref, s_ref, best_ref, idx_ref, *,
                  block_v: int, chunk_tiles: int):
  """One (row b, target row k, chunk c): refs [1] f32 temp, [V] logits, [1] outputs."""
  vocab = logits_ref.shape[0]
  load = _tile_loader(vocab, block_v)
  _, inv_t = _inv_temperature(temp_ref[0])
  first = pl.program_id(2) * chunk_tiles

  def body(t, carry):
    m, s, best, idx = carry
    v, ok, x = load(logits_ref, None, first + t, _NEG_INF)
    z = jnp.where(ok, x * inv_t, _NEG_INF)
    m_new = jnp.maximum(m, z.max())
    m_safe = jnp.where(m_new == _NEG_INF, 0.0, m_new)
    s = s * jnp.exp(m - m_safe) + jnp.where(ok, jnp.exp(z - m_safe), 0.0).sum()
    best, idx = _argmax_update(best, idx, v, ok, x, vocab)
    return m_new, s, best, idx

  n = jnp.clip(pl.cdiv(vocab, block_v) - first, 0, chunk_tiles).astype(jnp.int32)
  init = (jnp.float32(_NEG_INF), jnp.float32(0.0), jnp.float32(_NEG_INF), jnp.int32(0))
  m, s, best, idx = lax.fori_loop(jnp.int32(0), n, body, init)
  m_ref[0], s_ref[0], best_ref[0], idx_ref[0] = m, s, best, idx


def _emit_kernel(ints_ref, floats_ref, logits_ref, gumbel_ref, *rest,
                 block_v: int, chunk_tiles: int, has_draft_probs: bool):
  """One (row b, chunk c).  ints [4]: stop row, rejected, stop draft id, draft-prob
  row; floats [2]: logsumexp of the stop row, temperature; logits [J+1, V];
  gumbel [V]; draft probs [J, V] (optional); outputs best [1] f32, idx [1] i32."""
  if has_draft_probs:
    dprobs_ref, best_ref, idx_ref = rest
  else:
    dprobs_ref, (best_ref, idx_ref) = None, rest
  vocab = logits_ref.shape[1]
  load = _tile_loader(vocab, block_v)
  row, rejected, d_stop, dp_row = (ints_ref[i] for i in range(4))
  stop_lse = floats_ref[0]
  greedy, inv_t = _inv_temperature(floats_ref[1])
  first = pl.program_id(1) * chunk_tiles

  def body(t, carry):
    v, ok, x = load(logits_ref, row, first + t, 0.0)
    _, _, g = load(gumbel_ref, None, first + t, 0.0)
    p_t = jnp.exp(x * inv_t - stop_lse)
    if has_draft_probs:
      _, _, p_d = load(dprobs_ref, dp_row, first + t, 0.0)
    else:
      p_d = (v == d_stop).astype(jnp.float32)
    residual = jnp.log(jnp.maximum(p_t - p_d, 0.0))
    sampled = jnp.where(rejected > 0, residual, x * inv_t) + g
    return _argmax_update(*carry, v, ok, jnp.where(greedy, x, sampled), vocab)

  n = jnp.clip(pl.cdiv(vocab, block_v) - first, 0, chunk_tiles).astype(jnp.int32)
  best, idx = lax.fori_loop(jnp.int32(0), n, body,
                            (jnp.float32(_NEG_INF), jnp.int32(0)))
  best_ref[0], idx_ref[0] = best, idx


def _combine_argmax(best, idx, vocab):
  """First index of the max over the last axis of chunk partials [..., C]."""
  top = best.max(axis=-1, keepdims=True)
  return jnp.min(jnp.where(best == top, idx, vocab), axis=-1).astype(jnp.int32)


def _accept(draft_tokens, draft_probs, target_logits, num_draft, temperature, u, lse,
            amax):
  """Accept tests of the rule -> num_accepted [B] (shared by kernel path and reference)."""
  _, num_k = draft_tokens.shape
  vocab = target_logits.shape[2]
  greedy, inv_t = _inv_temperature(temperature)  # [B]
  d_ok = (draft_tokens >= 0) & (draft_tokens < vocab)
  d_c = jnp.clip(draft_tokens, 0, vocab - 1)  # [B, J]
  x_d = jnp.take_along_axis(target_logits[:, :num_k], d_c[..., None], axis=-1)[..., 0]
  p_t = jnp.exp(x_d.astype(jnp.float32) * inv_t[:, None] - lse[:, :num_k])  # [B, J]
  if draft_probs is None:
    p_d = jnp.ones_like(p_t)
  else:
    p_d = jnp.take_along_axis(draft_probs, d_c[..., None], axis=-1)[..., 0]
    p_d = p_d.astype(jnp.float32)
  ok = jnp.where(greedy[:, None], d_c == amax[:, :num_k], (p_d > 0.0) & (u * p_d < p_t))
  ok = ok & d_ok & (jnp.arange(num_k)[None, :] < num_draft[:, None])
  return jnp.cumprod(ok.astype(jnp.int32), axis=1).sum(axis=1).astype(jnp.int32)


def _check(draft_tokens, draft_probs, target_logits, num_draft, temperature):
  if draft_tokens.ndim != 2 or draft_tokens.dtype != jnp.int32:
    raise ValueError(f"draft_tokens must be int32 [B, J], got {draft_tokens.dtype} "
                     f"{draft_tokens.shape}")
  batch, num_k = draft_tokens.shape
  if target_logits.ndim != 3 or target_logits.shape[:2] != (batch, num_k + 1):
    raise ValueError(f"target_logits.shape {target_logits.shape} != [B, J+1, V] with "
                     f"B={batch}, J+1={num_k + 1}")
  if not jnp.issubdtype(target_logits.dtype, jnp.floating):
    raise ValueError(f"target_logits.dtype must be floating, got {target_logits.dtype}")
  vocab = target_logits.shape[2]
  if draft_probs is not None and draft_probs.shape != (batch, num_k, vocab):
    raise ValueError(f"draft_probs.shape {draft_probs.shape} != [B, J, V] = "
                     f"{(batch, num_k, vocab)}")
  if num_draft.shape != (batch,) or num_draft.dtype != jnp.int32:
    raise ValueError(f"num_draft must be int32 [B]={batch}, got {num_draft.dtype} "
                     f"{num_draft.shape}")
  if jnp.shape(temperature) != (batch,):
    raise ValueError(f"temperature must have shape [B]=({batch},), got "
                     f"{jnp.shape(temperature)}")
  if num_k < 1:
    raise ValueError(f"need at least one draft slot, got J={num_k}")
  return batch, num_k, vocab


def _layout_tokens(draft_tokens, n_acc, token):
  """tokens[b, i] = draft i (< n_acc), the emitted token (== n_acc), -1 after."""
  _, num_k = draft_tokens.shape
  pos = jnp.arange(num_k + 1, dtype=jnp.int32)[None, :]  # [1, J+1]
  drafts = jnp.pad(draft_tokens, ((0, 0), (0, 1)), constant_values=-1)  # [B, J+1]
  tokens = jnp.where(pos < n_acc[:, None], drafts, -1)
  return jnp.where(pos == n_acc[:, None], token[:, None], tokens).astype(jnp.int32)


def greedy_verify(draft_tokens: jax.Array, target_logits: jax.Array,
                  num_draft: jax.Array):
  """The temperature-0 rule alone: no noise, no softmax (an all-greedy batch's fast path).

  Equals `rejection_sample_reference` with every temperature 0: accept while
  draft == first argmax of its target row (NaN scores count as -inf), then emit
  the argmax of the stop row.  draft_tokens [B, J], target_logits [B, J+1, V],
  num_draft [B] -> (tokens [B, J+1] padded with -1, num_accepted [B]).
  """
  batch, num_k = draft_tokens.shape
  x = target_logits
  amax = jnp.argmax(jnp.where(jnp.isnan(x), -jnp.inf, x), axis=-1).astype(jnp.int32)
  ok = (draft_tokens == amax[:, :num_k]) & (jnp.arange(num_k)[None, :] < num_draft[:, None])
  n_acc = jnp.cumprod(ok.astype(jnp.int32), axis=1).sum(axis=1).astype(jnp.int32)
  token = amax[jnp.arange(batch), n_acc]  # [B]
  return _layout_tokens(draft_tokens, n_acc, token), n_acc


@functools.partial(jax.jit, static_argnames=("interpret", "block_v", "chunk_tiles",
                                             "num_warps", "num_stages"))
def rejection_sample(
    draft_tokens: jax.Array,  # [B, J] int32
    draft_probs: Optional[jax.Array],  # [B, J, V] or None (one-hot drafter)
    target_logits: jax.Array,  # [B, J+1, V]
    num_draft: jax.Array,  # [B] int32 in 0..J
    keys: jax.Array,  # [B] one PRNG key per row
    *,
    temperature: jax.Array,  # [B] f32, 0 = greedy
    interpret: bool = False,
    block_v: int = 2048,
    chunk_tiles: int = 4,
    num_warps: int = 4,
    num_stages: int = 2,
):
  """Returns (tokens [B, J+1] int32 padded with -1, num_accepted [B] int32)."""
  batch, num_k, vocab = _check(draft_tokens, draft_probs, target_logits, num_draft,
                               temperature)
  if block_v < 16 or block_v & (block_v - 1):
    raise ValueError(f"block_v={block_v} must be a power of two >= 16")
  u, g = draw_noise(keys, num_k, vocab)  # [B, J], [B, V]
  temperature = jnp.asarray(temperature, jnp.float32)
  chunks = pl.cdiv(vocab, block_v * chunk_tiles)  # C
  params = None if interpret else pltriton.CompilerParams(num_warps=num_warps,
                                                          num_stages=num_stages)
  kw = dict(block_v=block_v, chunk_tiles=chunk_tiles)
  one = lambda *lead: pl.BlockSpec((None,) * len(lead) + (1,), lambda *i: i)

  part = jax.ShapeDtypeStruct((batch, num_k + 1, chunks), jnp.float32)
  m, s, best, idx = pl.pallas_call(
      functools.partial(_stats_kernel, **kw),
      grid=(batch, num_k + 1, chunks),
      in_specs=[pl.BlockSpec((None, 1), lambda b, k, c: (b, 0)),
                pl.BlockSpec((None, None, vocab), lambda b, k, c: (b, k, 0))],
      out_specs=[one(0, 0)] * 4,
      out_shape=[part] * 3 + [part.update(dtype=jnp.int32)],
      interpret=interpret, compiler_params=params, name="rejection_sample_stats",
  )(temperature[:, None], target_logits)  # each [B, J+1, C]
  m_top = m.max(axis=-1, keepdims=True)
  m_safe = jnp.where(m_top == _NEG_INF, 0.0, m_top)
  lse = m_top[..., 0] + jnp.log((s * jnp.exp(m - m_safe)).sum(axis=-1))  # [B, J+1]
  amax = _combine_argmax(best, idx, vocab)  # [B, J+1]
  n_acc = _accept(draft_tokens, draft_probs, target_logits, num_draft, temperature,
                  u, lse, amax)  # [B]

  rows = jnp.arange(batch)
  dp_row = jnp.minimum(n_acc, num_k - 1)
  ints = jnp.stack([n_acc, (n_acc < num_draft).astype(jnp.int32),
                    jnp.clip(draft_tokens[rows, dp_row], 0, vocab - 1), dp_row],
                   axis=1).astype(jnp.int32)  # [B, 4]
  floats = jnp.stack([lse[rows, n_acc], temperature], axis=1)  # [B, 2]
  per_row = lambda *shape: pl.BlockSpec((None,) + shape,
                                       lambda b, c: (b,) + (0,) * len(shape))
  in_specs = [per_row(4), per_row(2), per_row(num_k + 1, vocab), per_row(vocab)]
  operands = [ints, floats, target_logits, g]
  if draft_probs is not None:
    in_specs.append(per_row(num_k, vocab))
    operands.append(draft_probs)
  part = jax.ShapeDtypeStruct((batch, chunks), jnp.float32)
  e_best, e_idx = pl.pallas_call(
      functools.partial(_emit_kernel, has_draft_probs=draft_probs is not None, **kw),
      grid=(batch, chunks), in_specs=in_specs, out_specs=[one(0)] * 2,
      out_shape=[part, part.update(dtype=jnp.int32)],
      interpret=interpret, compiler_params=params, name="rejection_sample_emit",
  )(*operands)  # each [B, C]
  token = _combine_argmax(e_best, e_idx, vocab)  # [B]
  return _layout_tokens(draft_tokens, n_acc, token), n_acc


@jax.jit
def rejection_sample_reference(draft_tokens, draft_probs, target_logits, num_draft, keys,
                               *, temperature):
  """Pure-jnp oracle of `rejection_sample` (same noise, same rule)."""
  batch, num_k, vocab = _check(draft_tokens, draft_probs, target_logits, num_draft,
                               temperature)
  u, g = draw_noise(keys, num_k, vocab)  # [B, J], [B, V]
  temperature = jnp.asarray(temperature, jnp.float32)
  greedy, inv_t = _inv_temperature(temperature)  # [B]
  x = target_logits.astype(jnp.float32)  # [B, J+1, V]
  lse = jax.nn.logsumexp(x * inv_t[:, None, None], axis=-1)  # [B, J+1]
  amax = jnp.argmax(jnp.where(jnp.isnan(x), -jnp.inf, x), axis=-1).astype(jnp.int32)
  n_acc = _accept(draft_tokens, draft_probs, target_logits, num_draft, temperature,
                  u, lse, amax)  # [B]

  rejected = n_acc < num_draft
  rows = jnp.arange(batch)
  x_row = x[rows, n_acc]  # [B, V]
  dp_row = jnp.minimum(n_acc, num_k - 1)
  p_t_row = jnp.exp(x_row * inv_t[:, None] - lse[rows, n_acc][:, None])
  if draft_probs is None:
    d_stop = jnp.clip(draft_tokens[rows, dp_row], 0, vocab - 1)
    p_d_row = jax.nn.one_hot(d_stop, vocab, dtype=jnp.float32)
  else:
    p_d_row = draft_probs[rows, dp_row].astype(jnp.float32)
  residual = jnp.log(jnp.maximum(p_t_row - p_d_row, 0.0))
  sampled = jnp.where(rejected[:, None], residual, x_row * inv_t[:, None]) + g
  score = jnp.where(greedy[:, None], x_row, sampled)
  score = jnp.where(jnp.isnan(score), -jnp.inf, score)
  token = jnp.argmax(score, axis=-1).astype(jnp.int32)  # [B]; all -inf -> 0
  return _layout_tokens(draft_tokens, n_acc, token), n_acc
