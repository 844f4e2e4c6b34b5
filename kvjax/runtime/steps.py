"""The jitted pure steps of the static batch: cache in, cache out.

One model step serves prefill, decode and verification: a StepBatch
(kvjax/runtime/step_batch.py, built on the host) says which tokens each row feeds and
where they sit; the cache's `attend` (kvjax/caches/) writes their K/V and
attends through the chosen backend (kvjax/attention/backends.py).  Steps are jitted with
a static config and backend and donate the cache, so pages are updated in
place; callers bucket shapes so compilations stay few.  The device holds only
K/V: lengths and block tables come with every batch from the host.  The
engine's serving programs built on `model_step` are kvjax/runtime/serve_steps.py.

Randomness is not carried in the state: each request samples with
`fold_in(PRNGKey(seed), position)` (kvjax/runtime/sampling.py), so a request's tokens
never depend on which slot it occupies or which other requests share a step,
and a preempted request recomputes to the very same samples.
"""
from __future__ import annotations

import functools
from typing import Union

import jax
import jax.numpy as jnp

from kvjax.attention.backends import Backend, get_backend
from kvjax.attention.variants import layer_variant
from kvjax.lora.weight import route
from kvjax.model.config import ModelConfig
from kvjax.model.decoder import Attend, decoder, lm_logits
from kvjax.model.params import Params
from kvjax.runtime.step_batch import StepBatch

__all__ = ["cache_attend", "model_step", "last_rows", "prefill", "verify"]

BackendArg = Union[str, Backend]


def cache_attend(config: ModelConfig, batch: StepBatch, backend: BackendArg) -> Attend:
  """The model's Attend for `batch`: every layer's cache.attend (a hybrid's linear layers
  its linear_attend), same batch."""
  backend = get_backend(backend)

  def attention(cache, layer, q, k, v, **options):
    variant = layer_variant(config, layer)  # the model's window and attention= at once
    if variant is not None:  # only then: a layer without either passes nothing
      options = dict(options, variant=variant)
    return cache.attend(layer, q, k, v, batch, sm_scale=config.attention_scale,
                        backend=backend, **options)

  def linear(cache, index, inputs):
    return cache.linear_attend(index, inputs, batch, backend)

  return Attend(attention=attention, linear=linear)


def model_step(params: Params, cache, batch: StepBatch, *, config: ModelConfig,
               backend: BackendArg, expert_tokens: bool = False):
  """Feed batch.tokens [B, T] at batch.positions -> (cache, hidden [B, T, D] pre-norm),
  and with `expert_tokens` the fed tokens each layer routed to each expert [L, Ne]
  (decoder's; a row's columns from q_lens on are padding); each row through its LoRA
  adapter slot where the batch names them (kvjax/lora/)."""
  if batch.adapters is not None:
    params = route(params, batch.adapters)
  valid = None
  if expert_tokens:
    valid = jnp.arange(batch.tokens.shape[1])[None, :] < batch.q_lens[:, None]  # [B, T]
  return decoder(params, config, batch.tokens, batch.positions, cache,
                 cache_attend(config, batch, backend), valid)


def last_rows(x: jax.Array, q_lens: jax.Array) -> jax.Array:
  """x [B, T, ...] -> [B, ...] at each row's last real column."""
  index = jnp.maximum(q_lens - 1, 0)
  return jnp.take_along_axis(x, index.reshape((-1,) + (1,) * (x.ndim - 1)), axis=1)[:, 0]


@functools.partial(jax.jit, static_argnames=("config", "backend"), donate_argnames=("cache",))
def prefill(params: Params, cache, batch: StepBatch, *, config: ModelConfig,
            backend: BackendArg = "reference"):
  """Append each row's tokens (a prompt, a chunk, or one decode token)
  -> (cache, logits [B, V], hidden [B, D]) at each row's last real column."""
  cache, hidden = model_step(params, cache, batch, config=config, backend=backend)
  last = last_rows(hidden, batch.q_lens)
  return cache, lm_logits(params, config, last), last


@functools.partial(jax.jit, static_argnames=("config", "backend"), donate_argnames=("cache",))
def verify(params: Params, cache, batch: StepBatch, *, config: ModelConfig,
           backend: BackendArg = "reference"):
  """Score every column in one forward (e.g. [last, d1..dJ], C9)
  -> (cache, logits [B, T, V], hidden [B, T, D])."""
  cache, hidden = model_step(params, cache, batch, config=config, backend=backend)
  return cache, lm_logits(params, config, hidden), hidden
