"""A decode step under a window reads the window's blocks, not the whole table (issue 49).

The reference backend's decode walks from the block holding the window's first key
(kvjax/attention/paged.py), so at 8k context it reads a bounded number of pages.  The
proof counts what is read by poisoning: every page before that block holds NaN keys and
values, which any read would carry into the output (a masked weight 0 times NaN is NaN),
while the gather of the whole table does.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvjax.attention.blocked import BLOCK_TOKENS
from kvjax.attention.paged import paged_attention
from kvjax.attention.variants import sliding_window

Z, WINDOW, CONTEXT = 16, 512, 8192
KV_HEADS, HEADS, HEAD_DIM = 2, 4, 32
FIRST_READ = (CONTEXT - WINDOW) // BLOCK_TOKENS * BLOCK_TOKENS // Z  # first page walked
BOUND = -(-(WINDOW + BLOCK_TOKENS) // Z)  # pages walked at most, at any context


def _decode(poison: bool, **window):
  pages = CONTEXT // Z + 1  # the null page 0, then the row's pages in order
  keys = jax.random.normal(jax.random.PRNGKey(0), (KV_HEADS, pages, Z, HEAD_DIM))
  values = jax.random.normal(jax.random.PRNGKey(1), (KV_HEADS, pages, Z, HEAD_DIM))
  if poison:  # pages 1..FIRST_READ hold the positions before the first walked block
    keys, values = (x.at[:, 1:FIRST_READ + 1].set(jnp.nan) for x in (keys, values))
  q = jax.random.normal(jax.random.PRNGKey(2), (1, 1, HEADS, HEAD_DIM))
  tables = jnp.arange(1, pages, dtype=jnp.int32)[None]
  kv_lens = jnp.array([CONTEXT], jnp.int32)
  return np.asarray(paged_attention(q, keys, values, kv_lens, tables, sm_scale=0.125,
                                    q_lens=jnp.ones(1, jnp.int32), **window))


@pytest.mark.parametrize("window", [dict(sliding_window=WINDOW),
                                    dict(variant=sliding_window(WINDOW))],
                         ids=["model_window", "window_variant"])
def test_windowed_decode_reads_only_the_windows_blocks(window):
  assert CONTEXT // Z - FIRST_READ <= BOUND  # what the walk reads: a bound, not the context
  out = _decode(poison=True, **window)
  assert np.isfinite(out).all()
  np.testing.assert_allclose(out, _decode(poison=False, **window), rtol=1e-5, atol=1e-6)


def test_full_attention_reads_every_page():
  # The poison is seen where nothing bounds the keys: the test can fail.
  assert np.isnan(_decode(poison=True)).all()
