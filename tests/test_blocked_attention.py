"""Prefill chunks' blocked paged attention (kvjax/attention/blocked.py) against a float64
brute force over the pages, and what it buys: one prefill program per chunk shape."""
from __future__ import annotations

import numpy as np
import pytest

import jax.numpy as jnp

import kvjax
from kvjax.attention.mla import mla_paged_attention
from kvjax.attention.paged import paged_attention
from kvjax.attention.variants import sliding_window
from kvjax.engine.sched.batching import Packing

pytestmark = pytest.mark.quick

K, P, Z, H, N = 2, 48, 8, 16, 4  # kv heads, pages, page size, head dim, query heads
B, T = 3, 12  # rows, query columns (> DECODE_COLUMNS: the blocked path)


def _brute_force(q, keys, values, kv_lens, tables, sm_scale, window=None, sinks=None,
                 soft_cap=None):
  """float64, one query at a time: q [B, T, N, H]; keys / values [K, P, Z, H] (dequantized);
  -> [B, T, N, Hv]."""
  q, keys, values = (np.asarray(x, np.float64) for x in (q, keys, values))
  b, t, n, _ = q.shape
  group = n // keys.shape[0]
  out = np.zeros((b, t, n, values.shape[-1]))
  for row in range(b):
    for col in range(t):
      pos = kv_lens[row] - t + col
      seen = [j for j in range(kv_lens[row]) if j <= pos and (window is None or j > pos - window)]
      for head in range(n):
        kv = head // group
        k = np.stack([keys[kv, tables[row, j // Z], j % Z] for j in seen])
        v = np.stack([values[kv, tables[row, j // Z], j % Z] for j in seen])
        logits = k @ q[row, col, head] * sm_scale
        if soft_cap is not None:
          logits = soft_cap * np.tanh(logits / soft_cap)
        top = logits.max() if sinks is None else max(logits.max(), sinks[head])
        weights = np.exp(logits - top)
        denom = weights.sum() + (0.0 if sinks is None else np.exp(sinks[head] - top))
        out[row, col, head] = weights @ v / denom
  return out


@pytest.fixture(scope="module")
def pages():
  rng = np.random.default_rng(0)
  k, v = rng.normal(size=(2, 2, K, P, Z, H)).astype(np.float32)  # [2 layers, K, P, Z, H]
  q = rng.normal(size=(B, T, N, H)).astype(np.float32)
  # Rows at contexts across block boundaries (a block is 128 / Z = 16 pages, 128 keys).
  kv_lens = np.array([T + 3, T + 200, T + 131], np.int32)
  tables = np.stack([rng.permutation(np.arange(1, P))[:40] for _ in range(B)]).astype(np.int32)
  return q, k, v, kv_lens, tables


@pytest.mark.parametrize("options", [{}, {"window": 70}, {"soft_cap": 2.0},
                                     {"sinks": np.array([0.5, -1.0, 2.0, 0.0], np.float32)}],
                         ids=["causal", "window", "soft_cap", "sinks"])
def test_blocked_prefill_matches_a_float64_brute_force(pages, options):
  q, k, v, kv_lens, tables = pages
  kwargs = {key: value for key, value in options.items() if key != "window"}
  if "window" in options:  # the model's window is a variant (kvjax/attention/variants.py)
    kwargs["variant"] = sliding_window(options["window"])
  got = paged_attention(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), jnp.asarray(kv_lens),
                        jnp.asarray(tables), sm_scale=0.3, layer=1, **kwargs)
  expected = _brute_force(q, k[1], v[1], kv_lens, tables, 0.3, window=options.get("window"),
                          sinks=options.get("sinks"), soft_cap=options.get("soft_cap"))
  np.testing.assert_allclose(np.asarray(got), expected, rtol=2e-5, atol=2e-5)


def test_blocked_prefill_reads_int8_pages_through_their_scales(pages):
  q, k, v, kv_lens, tables = pages
  rng = np.random.default_rng(1)
  codes = [np.clip(np.round(x * 40), -127, 127).astype(np.int8) for x in (k, v)]
  scales = [rng.uniform(0.01, 0.05, size=x.shape[:-1]).astype(np.float32) for x in (k, v)]
  got = paged_attention(jnp.asarray(q), *map(jnp.asarray, codes), jnp.asarray(kv_lens),
                        jnp.asarray(tables), sm_scale=0.3, layer=0,
                        k_scales=jnp.asarray(scales[0]), v_scales=jnp.asarray(scales[1]))
  dequantized = [c[0].astype(np.float64) * s[0][..., None] for c, s in zip(codes, scales)]
  np.testing.assert_allclose(np.asarray(got), _brute_force(q, *dequantized, kv_lens, tables, 0.3),
                             rtol=2e-5, atol=2e-5)


def test_a_wider_table_changes_no_bit(pages):
  """Null columns past every row's length: the walk stops at the longest row, and blocks a
  query sees nothing of leave its softmax state exactly as it was."""
  q, k, v, kv_lens, tables = pages
  args = (jnp.asarray(q), jnp.asarray(k[0]), jnp.asarray(v[0]), jnp.asarray(kv_lens))
  narrow = paged_attention(*args, jnp.asarray(tables), sm_scale=0.3)
  wide = paged_attention(*args, jnp.asarray(np.pad(tables, ((0, 0), (0, 90)))), sm_scale=0.3)
  np.testing.assert_array_equal(np.asarray(narrow), np.asarray(wide))


def test_a_window_skips_blocks_no_real_row_sees(pages):
  """With a window, the walk starts at the earliest block a real row (q_lens > 0) sees; a
  padding row at start 0 does not pin it at block 0, and real rows still match."""
  q, k, v, kv_lens, tables = pages
  q_lens = np.array([0, T, 0], np.int32)  # row 1 alone is real: its window starts past 128
  got = paged_attention(jnp.asarray(q), jnp.asarray(k[0]), jnp.asarray(v[0]), jnp.asarray(kv_lens),
                        jnp.asarray(tables), sm_scale=0.3, variant=sliding_window(20),
                        q_lens=jnp.asarray(q_lens))
  expected = _brute_force(q, k[0], v[0], kv_lens, tables, 0.3, window=20)
  np.testing.assert_allclose(np.asarray(got)[1], expected[1], rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("t", [T, 2], ids=["blocked prefill", "decode gather"])
@pytest.mark.parametrize("window", [None, 70])
def test_blocked_mla_matches_a_float64_brute_force(pages, window, t):
  _, _, _, kv_lens, tables = pages
  rng = np.random.default_rng(2)
  r, hr = 12, 4
  latent = rng.normal(size=(2, P, Z, r + hr)).astype(np.float32)  # [L, P, Z, R + Hr]
  q = rng.normal(size=(B, t, N, r + hr)).astype(np.float32)
  got = mla_paged_attention(jnp.asarray(q), jnp.asarray(latent), jnp.asarray(kv_lens),
                            jnp.asarray(tables), value_dim=r, sm_scale=0.2, layer=1,
                            variant=None if window is None else sliding_window(window))
  entries = latent[1][None]  # one kv head: [1, P, Z, R + Hr]
  expected = _brute_force(q, entries, entries[..., :r], kv_lens, tables, 0.2, window=window)
  np.testing.assert_allclose(np.asarray(got), expected, rtol=2e-5, atol=2e-5)


def test_prefill_chunks_take_the_widest_table_where_backend_and_layout_allow(tiny_model):
  """One prefill program per chunk shape (B, T); decode keeps its width buckets; a layout
  that reads every column itself (KIVI int4) keeps prefill widths bucketed too."""
  sizes = dict(max_num_seqs=8, max_num_batched_tokens=512, page_size=16, max_pages_per_seq=128,
               num_draft=0, max_model_len=2048)
  bucketed = Packing.create(**sizes).shapes()
  full = Packing.create(**sizes, prefill_full_width=True).shapes()
  chunk_shapes = {(s.rows, s.columns) for s in bucketed if s.kind == "prefill"}
  assert len(chunk_shapes) == 18 and len(bucketed) == 101
  assert sorted((s.rows, s.columns) for s in full if s.kind == "prefill") == sorted(chunk_shapes)
  assert {s.width for s in full if s.kind == "prefill"} == {Packing.create(**sizes).max_table_width}
  assert [s for s in full if s.kind == "decode"] == [s for s in bucketed if s.kind == "decode"]

  assert kvjax.Engine(tiny_model, max_num_seqs=2).packing.prefill_full_width
  assert not kvjax.Engine(tiny_model, max_num_seqs=2, kv_dtype="int4").packing.prefill_full_width
  assert not kvjax.Engine(tiny_model, max_num_seqs=2,
                          backend="pallas_reference").packing.prefill_full_width
