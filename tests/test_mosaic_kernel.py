"""mosaic_paged_decode: reference vs float64 brute force, the kernel in jax's GPU
interpreter (on the CPU) vs the reference, and the wrapper's errors.

The brute force is independent of both: per sequence and q head, a numpy
float64 softmax over the keys of the pages its table lists, in table order.
Each tolerance sits at least ten times below the error of a k/v swap or of
reading a wrong page, which `test_tolerances_catch_*` demonstrates.
"""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import mosaic_paged_decode
from pallas_kernels import mosaic_paged_decode_reference

F32_TOL = 1e-5
BF16_TOL = 1e-2  # the kernel rounds the softmax weights to bf16 before P @ V.
SCALE = 0.125


def _problem(batch, num_q_heads, num_kv_heads, head_dim, page_size, pages_per_seq, dtype,
             seed=0, spare_pages=3):
  """Random q/K/V, each sequence on its own shuffled pages of a larger pool."""
  rng = np.random.default_rng(seed)
  num_pages = batch * pages_per_seq + spare_pages
  q = rng.standard_normal((batch, num_q_heads, head_dim))
  k = rng.standard_normal((num_kv_heads, num_pages, page_size, head_dim))
  v = rng.standard_normal((num_kv_heads, num_pages, page_size, head_dim))
  tables = rng.permutation(num_pages)[:batch * pages_per_seq].reshape(batch, pages_per_seq)
  cast = lambda x: jnp.asarray(x, dtype)
  return cast(q), cast(k), cast(v), jnp.asarray(tables, jnp.int32)


def _brute_force(q, k, v, tables, sm_scale):
  q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
  tables = np.asarray(tables)
  batch, num_q_heads, head_dim = q.shape
  num_kv_heads = k.shape[0]
  group = num_q_heads // num_kv_heads
  out = np.zeros_like(q)
  for b in range(batch):
    for n in range(num_q_heads):
      h = n // group
      keys = np.concatenate([k[h, page] for page in tables[b]])  # [keys, head_dim]
      values = np.concatenate([v[h, page] for page in tables[b]])
      scores = keys @ q[b, n] * sm_scale
      weights = np.exp(scores - scores.max())
      out[b, n] = weights @ values / weights.sum()
  return out


def _max_err(a, b):
  return float(np.max(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64))))


# -- the reference ---------------------------------------------------------------


@pytest.mark.parametrize("batch,num_q_heads,num_kv_heads,head_dim,page_size,pages_per_seq", [
    (3, 4, 4, 32, 8, 5),  # MHA, keys not a multiple of 64: the reference has no tiling limits
    (2, 8, 2, 64, 16, 4),  # GQA group 4
    (1, 6, 1, 24, 4, 7),  # MQA, odd head_dim and page size
])
def test_reference_matches_float64_brute_force(batch, num_q_heads, num_kv_heads, head_dim,
                                               page_size, pages_per_seq):
  args = _problem(batch, num_q_heads, num_kv_heads, head_dim, page_size, pages_per_seq,
                  jnp.float32)
  got = mosaic_paged_decode_reference(*args, sm_scale=SCALE)
  assert got.shape == (batch, num_q_heads, head_dim) and got.dtype == jnp.float32
  assert _max_err(got, _brute_force(*args, SCALE)) < F32_TOL


def test_reference_keeps_bf16_and_computes_in_f32():
  args = _problem(2, 4, 2, 64, 16, 4, jnp.bfloat16)
  got = mosaic_paged_decode_reference(*args, sm_scale=SCALE)
  assert got.dtype == jnp.bfloat16
  # Exact math on the bf16 inputs, then one bf16 rounding of outputs below 4 in magnitude.
  assert _max_err(got, _brute_force(*args, SCALE)) < 2 ** -8 * 4


def test_tolerances_catch_swapped_kv_and_wrong_pages():
  q, k, v, tables = _problem(2, 8, 2, 64, 16, 4, jnp.float32)
  want = _brute_force(q, k, v, tables, SCALE)
  swapped = mosaic_paged_decode_reference(q, v, k, tables, sm_scale=SCALE)
  shifted = mosaic_paged_decode_reference(q, k, v, (tables + 1) % k.shape[1], sm_scale=SCALE)
  assert _max_err(swapped, want) > 10 * BF16_TOL
  assert _max_err(shifted, want) > 10 * BF16_TOL


# -- the kernel, interpreted ----------------------------------------------------


@pytest.mark.parametrize("num_q_heads,num_kv_heads,page_size,pages_per_seq,slots", [
    (4, 2, 16, 8, 4),  # 2 steps of 64 keys, ring capped at 2 slots
    (8, 1, 8, 24, 2),  # MQA, 8 pages per step, the ring wraps around (3 steps, 2 slots)
    (2, 2, 32, 6, 1),  # one slot: each step waits for its own copy
])
def test_interpreted_kernel_matches_reference(num_q_heads, num_kv_heads, page_size,
                                              pages_per_seq, slots):
  args = _problem(2, num_q_heads, num_kv_heads, 64, page_size, pages_per_seq, jnp.bfloat16,
                  seed=page_size)
  got = mosaic_paged_decode(*args, sm_scale=SCALE, slots=slots, interpret=True)
  want = mosaic_paged_decode_reference(*args, sm_scale=SCALE)
  assert got.shape == want.shape and got.dtype == jnp.bfloat16
  assert _max_err(got, want) < BF16_TOL
  swapped = mosaic_paged_decode_reference(args[0], args[2], args[1], args[3], sm_scale=SCALE)
  assert _max_err(got, swapped) > 10 * BF16_TOL


