"""Token sampling: greedy, temperature, top-k, top-p; seeded per request.

Each request's randomness is `fold_in(PRNGKey(seed), position)`, so a request
samples the same tokens whatever batch it shares and whichever slot it sits in.
All parameters are per-row arrays, so changing them never recompiles.
"""
from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

__all__ = ["SamplingParams", "sample", "greedy_tokens", "filtered_logits", "token_logprobs",
           "apply_token_mask", "MAX_LOGPROBS", "TOP_CANDIDATES", "kept_threshold",
           "bisected_threshold"]

MAX_LOGPROBS = 20  # most alternatives a request may ask for per token (OpenAI's limit)


@struct.dataclass
class SamplingParams:
  temperature: jax.Array  # [B] f32; 0 = greedy
  top_k: jax.Array  # [B] int32; 0 = off
  top_p: jax.Array  # [B] f32; 1 = off
  seeds: jax.Array  # [B] uint32
  # vLLM's logit processing (kvjax/runtime/logit_processors.py LogitProcessing), None: none
  # (kvjax.generate); the engine always passes one, inactive when no row asks.
  processing: Any = None

  @classmethod
  def make(cls, batch: int, temperature=0.0, top_k=None, top_p=None, seeds=0):
    """Broadcast scalars or per-row sequences to [batch] arrays (values already checked
    by kvjax/engine/validation.py: this builds device arrays, it does not validate)."""
    def per_row(value, dtype):
      return jnp.broadcast_to(jnp.asarray(value, dtype), (batch,))
    return cls(temperature=per_row(temperature, jnp.float32),
               top_k=per_row(0 if top_k is None else top_k, jnp.int32),
               top_p=per_row(1.0 if top_p is None else top_p, jnp.float32),
               seeds=per_row(seeds, jnp.uint32))

  @classmethod
  def greedy(cls, batch: int) -> "SamplingParams":
    """Every row greedy (host arrays: usable while tracing too)."""
    return cls(temperature=np.zeros(batch, np.float32), top_k=np.zeros(batch, np.int32),
               top_p=np.ones(batch, np.float32), seeds=np.zeros(batch, np.uint32))

  @property
  def needs_filter(self) -> bool:
    """Host-side check (concrete arrays only): is any top-k/top-p active?"""
    return bool(jnp.any(self.top_k > 0) | jnp.any(self.top_p < 1.0))


# How many of a row's largest logits the top-k / top-p filter looks at first (lax.top_k):
# when a row's top-k set and nucleus lie among them, as they do for the top-p and top-k
# values people ask of a trained model at temperatures up to ~1, the filter needs no pass
# over the row but a few reductions; a batch with any row reaching past them finds its
# thresholds by bisection instead, 64 passes over the row and never a [B, V] sort
# (a 262,144-token vocabulary at batch 8: ~1.3 s on 2 cores).
TOP_CANDIDATES = 256


def filtered_logits(logits: jax.Array, top_k: jax.Array, top_p: jax.Array, *,
                    candidates: int = TOP_CANDIDATES) -> jax.Array:
  """Mask logits [B, V] outside each row's top-k and nucleus (top-p) sets with -inf.

  candidates: the C largest logits of each row that decide it when its sets lie among
  them (else bisection over the row; a vocabulary of at most C is sorted)."""
  vocab = logits.shape[-1]
  k = jnp.where(top_k > 0, jnp.minimum(top_k, vocab), vocab)  # [B]
  if vocab <= candidates:
    threshold, _ = kept_threshold(jnp.sort(logits, axis=-1)[:, ::-1], k, top_p, logits)
  else:
    largest, _ = jax.lax.top_k(logits, candidates)  # [B, Vc] descending
    threshold, settled = kept_threshold(largest, k, top_p, logits)
    threshold = jax.lax.cond(jnp.all(settled), lambda _: threshold,
                             lambda x: bisected_threshold(x, k, top_p), logits)
  return jnp.where(logits >= threshold, logits, -jnp.inf)


