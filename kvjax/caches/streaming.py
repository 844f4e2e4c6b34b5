"""Attention sinks + a window (StreamingLLM, Xiao et al. 2023) as one KV layout.

A query at position p reads the first `sinks` tokens and the last `window`
ones: key j is visible iff j <= p and (j < sinks or j > p - window).  The sink
tokens absorb the attention mass a softmax must put somewhere, so a model keeps
its quality far past the window, at a bounded cache.

Pages.  The pages holding the sinks (logical pages 0 .. ceil(sinks / Z) - 1)
are kept; a page wholly after them and wholly before the window of a request's
next query is dead and released (`SinkWindowRelease`), exactly as the sliding
window releases pages before its window (kvjax/engine/sched/scheduler.py): the page returns
to the allocator, a cached one stays cached (evictable), and its block-table
entry becomes the null page, which the mask hides.  A request then holds at
most ceil(sinks / Z) + ceil((window + n - 2) / Z) + 1 pages for a row of n
positions, however long it runs.

Attention.  The rows' pages are gathered and attended densely with the sinks +
window mask (`sink_window_visibility`), so any backend serves it (its kernels
are not asked).  Float pages (the model dtype, or `store`); the contiguous twin masks the
same way.  Models with their own sliding windows are refused (one window rule).

`streaming_layout(sinks, window)` is the record for any sizes (pass it as
kv_dtype, or register it to name it on a command line); "streaming" is
StreamingLLM's 4 sinks + 1020 recent tokens.
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import jax
import jax.numpy as jnp
from flax import struct

from kvjax.attention.dense import masked_attention
from kvjax.caches.contiguous import ContiguousKVCache
from kvjax.caches.layout import KVLayout, PageRelease, register
from kvjax.caches.paged import PagedKVCache, kv_page_arrays
from kvjax.model.config import ModelConfig
from kvjax.runtime.step_batch import StepBatch

__all__ = ["sink_window_visibility", "SinkWindowCache", "SinkWindowContiguousCache",
           "SinkWindowRelease", "streaming_layout"]


def sink_window_visibility(kv_lens: jax.Array, t: int, s: int, sinks: int,
                           window: int) -> jax.Array:
  """[B, T, S] visibility of kv_lens [B] padded rows (query t at kv_lens - T + t, key j
  at j): valid, causal, and a sink or inside the window."""
  q_positions = (kv_lens[:, None] - t + jnp.arange(t)[None, :])[:, :, None]  # [B, T, 1]
  k_positions = jnp.arange(s)[None, None, :]  # [1, 1, S]
  valid = k_positions < kv_lens[:, None, None]
  return valid & (k_positions <= q_positions) & (
      (k_positions < sinks) | (k_positions > q_positions - window))


def _gather_rows(pages: jax.Array, block_tables: jax.Array) -> jax.Array:
  """pages [K, P, Z, H], block_tables [B, W] -> the rows' keys or values [B, W*Z, K, H]."""
  rows = pages[:, block_tables]  # [K, B, W, Z, H]
  num_kv, b, w, z, h = rows.shape
  return rows.transpose(1, 2, 3, 0, 4).reshape(b, w * z, num_kv, h)


@struct.dataclass
class SinkWindowCache(PagedKVCache):
  GATHERS_ROWS = False  # its attention is its own, not a backend's gathered_attention
  sinks: int = struct.field(pytree_node=False, default=4)
  window: int = struct.field(pytree_node=False, default=1020)

  def attend(self, layer: int, q, k, v, batch: StepBatch, *, sm_scale: float,
             window: Optional[int], backend):
    """Write k, v [B, T, K, H]; q [B, T, N, H] attends the sinks and the window."""
    del window, backend  # the model has no window of its own (check_model); read densely
    cache = self.write(layer, k, v, batch)
    keys = _gather_rows(cache.k_pages[layer], batch.block_tables)
    values = _gather_rows(cache.v_pages[layer], batch.block_tables)
    visible = sink_window_visibility(batch.kv_lens, q.shape[1], keys.shape[1], self.sinks,
                                     self.window)
    return cache, masked_attention(q, keys, values, visible, sm_scale=sm_scale)


@struct.dataclass
class SinkWindowContiguousCache(ContiguousKVCache):
  sinks: int = struct.field(pytree_node=False, default=4)
  window: int = struct.field(pytree_node=False, default=1020)

  def visibility(self, kv_lens: jax.Array, t: int, s: int, window: Optional[int],
                 variant=None) -> jax.Array:
    del window, variant  # the model has no window (_check_model); variants refused (layout)
    return sink_window_visibility(kv_lens, t, s, self.sinks, self.window)


@dataclasses.dataclass(frozen=True)
class SinkWindowRelease(PageRelease):
  """Keeps the sink pages, releases the pages between them and the window."""

  sinks: int = 4
  window: int = 1020

  def dead_pages(self, start: int) -> range:
    first = -(-self.sinks // self.page_size)  # pages holding a sink stay
    end = max(0, start - self.window + 1) // self.page_size  # pages before the window
    return range(first, max(first, end))

  def max_pages_held(self, num_tokens: int, max_num_batched_tokens: int) -> int:
    pages = super().max_pages_held(num_tokens, max_num_batched_tokens)
    span = self.window + max_num_batched_tokens - 2  # a row writes n <= the budget
    sink_pages = -(-self.sinks // self.page_size)
    return min(pages, sink_pages + -(-span // self.page_size) + 1)


def _check_model(cfg: ModelConfig) -> None:
  if cfg.sliding_window is not None or any(w is not None for w in cfg.layer_windows or ()):
    raise ValueError(f"kv layout 'streaming' (attention sinks + window) needs a model "
                     f"without sliding windows; {cfg.name!r} has them")


def _contiguous(cfg: ModelConfig, num_slots: int, max_len: int, dtype, *, sinks: int,
                window: int) -> SinkWindowContiguousCache:
  shape = (cfg.cache_layers(False), num_slots, max_len, cfg.num_kv_heads, cfg.head_dim)
  return SinkWindowContiguousCache(k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype),
                                   sinks=sinks, window=window)


def _release(page_size: int, model_window: Optional[int], *, sinks: int,
             window: int) -> SinkWindowRelease:
  del model_window  # none (_check_model)
  return SinkWindowRelease(page_size, sinks, window)


def streaming_layout(sinks: int = 4, window: int = 1020, name: Optional[str] = None,
                     store: Optional[str] = None) -> KVLayout:
  """The sinks + window layout (name: f"sinks{sinks}-window{window}"), pages stored as
  `store` ("fp32", "bf16", "fp16"; None: the model dtype)."""
  for field, value in (("sinks", sinks), ("window", window)):
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
      raise ValueError(f"streaming_layout: {field} must be an int >= 1, got {value!r}")
  return KVLayout(name or f"sinks{sinks}-window{window}", kv_page_arrays, SinkWindowCache,
                  store=store, contiguous=_contiguous, release=_release, check_model=_check_model,
                  options=(("sinks", sinks), ("window", window)))


register(streaming_layout(name="streaming"))