# -- the wrapper's errors -------------------------------------------------------


def _good():
  return dict(zip(("q", "k_pages", "v_pages", "block_tables"),
                  _problem(2, 4, 2, 64, 16, 4, jnp.bfloat16)))


def _with(**changes):
  args = _good()
  args.update(changes)
  return args


_BAD = [
    (dict(q=jnp.zeros((2, 4, 1, 64), jnp.bfloat16)), r"q must be \[batch, num_q_heads, head_dim\]"),
    (dict(k_pages=jnp.zeros((2, 11, 16), jnp.bfloat16)), "k_pages must be"),
    (dict(v_pages=jnp.zeros((2, 11, 8, 64), jnp.bfloat16)), r"k_pages.shape .* != v_pages.shape"),
    (dict(v_pages=jnp.zeros((2, 11, 16, 64), jnp.float16)),
     "k_pages.dtype bfloat16 != v_pages.dtype float16"),
    (dict(k_pages=jnp.zeros((2, 11, 16, 64), jnp.float16),
          v_pages=jnp.zeros((2, 11, 16, 64), jnp.float16)), "q.dtype bfloat16 != k_pages.dtype"),
    (dict(q=jnp.zeros((2, 4, 64), jnp.int8), k_pages=jnp.zeros((2, 11, 16, 64), jnp.int8),
          v_pages=jnp.zeros((2, 11, 16, 64), jnp.int8)), "q.dtype must be floating"),
    (dict(q=jnp.zeros((2, 4, 128), jnp.bfloat16)), r"head_dim of q \(128\) != head_dim of k_pages"),
    (dict(q=jnp.zeros((2, 3, 64), jnp.bfloat16)), "num_q_heads=3 is not a multiple of "
     "num_kv_heads=2"),
    (dict(block_tables=jnp.zeros((2, 4), jnp.int16)), "block_tables.dtype must be int32"),
    (dict(block_tables=jnp.zeros((3, 4), jnp.int32)), r"block_tables must be \[batch=2"),
    (dict(block_tables=jnp.zeros((2, 0), jnp.int32)), "at least one page"),
]

_BAD_FOR_KERNEL = [
    (dict(q=jnp.zeros((2, 4, 64), jnp.float32), k_pages=jnp.zeros((2, 11, 16, 64), jnp.float32),
          v_pages=jnp.zeros((2, 11, 16, 64), jnp.float32)), "bfloat16 or float16"),
    (dict(q=jnp.zeros((2, 4, 96), jnp.bfloat16), k_pages=jnp.zeros((2, 11, 16, 96), jnp.bfloat16),
          v_pages=jnp.zeros((2, 11, 16, 96), jnp.bfloat16)), "head_dim=96 must be a multiple of 64"),
    (dict(q=jnp.zeros((2, 130, 64), jnp.bfloat16)), "at most 64"),
    (dict(k_pages=jnp.zeros((2, 11, 12, 64), jnp.bfloat16),
          v_pages=jnp.zeros((2, 11, 12, 64), jnp.bfloat16)), "page_size=12 must be 8, 16, 32 or 64"),
    (dict(k_pages=jnp.zeros((2, 11, 128, 64), jnp.bfloat16),
          v_pages=jnp.zeros((2, 11, 128, 64), jnp.bfloat16)), "page_size=128"),
    (dict(block_tables=jnp.zeros((2, 3), jnp.int32)), r"3 \* 16 = 48 keys must be a multiple of 64"),
]


@pytest.mark.parametrize("changes,message", _BAD + _BAD_FOR_KERNEL)
def test_kernel_rejects_bad_inputs(changes, message):
  with pytest.raises(ValueError, match=message):
    mosaic_paged_decode(**_with(**changes), sm_scale=SCALE, interpret=True)


@pytest.mark.parametrize("changes,message", _BAD)
def test_reference_rejects_bad_inputs(changes, message):
  with pytest.raises(ValueError, match=message):
    mosaic_paged_decode_reference(**_with(**changes), sm_scale=SCALE)


def test_reference_accepts_what_only_the_kernel_rejects():
  for changes, _ in _BAD_FOR_KERNEL[:2]:
    mosaic_paged_decode_reference(**_with(**changes), sm_scale=SCALE)


@pytest.mark.parametrize("kwargs,message", [
    (dict(sm_scale="0.1"), "sm_scale must be a static Python float, got '0.1'"),
    (dict(sm_scale=SCALE, slots=0), "slots must be an int >= 1, got 0"),
])
def test_kernel_rejects_bad_static_arguments(kwargs, message):
  with pytest.raises(ValueError, match=message):
    mosaic_paged_decode(**_good(), interpret=True, **kwargs)
