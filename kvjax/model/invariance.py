"""Batch-invariant arithmetic: one trace-time switch that makes a row's numbers its own.

XLA picks a GEMM kernel (and its reduction order) by the row count: on XLA:CPU a
row of x @ w comes out bitwise the same for 8..32 rows and differently for 40 or
more, and attention's softmax sums differ with the width of the keys it reads.
So a token's logits depended on which requests shared its step and how its
prompt was chunked.  Under `batch_invariant(True)` (entered by every step program
whose backend says so, kvjax/runtime/xla_options.py jit_step) the math does the same
arithmetic for a row whatever surrounds it: projections run `tiled_rows`, the
same [ROW_TILE, I] matmul for every tile of rows (kvjax/model/layers.py dense), and
paged attention walks keys in fixed blocks in a fixed order, queries ROW_TILE
columns at a time (kvjax/attention/paged.py, blocked.py).  Costs and which
paths need it: docs/GUIDE.md "Batch-invariant decoding".
"""
from __future__ import annotations

import contextlib
import contextvars
from typing import Callable

import jax
import jax.numpy as jnp

__all__ = ["ROW_TILE", "batch_invariant", "is_on", "tiled_rows"]

# Rows per matmul tile: one GEMM program for every row (XLA:CPU keeps a row's result
# bitwise for 8..32 rows), and few padding rows for a decode step of a few requests.
ROW_TILE = 8

_ON = contextvars.ContextVar("kvjax_batch_invariant", default=False)


@contextlib.contextmanager
def batch_invariant(enabled: bool):
  """Trace-time context: math traced inside is batch-invariant when `enabled`."""
  token = _ON.set(bool(enabled))
  try:
    yield
  finally:
    _ON.reset(token)


def is_on() -> bool:
  """Whether the math being traced must be batch-invariant."""
  return _ON.get()


def tiled_rows(f: Callable[[jax.Array], jax.Array], x: jax.Array) -> jax.Array:
  """f over x [N, I] in tiles of ROW_TILE rows (zero rows pad the last) -> [N, O]: every
  row goes through the same [ROW_TILE, I] program, so its result is its own."""
  n = x.shape[0]
  tiles = -(-n // ROW_TILE)
  padded = jnp.pad(x, ((0, tiles * ROW_TILE - n), (0, 0)))
  out = jax.lax.map(f, padded.reshape(tiles, ROW_TILE, x.shape[1]))
  return out.reshape(tiles * ROW_TILE, -1)[:n]
