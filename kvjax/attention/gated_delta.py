"""The gated delta rule (Gated DeltaNet linear attention): chunked prefill, one-step decode.

Per value head the layer keeps a state S [Hk, Hv] instead of K/V.  Token t
with key k_t (L2-normalized), value v_t, log decay g_t <= 0 and write
strength beta_t in (0, 1) updates it by

  S' = exp(g_t) S                       decay everything held
  u_t = beta_t (v_t - k_t^T S')         what S' mispredicts for k_t (the delta)
  S_t = S' + k_t u_t^T                  write the correction
  o_t = q_t^T S_t                       read with the (scaled) query

`delta_rule_step` is that recurrence for one token (decode).  `delta_rule_chunked`
computes the same thing L tokens at a time (prefill): with G_t the cumulative
log decay inside a chunk and S0 the state entering it, unrolling gives

  u_t + sum_{i<t} beta_t exp(G_t - G_i) (k_t . k_i) u_i = beta_t (v_t - exp(G_t) k_t^T S0)

a unit lower-triangular system (I + A) U = beta V - (beta exp(G) K) S0, solved
once per chunk for both right-hand sides; then
  o_t = exp(G_t) q_t^T S0 + sum_{i<=t} exp(G_t - G_i) (q_t . k_i) u_i
  S_L = exp(G_L) S0 + sum_i exp(G_L - G_i) k_i u_i^T
and only the state crosses chunks (a scan).  Columns with beta = 0 and g = 0
leave the state untouched, which is how padding columns are made harmless.

Before the rule, the layer's q, k, v channels pass a causal depthwise conv1d
(`causal_conv`) whose rolling state is the last Kc - 1 inputs; `gated_delta_mix`
runs conv, split, normalization and the rule from given states, so the no-cache
forward (zero states) and the recurrent cache (kvjax/caches/recurrent.py, per-slot
states) share one code path.  `gated_rms_norm` is the layer's output norm.

Shapes: B rows, T columns, Nk / Nv key / value heads (each key head serves
Nv / Nk consecutive value heads), Hk / Hv their head dims, X conv channels
(2 Nk Hk + Nv Hv), Kc the conv kernel width, Lc the chunk length, Nc the chunks.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

__all__ = ["LinearInputs", "l2_normalize", "gated_rms_norm", "causal_conv", "delta_rule_step",
           "delta_rule_chunked", "delta_rule", "gated_delta_mix", "L2_NORM_EPS"]

L2_NORM_EPS = 1e-6  # the FLA kernels' (and HF's) eps of the q/k L2 normalization
_HIGHEST = jax.lax.Precision.HIGHEST  # the state accumulates: no reduced-precision dots


def l2_normalize(x: jax.Array, eps: float = L2_NORM_EPS) -> jax.Array:
  """x [..., H] float32 -> x / sqrt(sum x^2 + eps)."""
  return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + eps)


def gated_rms_norm(x: jax.Array, gate: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
  """RMSNorm(x) * weight * silu(gate): x, gate [..., Hv], weight [Hv] -> [...] in x's dtype.

  The norm is taken in float32 and rounded to x's dtype before the weight, as HF does.
  """
  x32 = x.astype(jnp.float32)
  normed = (x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, -1, keepdims=True) + eps)).astype(x.dtype)
  out = (weight * normed).astype(jnp.float32) * jax.nn.silu(gate.astype(jnp.float32))
  return out.astype(x.dtype)


def causal_conv(x: jax.Array, state: jax.Array, weight: jax.Array, lengths: jax.Array):
  """Depthwise causal conv1d + silu continuing from a rolling state.

  x [B, T, X] (the first lengths[b] columns real), state [B, Kc - 1, X] (the
  inputs before column 0), weight [Kc, X] (weight[Kc - 1] multiplies the
  current input) -> (y [B, T, X], state [B, Kc - 1, X]: the last Kc - 1 real
  inputs, so padding columns never enter it).
  """
  kernel = weight.shape[0]
  history = jnp.concatenate([state.astype(x.dtype), x], axis=1)  # [B, Kc - 1 + T, X]
  t = x.shape[1]
  y = sum(history[:, j:j + t].astype(jnp.float32) * weight[j].astype(jnp.float32)
          for j in range(kernel))
  keep = lengths[:, None] + jnp.arange(kernel - 1)[None, :]  # [B, Kc - 1]
  new_state = jnp.take_along_axis(history, keep[:, :, None], axis=1)
  return jax.nn.silu(y).astype(x.dtype), new_state.astype(state.dtype)


def delta_rule_step(q, k, v, g, beta, state):
  """One token: q, k [B, Nv, Hk], v [B, Nv, Hv], g, beta [B, Nv], state [B, Nv, Hk, Hv] f32
  -> (o [B, Nv, Hv] f32, state)."""
  state = state * jnp.exp(g)[..., None, None]
  predicted = jnp.einsum("bnh,bnhv->bnv", k, state, precision=_HIGHEST)
  delta = beta[..., None] * (v - predicted)
  state = state + k[..., :, None] * delta[..., None, :]
  return jnp.einsum("bnh,bnhv->bnv", q, state, precision=_HIGHEST), state


def _unit_lower_solve(strict: jax.Array, rhs: jax.Array) -> jax.Array:
  """Solve (I + strict) x = rhs for strict [..., Lc, Lc] strictly lower, rhs [..., Lc, Hv + Hk].

  Forward substitution, one row per step over every head at once: as
  exact as a triangular solve, and on XLA:CPU 60x faster than the batched
  `solve_triangular` at Lc = 64 (6 ms against 406 ms for [16, 8, 64, 64]).
  """
  def solve_row(i, x):  # x_i = rhs_i - strict_i . x (rows >= i of x are still 0)
    row = rhs[..., i, :] - jnp.einsum("...j,...jr->...r", strict[..., i, :], x,
                                      precision=_HIGHEST)
    return x.at[..., i, :].set(row)

  return jax.lax.fori_loop(0, rhs.shape[-2], solve_row, jnp.zeros_like(rhs))


def delta_rule_chunked(q, k, v, g, beta, state, chunk: int, capture=None):
  """T tokens, `chunk` at a time: q, k [B, T, Nv, Hk], v [B, T, Nv, Hv], g, beta
  [B, T, Nv] (all float32), state [B, Nv, Hk, Hv] -> (o [B, T, Nv, Hv], state).

  capture [B, Y] int32 column indices (or None): also return the states right
  after those columns, [B, Y, Nv, Hk, Hv] (zeros where an index is outside
  [0, T)), for prefix-cache snapshots at page boundaries.  Inside a chunk the
  state after local column m is exp(G_m) S0 + sum_{i<=m} exp(G_m - G_i) k_i u_i^T,
  so the main path (outputs, final state) is the same with or without captures.
  """
  b, t, nv, hk = k.shape
  pad = -t % chunk  # padded columns: beta = g = 0, so the state passes through
  n = (t + pad) // chunk

  def chunks(x):  # [B, T, Nv, ...] -> [Nc, B, Nv, Lc, ...]
    x = jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
    x = x.reshape((b, n, chunk) + x.shape[2:])
    return jnp.moveaxis(jnp.moveaxis(x, 1, 0), 3, 2)

  q, k, v, g, beta = map(chunks, (q, k, v, g, beta))
  cum = jnp.cumsum(g, axis=-1)  # G [Nc, B, Nv, Lc]
  causal = jnp.tril(jnp.ones((chunk, chunk), bool))
  dot = lambda spec, a, c: jnp.einsum(spec, a, c, precision=_HIGHEST)
  hv = v.shape[-1]

  def scan_chunk(state, xs):
    # One chunk at a time: its [B, Nv, Lc, Lc] terms stay in cache, where every chunk's
    # at once outgrew the CPU's L3 (the solve alone 4x slower at T = 1024).
    q_c, k_c, v_c, beta_c, cum_c = xs
    # exp(G_t - G_i) for i <= t, exactly 0 above the diagonal (masked before exp).
    decay = jnp.exp(jnp.where(causal, cum_c[..., :, None] - cum_c[..., None, :], -jnp.inf))
    strict = jnp.where(causal & ~jnp.eye(chunk, dtype=bool),
                       beta_c[..., :, None] * decay * dot("...th,...ih->...ti", k_c, k_c), 0.0)
    # (I + A) [values | keys] = [beta V | beta exp(G) K], A = strict [B, Nv, Lc, Lc]:
    # values is U's state-free part [.., Lc, Hv], keys its dependence on S0 [.., Lc, Hk].
    solved = _unit_lower_solve(strict, jnp.concatenate(
        [beta_c[..., None] * v_c, (beta_c * jnp.exp(cum_c))[..., None] * k_c], axis=-1))
    values, keys = solved[..., :hv], solved[..., hv:]
    u = values - dot("...th,...hv->...tv", keys, state)
    scores = decay * dot("...th,...ih->...ti", q_c, k_c)  # [.., Lc, Lc], diagonal included
    out = jnp.exp(cum_c)[..., None] * dot("...th,...hv->...tv", q_c, state) + dot(
        "...ti,...iv->...tv", scores, u)
    to_end = jnp.exp(cum_c[..., -1:] - cum_c)[..., None] * k_c  # exp(G_L - G_i) k_i
    new_state = jnp.exp(cum_c[..., -1])[..., None, None] * state + dot(
        "...ih,...iv->...hv", to_end, u)
    return new_state, (out, state, u)

  state, (out, entering, u) = jax.lax.scan(scan_chunk, state, (q, k, v, beta, cum))
  out = jnp.moveaxis(out, 2, 3)  # [Nc, B, Lc, Nv, Hv]
  out = jnp.moveaxis(out, 0, 1).reshape(b, n * chunk, nv, -1)
  if capture is None:
    return out[:, :t], state
  # The state after column c (local m = c mod Lc of chunk c // Lc, entered with S0):
  # exp(G_m) S0 + sum_{i<=m} exp(G_m - G_i) k_i u_i^T.
  at_chunk = jnp.clip(capture // chunk, 0, n - 1)  # [B, Y]
  local = jnp.clip(capture - at_chunk * chunk, 0, chunk - 1)
  rows = jnp.arange(b)[:, None]
  s0, k_y, u_y, cum_y = (x[at_chunk, rows] for x in (entering, k, u, cum))  # [B, Y, Nv, ...]
  cum_m = jnp.take_along_axis(cum_y, local[:, :, None, None], axis=-1)  # G_m [B, Y, Nv, 1]
  upto = jnp.arange(chunk)[None, None, None, :] <= local[:, :, None, None]  # [B, Y, 1, Lc]
  weight = jnp.exp(jnp.where(upto, cum_m - cum_y, -jnp.inf))  # [B, Y, Nv, Lc]
  captured = jnp.exp(cum_m)[..., None] * s0 + jnp.einsum(
      "byni,bynih,byniv->bynhv", weight, k_y, u_y, precision=_HIGHEST)
  inside = (capture >= 0) & (capture < t)
  return out[:, :t], state, jnp.where(inside[..., None, None, None], captured, 0)


@dataclasses.dataclass(frozen=True)
class LinearInputs:
  """What a Gated DeltaNet layer hands its state keeper (a cache, or zero states).

  A hybrid cache's `attend` takes this in place of q (k and v None) and runs
  `gated_delta_mix` on its per-slot states (kvjax/caches/recurrent.py).
  """
  qkv: jax.Array  # [B, T, X] conv input: q, k, v channels, in that order
  g: jax.Array  # [B, T, Nv] f32 log decay (<= 0)
  beta: jax.Array  # [B, T, Nv] f32 write strength
  conv_weight: jax.Array  # [Kc, X]
  num_key_heads: int
  key_head_dim: int
  num_value_heads: int
  value_head_dim: int
  chunk: int  # static chunk length of the chunked form


def delta_rule(q, k, v, g, beta, state, chunk: int, capture):
  """The rule over any T, the reference of the backend slot `Backend.delta_rule`:
  q, k [B, T, Nv, Hk], v [B, T, Nv, Hv], g, beta [B, T, Nv] f32, state [B, Nv, Hk, Hv],
  capture [B, Y] int32 columns or None -> (o [B, T, Nv, Hv], state, states after the
  captured columns [B, Y, Nv, Hk, Hv] or None).  T == 1 runs the one-step
  recurrence, longer inputs the chunked form (chunk = Lc)."""
  if q.shape[1] > 1:
    if capture is None:
      return delta_rule_chunked(q, k, v, g, beta, state, chunk) + (None,)
    return delta_rule_chunked(q, k, v, g, beta, state, chunk, capture)
  out, state = delta_rule_step(q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0], state)
  captured = None if capture is None else jnp.where(
      (capture == 0)[..., None, None, None], state[:, None], 0)
  return out[:, None], state, captured


def gated_delta_mix(inputs: LinearInputs, conv_state: jax.Array, delta_state: jax.Array,
                    lengths: jax.Array, capture=None, rule=delta_rule):
  """Conv, q/k normalization and the gated delta rule from given states.

  conv_state [B, Kc - 1, X], delta_state [B, Nv, Hk, Hv] f32, lengths [B] real
  columns -> (o [B, T, Nv, Hv] f32, conv_state, delta_state).  capture [B, Y]
  int32 columns (or None): also return the states right after them, (conv
  [B, Y, Kc - 1, X], delta [B, Y, Nv, Hk, Hv]), zeros for a column outside
  [0, T) (see delta_rule_chunked).  `rule`: the backend's delta rule
  (`delta_rule`'s contract).
  """
  x = inputs.qkv
  b, t, _ = x.shape
  nk, hk, nv, hv = (inputs.num_key_heads, inputs.key_head_dim, inputs.num_value_heads,
                    inputs.value_head_dim)
  mixed, new_conv = causal_conv(x, conv_state, inputs.conv_weight, lengths)
  mixed = mixed.astype(jnp.float32)
  q = mixed[..., :nk * hk].reshape(b, t, nk, hk)
  k = mixed[..., nk * hk:2 * nk * hk].reshape(b, t, nk, hk)
  v = mixed[..., 2 * nk * hk:].reshape(b, t, nv, hv)
  # Key head j // (Nv / Nk) serves value head j.
  q = jnp.repeat(l2_normalize(q), nv // nk, axis=2) * hk ** -0.5
  k = jnp.repeat(l2_normalize(k), nv // nk, axis=2)
  valid = (jnp.arange(t)[None, :] < lengths[:, None])[..., None]  # [B, T, 1]
  g = jnp.where(valid, inputs.g, 0.0)
  beta = jnp.where(valid, inputs.beta, 0.0)
  out, new_delta, delta_at = rule(q, k, v, g, beta, delta_state, inputs.chunk, capture)
  if capture is None:
    return out, new_conv, new_delta
  inside = (capture >= 0) & (capture < t)  # [B, Y]
  # The conv state after column c: the Kc - 1 inputs ending at c, in [old state; x].
  history = jnp.concatenate([conv_state.astype(x.dtype), x], axis=1)  # [B, Kc - 1 + T, X]
  window = jnp.clip(capture, -1, t - 1)[:, :, None] + 1 + jnp.arange(conv_state.shape[1])
  conv_at = jnp.take_along_axis(history[:, None], window[..., None], axis=2)  # [B, Y, Kc-1, X]
  conv_at = jnp.where(inside[..., None, None], conv_at, 0).astype(conv_state.dtype)
  return out, new_conv, new_delta, (conv_at, delta_at)