def kept_threshold(largest: jax.Array, k: jax.Array, top_p: jax.Array, logits: jax.Array):
  """Each row's least kept logit from its largest, descending [B, Vc] (Vc = V: the whole
  row) -> (threshold [B, 1], settled [B]: they decide it, its top-k set (k [B], V: off)
  and nucleus ending within them)."""
  n, vocab = largest.shape[-1], logits.shape[-1]
  rank = jnp.arange(n)[None]
  in_top_k = rank < k[:, None]
  # Reductions, not slices or gathers of `largest`: XLA:CPU then keeps lax.top_k a TopK
  # call, where a slice of it made the compiler sort the whole row instead.
  kth = jnp.min(jnp.where(in_top_k, largest, jnp.inf), axis=-1, keepdims=True)  # [B, 1]
  ranked = jnp.where(in_top_k, largest, -jnp.inf)
  top = jnp.max(largest, axis=-1, keepdims=True)
  weights = jnp.exp(ranked - top)
  # The nucleus' mass is out of the top-k set's: all of it among the n, or the whole row.
  total = jnp.where(k[:, None] <= n, jnp.sum(weights, axis=-1, keepdims=True),
                    jnp.sum(jnp.exp(logits - top), axis=-1, keepdims=True))
  probs = weights / total
  # Keep the smallest prefix whose mass reaches top_p, and the first token always: as a
  # rank, not through `0 < top_p`, which a denormal top_p (1e-39) fails once XLA flushes
  # it to zero, masking every token.
  # top_p >= 1 keeps every token outright: the cumulative mass can round to 1 before
  # the tail, which would drop it, and a row without top-k / top-p must come out
  # unchanged (it shares a filtering batch with rows that ask: filtered_if_asked).
  whole = top_p[:, None] >= 1
  mass_before = jnp.cumsum(probs, axis=-1) - probs
  keep = (mass_before < top_p[:, None]) | whole | (rank == 0)
  cutoff = jnp.min(jnp.where(keep, ranked, jnp.inf), axis=-1, keepdims=True)
  # Past the n largest (top-k off): keep all (top_p >= 1) or the nucleus that ends here.
  beyond = k[:, None] > n
  threshold = jnp.where(beyond & whole, -jnp.inf, jnp.maximum(kth, cutoff))
  settled = (k <= n) | ((k == vocab) & (whole[:, 0] | ~jnp.all(keep, axis=-1)))
  return threshold, settled


def bisected_threshold(logits: jax.Array, k: jax.Array, top_p: jax.Array) -> jax.Array:
  """kept_threshold's threshold [B, 1] without sorting: the k-th largest logit (k [B],
  V: off) is the least value v with fewer than k logits above it, and the nucleus' cutoff
  the least v with less than top_p of the top-k set's mass above it (the same sets as
  kept_threshold's prefix rule, ties included); each found by bisection over the float32
  values in order, 32 halvings of their 2^32 keys."""
  top = jnp.max(logits, axis=-1, keepdims=True)  # [B, 1]
  last = _order_key(top)  # no logit above it, so both rules hold there

  def least_holding(holds):
    def halve(_, bounds):
      lo, hi = bounds
      mid = lo + (hi - lo) // 2
      ok = holds(_from_order_key(mid))
      return jnp.where(ok, lo, mid + 1), jnp.where(ok, mid, hi)

    # From -inf's key up: the keys below it are NaNs, which every comparison fails.
    lowest = jnp.full_like(last, _order_key(jnp.float32(-jnp.inf)))
    _, hi = jax.lax.fori_loop(0, 32, halve, (lowest, last))
    return _from_order_key(hi)

  # Each search runs only when a row asks for it (conds): top-k off, a row keeps all.
  whole_row = k[:, None] >= logits.shape[-1]
  kth = jax.lax.cond(
      jnp.all(whole_row), lambda: jnp.full_like(top, -jnp.inf),
      lambda: least_holding(lambda v: jnp.sum(logits > v, axis=-1, keepdims=True)
                            < k[:, None]))
  kth = jnp.where(whole_row, -jnp.inf, kth)
  weights = jnp.where(logits >= kth, jnp.exp(logits - top), 0.0)
  probs = weights / jnp.sum(weights, axis=-1, keepdims=True)
  whole_mass = top_p[:, None] >= 1
  cutoff = jax.lax.cond(
      jnp.all(whole_mass), lambda: kth,
      lambda: least_holding(lambda v: jnp.sum(jnp.where(logits > v, probs, 0.0), axis=-1,
                                              keepdims=True) < top_p[:, None]))
  return jnp.where(whole_mass, kth, jnp.maximum(kth, cutoff))


def _order_key(x: jax.Array) -> jax.Array:
  """float32 -> uint32 in the same order (negatives' bits flipped, positives' sign set)."""
  bits = jax.lax.bitcast_convert_type(x, jnp.uint32)
  return jnp.where(bits >> 31 == 1, ~bits, bits | jnp.uint32(0x80000000))


def _from_order_key(key: jax.Array) -> jax.Array:
  bits = jnp.where(key >> 31 == 1, key & jnp.uint32(0x7FFFFFFF), ~key)
  return jax.lax.bitcast_convert_type(bits, jnp.float32)


