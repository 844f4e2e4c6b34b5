"""A decode step under a window reads the window's blocks, not the whole table (issue 49).

The reference backend's decode walks from the block holding the window's first key
(kvjax/attention/paged.py), so at 8k context it reads a bounded number of pages; a
variant with leading keys (StreamingLLM's sinks) reads their block first and skips
the masked middle.  The proof counts what is read by poisoning: every page that is
not walked holds NaN keys and values, which any read would carry into the output (a
masked weight 0 times NaN is NaN), while the gather of the whole table does.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvjax.attention.blocked import BLOCK_TOKENS
from kvjax.attention.paged import paged_attention
from kvjax.attention.variants import AttentionVariant, sinks_window, sliding_window

Z, WINDOW, CONTEXT, SINKS = 16, 512, 8192, 4
KV_HEADS, HEADS, HEAD_DIM, SM_SCALE = 2, 4, 32, 0.125
FIRST_READ = (CONTEXT - WINDOW) // BLOCK_TOKENS * BLOCK_TOKENS // Z  # first page walked
BOUND = -(-(WINDOW + BLOCK_TOKENS) // Z)  # pages walked at most, at any context
SINK_PAGES = BLOCK_TOKENS // Z  # the sinks' block, walked before the window's
# Physical page 1 + i holds positions i*Z .. i*Z + Z - 1 (page 0 is the null page).
BEFORE_WINDOW, MIDDLE = slice(1, FIRST_READ + 1), slice(SINK_PAGES + 1, FIRST_READ + 1)


def _inputs(poisoned: slice = slice(0, 0)):
  pages = CONTEXT // Z + 1  # the null page 0, then the row's pages in order
  keys = jax.random.normal(jax.random.PRNGKey(0), (KV_HEADS, pages, Z, HEAD_DIM))
  values = jax.random.normal(jax.random.PRNGKey(1), (KV_HEADS, pages, Z, HEAD_DIM))
  keys, values = (x.at[:, poisoned].set(jnp.nan) for x in (keys, values))
  q = jax.random.normal(jax.random.PRNGKey(2), (1, 1, HEADS, HEAD_DIM))
  return q, keys, values


def _decode(poisoned: slice = slice(0, 0), **window):
  q, keys, values = _inputs(poisoned)
  tables = jnp.arange(1, keys.shape[1], dtype=jnp.int32)[None]
  kv_lens = jnp.array([CONTEXT], jnp.int32)
  return np.asarray(paged_attention(q, keys, values, kv_lens, tables, sm_scale=SM_SCALE,
                                    q_lens=jnp.ones(1, jnp.int32), **window))


def _sinks_window_oracle() -> np.ndarray:
  """float64 dense attention of the last position over the first SINKS keys and the last
  WINDOW ones, from the definition -> [1, 1, N, H]."""
  q, keys, values = (np.asarray(x, np.float64) for x in _inputs())
  p = CONTEXT - 1
  seen = [j for j in range(p + 1) if j < SINKS or j > p - WINDOW]
  k = keys[:, 1:].reshape(KV_HEADS, CONTEXT, HEAD_DIM)[:, seen]  # [K, S, H]
  v = values[:, 1:].reshape(KV_HEADS, CONTEXT, HEAD_DIM)[:, seen]
  out = np.zeros((HEADS, HEAD_DIM))
  for head in range(HEADS):
    kv_head = head // (HEADS // KV_HEADS)
    scores = k[kv_head] @ q[0, 0, head] * SM_SCALE
    weights = np.exp(scores - scores.max())
    out[head] = weights / weights.sum() @ v[kv_head]
  return out[None, None]


def test_windowed_decode_reads_only_the_windows_blocks():
  """A window, the model's (kvjax/attention/variants.py layer_variant) or attention='s."""
  assert CONTEXT // Z - FIRST_READ <= BOUND  # what the walk reads: a bound, not the context
  out = _decode(BEFORE_WINDOW, variant=sliding_window(WINDOW))
  assert np.isfinite(out).all()
  np.testing.assert_allclose(out, _decode(variant=sliding_window(WINDOW)), rtol=1e-5, atol=1e-6)


def test_sinks_window_decode_reads_the_sinks_and_the_window_only():
  out = _decode(MIDDLE, variant=sinks_window(SINKS, WINDOW))
  assert np.isfinite(out).all()
  np.testing.assert_allclose(out, _sinks_window_oracle(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("variant", [None, AttentionVariant(
    "sinks-window-unbounded", mask=sinks_window(SINKS, WINDOW).mask, monotone=True)],
                         ids=["full", "sinks_window_mask_alone"])
def test_unbounded_attention_reads_every_page(variant):
  # The poison is seen where nothing bounds the keys: the tests above can fail.
  assert np.isnan(_decode(MIDDLE, variant=variant)).all()
