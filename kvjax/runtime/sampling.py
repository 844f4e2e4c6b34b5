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
           "apply_token_mask", "MAX_LOGPROBS"]

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


def filtered_logits(logits: jax.Array, top_k: jax.Array, top_p: jax.Array) -> jax.Array:
  """Mask logits [B, V] outside each row's top-k and nucleus (top-p) sets with -inf."""
  vocab = logits.shape[-1]
  sorted_logits = jnp.sort(logits, axis=-1)[:, ::-1]  # [B, V] descending
  k = jnp.where(top_k > 0, jnp.minimum(top_k, vocab), vocab)
  kth = jnp.take_along_axis(sorted_logits, (k - 1)[:, None], axis=-1)  # [B, 1]
  sorted_logits = jnp.where(jnp.arange(vocab)[None] < k[:, None], sorted_logits, -jnp.inf)
  probs = jax.nn.softmax(sorted_logits, axis=-1)
  # Keep the smallest prefix whose mass reaches top_p, and the first token always: as a
  # rank, not through `0 < top_p`, which a denormal top_p (1e-39) fails once XLA flushes
  # it to zero, masking every token.
  # top_p >= 1 keeps every token outright: the cumulative mass can round to 1 before
  # the tail, which would drop it, and a row without top-k / top-p must come out
  # unchanged (it shares a filtering batch with rows that ask: filtered_if_asked).
  mass_before = jnp.cumsum(probs, axis=-1) - probs
  keep = ((mass_before < top_p[:, None]) | (top_p[:, None] >= 1)
          | (jnp.arange(vocab)[None] == 0))
  cutoff = jnp.min(jnp.where(keep, sorted_logits, jnp.inf), axis=-1, keepdims=True)
  threshold = jnp.maximum(kth, cutoff)
  return jnp.where(logits >= threshold, logits, -jnp.inf)


def filtered_if_asked(logits: jax.Array, top_k: jax.Array, top_p: jax.Array) -> jax.Array:
  """filtered_logits when a row asks for top-k or top-p, else logits as they are: a cond,
  so one program serves both and only a batch that filters pays the [B, V] sort."""
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