def filtered_if_asked(logits: jax.Array, top_k: jax.Array, top_p: jax.Array) -> jax.Array:
  """filtered_logits when a row asks for top-k or top-p, else logits as they are: a cond,
  so one program serves both and only a batch that filters pays for it."""
  asked = jnp.any((top_k > 0) | (top_p < 1))
  return jax.lax.cond(asked, lambda x: filtered_logits(x, top_k, top_p), lambda x: x, logits)


def apply_token_mask(logits: jax.Array, mask) -> jax.Array:
  """logits [..., V] with -inf where a packed bitmask [..., Vb] (int32 words, token v at
  bit v % 32 of word v // 32; kvjax/constraints/book.py) clears the bit; mask None:
  unchanged.  A mask with every bit set (an engine's unconstrained group) is skipped
  under a cond: [..., Vb] words checked instead of [..., V] logits rewritten."""
  if mask is None:
    return logits

  def masked(logits):
    vocab = jnp.arange(logits.shape[-1], dtype=jnp.int32)
    words = jnp.take(mask, vocab // 32, axis=-1)  # [..., V]
    keep = jnp.bitwise_and(jnp.right_shift(words, vocab % 32), 1) == 1
    return jnp.where(keep, logits, -jnp.inf)

  return jax.lax.cond(jnp.any(mask != -1), masked, lambda x: x, logits)


def greedy_tokens(logits: jax.Array) -> jax.Array:
  """logits [..., V] -> [...] int32: the first index of each row's largest logit, NaN
  counted as -inf (as the verifier counts it, pallas_kernels/spec_verify.py, so plain
  and speculative greedy decoding pick the same token from any logits).

  A max, then the least index holding it: two plain reductions, where jnp.argmax is one
  reduction over (value, index) pairs that XLA's CPU backend ran 2.4x slower (56 vs
  24 us on [8, 4096] logits, a few percent of a batch-8 decode step).
  """
  scores = jnp.where(jnp.isnan(logits), -jnp.inf, logits)
  at_max = scores == jnp.max(scores, axis=-1, keepdims=True)
  vocab = logits.shape[-1]
  return jnp.min(jnp.where(at_max, jnp.arange(vocab, dtype=jnp.int32), vocab), axis=-1)


@functools.partial(jax.jit, static_argnames=("use_filter",))
def sample(logits: jax.Array, params: SamplingParams, positions: jax.Array, *,
           use_filter: bool) -> jax.Array:
  """logits [B, V] float32, positions [B] (index of the token being sampled) -> [B] int32.

  use_filter: rows may ask for top-k / top-p (the filter then runs if one does:
  filtered_if_asked); False leaves it out of the program altogether."""
  if params.processing is not None:  # a cond: the engine's groups always carry it
    logits = jax.lax.cond(params.processing.active, params.processing.apply, lambda x: x,
                          logits)
  greedy = greedy_tokens(logits)

  def draw(_):
    temperature = jnp.where(params.temperature > 0, params.temperature, 1.0)
    scaled = logits / temperature[:, None]
    if params.processing is not None:  # vLLM's order: temperature, min_p, top-k / top-p
      scaled = jax.lax.cond(params.processing.active, params.processing.min_p_filtered,
                            lambda x: x, scaled)
    if use_filter:
      scaled = filtered_if_asked(scaled, params.top_k, params.top_p)
    keys = jax.vmap(lambda s, p: jax.random.fold_in(jax.random.PRNGKey(s), p))(
        params.seeds, positions)
    drawn = jax.vmap(jax.random.categorical)(keys, scaled).astype(jnp.int32)
    return jnp.where(params.temperature > 0, drawn, greedy)

  # An all-greedy batch skips the random bits and the [B, V] noise entirely.
  return jax.lax.cond(jnp.any(params.temperature > 0), draw, lambda _: greedy, None)


def token_logprobs(logits: jax.Array, tokens: jax.Array):
  """Log-probabilities of emitted tokens and the MAX_LOGPROBS likeliest ids.

  logits [B, R, V] (the model's raw logits, before temperature and top-k/top-p,
  as vLLM reports them), tokens [B, R] (ids; -1 padding reads id 0) ->
  (logprobs [B, R] f32, top_ids [B, R, A] int32, top_logprobs [B, R, A] f32),
  A = MAX_LOGPROBS, most likely first.
  """
  log_p = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
  chosen = jnp.take_along_axis(log_p, jnp.maximum(tokens, 0)[..., None], axis=-1)[..., 0]
  top_logprobs, top_ids = jax.lax.top_k(log_p, min(MAX_LOGPROBS, logits.shape[-1]))
  return chosen, top_ids.astype(jnp.int32), top_logprobs
