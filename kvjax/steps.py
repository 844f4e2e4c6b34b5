"""The jitted pure steps: state in, state out.

`DecodeState` carries the KV cache, the block tables and the sequence lengths
through `prefill` / `decode` / `verify`; the host only decides which slots
(rows of the state) and pages a step uses.  One model step serves all three:
a batch of B rows, each with T query tokens of which `q_lens[b]` are real,
appended at the end of slot `slot_ids[b]`'s sequence.  Steps are jitted with a
static config and backend name and donate the state, so the cache is updated
in place; shapes are bucketed by the callers so compilations stay few.

Randomness is not carried in the state: each request samples with
`fold_in(PRNGKey(seed), position)` (kvjax/sampling.py), so a request's tokens
never depend on which slot it occupies or which other requests share a step,
and a preempted request recomputes to the very same samples.
"""
from __future__ import annotations

import functools
from typing import Optional, Union

import jax
import jax.numpy as jnp
from flax import struct

from kvjax.attention.mla import MLAPagedCache
from kvjax.attention.registry import get_backend
from kvjax.cache import ContiguousKVCache, PagedKVCache, StepBatch
from kvjax.config import ModelConfig
from kvjax.model import decoder, lm_logits
from kvjax.params import Params
from kvjax.quant.kv import KIVIPagedKVCache, check_kv_dtype, create_paged_cache

__all__ = ["DecodeState", "model_step", "prefill", "decode", "verify", "init_paged_state",
           "init_contiguous_state"]


@struct.dataclass
class DecodeState:
  cache: Union[PagedKVCache, ContiguousKVCache, MLAPagedCache, KIVIPagedKVCache]
  block_tables: jax.Array  # [slots, Pmax] int32 page ids (0 = null page); [slots, 0] if contiguous
  seq_lens: jax.Array  # [slots] int32 tokens cached per slot


def init_paged_state(cfg: ModelConfig, num_slots: int, num_pages: int, page_size: int,
                     max_pages_per_seq: int, dtype, kv_dtype: Optional[str] = None, *,
                     with_mtp: bool = False) -> DecodeState:
  """Empty pages; kv_dtype None keeps `dtype`, else see kvjax/quant/kv.py (int8, int4, ...).

  The MTP modules' KV layers are allocated only `with_mtp` (speculative
  drafting): a plain decoder never writes them (claim C11's memory cost).
  """
  if cfg.attention_type == "mla":
    check_kv_dtype(kv_dtype, cfg, "paged", "reference")
    cache = MLAPagedCache.create(cfg, num_pages, page_size, dtype, with_mtp=with_mtp)
  else:
    cache = create_paged_cache(cfg, kv_dtype, num_slots, num_pages, page_size, dtype,
                               with_mtp=with_mtp)
  return DecodeState(cache=cache,
                     block_tables=jnp.zeros((num_slots, max_pages_per_seq), jnp.int32),
                     seq_lens=jnp.zeros((num_slots,), jnp.int32))


def init_contiguous_state(cfg: ModelConfig, num_slots: int, max_len: int, dtype) -> DecodeState:
  """Every slot reserves max_len tokens of the trunk's layers (the C7 baseline)."""
  if cfg.attention_type == "mla":
    # One latent "kv head": keys [latent; rope key], values the latent (stored twice;
    # the contiguous cache is a baseline, MLAPagedCache stores it once).
    shape = (cfg.num_layers, num_slots, max_len, 1)
    r = cfg.kv_lora_rank
    cache = ContiguousKVCache(k=jnp.zeros(shape + (r + cfg.qk_rope_head_dim,), dtype),
                              v=jnp.zeros(shape + (r,), dtype))
  else:
    cache = ContiguousKVCache.create(cfg.num_layers, cfg.num_kv_heads, num_slots,
                                     max_len, cfg.head_dim, dtype)
  return DecodeState(cache=cache, block_tables=jnp.zeros((num_slots, 0), jnp.int32),
                     seq_lens=jnp.zeros((num_slots,), jnp.int32))


def model_step(params: Params, state: DecodeState, tokens: jax.Array, q_lens: jax.Array,
               slot_ids: jax.Array, *, config: ModelConfig, backend: str):
  """tokens [B, T], q_lens [B], slot_ids [B] -> (state, hidden [B, T, D] pre-norm)."""
  t = tokens.shape[1]
  context = state.seq_lens[slot_ids]  # [B]
  batch = StepBatch(slot_ids=slot_ids, q_lens=q_lens,
                    positions=context[:, None] + jnp.arange(t, dtype=jnp.int32)[None],
                    kv_lens=context + t, block_tables=state.block_tables[slot_ids])
  attention_backend = get_backend(backend)

  def attend(cache, layer, q, k, v):
    return cache.attend(layer, q, k, v, batch, sm_scale=config.head_dim ** -0.5,
                        window=config.window_of_layer(layer), backend=attention_backend)

  cache, hidden = decoder(params, config, tokens, batch.positions, state.cache, attend)
  state = state.replace(cache=cache, seq_lens=state.seq_lens.at[slot_ids].add(q_lens))
  return state, hidden


def _last_rows(x: jax.Array, q_lens: jax.Array) -> jax.Array:
  """x [B, T, ...] -> [B, ...] at each row's last real token."""
  index = jnp.maximum(q_lens - 1, 0)
  return jnp.take_along_axis(x, index.reshape((-1,) + (1,) * (x.ndim - 1)), axis=1)[:, 0]


@functools.partial(jax.jit, static_argnames=("config", "backend"), donate_argnames=("state",))
def prefill(params: Params, state: DecodeState, tokens: jax.Array, q_lens: jax.Array,
            slot_ids: jax.Array, *, config: ModelConfig, backend: str = "reference"):
  """Append a (chunk of a) prompt per row -> (state, logits [B, V], hidden [B, D]) at its end."""
  state, hidden = model_step(params, state, tokens, q_lens, slot_ids, config=config,
                             backend=backend)
  last = _last_rows(hidden, q_lens)
  return state, lm_logits(params, config, last), last


def decode(params: Params, state: DecodeState, tokens: jax.Array, slot_ids: jax.Array, *,
           config: ModelConfig, backend: str = "reference"):
  """One new token per row: tokens [B] -> (state, logits [B, V], hidden [B, D])."""
  q_lens = jnp.ones(tokens.shape, jnp.int32)
  return prefill(params, state, tokens[:, None], q_lens, slot_ids, config=config,
                 backend=backend)


@functools.partial(jax.jit, static_argnames=("config", "backend"), donate_argnames=("state",))
def verify(params: Params, state: DecodeState, tokens: jax.Array, q_lens: jax.Array,
           slot_ids: jax.Array, *, config: ModelConfig, backend: str = "reference"):
  """Score [last, d1..dK] per row in one forward -> (state, logits [B, T, V], hidden [B, T, D])."""
  state, hidden = model_step(params, state, tokens, q_lens, slot_ids, config=config,
                             backend=backend)
  return state, lm_logits(params, config, hidden), hidden
