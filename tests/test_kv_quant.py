"""KV-cache quantization: int8 per token per head, int4 KIVI pages; bounds asserted."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kvjax
from kvjax.attention.backends import get_backend
from kvjax.caches import KIVIPagedKVCache, PagedKVCache, create_paged_cache
from kvjax.parallel import ledger
from kvjax.quant.affine import quantize_affine
from kvjax.quant.symmetric import pack_int4, quantize, unpack_int4
from kvjax.runtime.step_batch import make_step_batch
from kvjax.runtime.steps import prefill

L, K, N, H, G = 1, 2, 4, 16, 4  # layers, kv heads, q heads, head_dim, page size
PAGES_PER_SEQ = 6
PROMPTS = [[5, 9, 11, 40, 50, 60, 70, 80, 90, 100, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12], [7] * 13]


def _batch(slots, context, t, q_lens):
  """Rows `slots` appending t tokens (q_lens real) after `context` cached tokens."""
  tables = 1 + np.arange(len(slots) * PAGES_PER_SEQ, dtype=np.int32).reshape(len(slots), -1)
  return make_step_batch(np.zeros((len(slots), t)), context, q_lens, tables, slots)


def _random_kv(seed, s):
  keys = jax.random.split(jax.random.PRNGKey(seed), 3)
  k = jax.random.normal(keys[0], (2, s, K, H))
  k = k.at[..., 3].multiply(8.0)  # an outlier channel, as KIVI observed in real keys
  return jax.random.normal(keys[1], (2, s, N, H)), k, jax.random.normal(keys[2], (2, s, K, H))


@jax.jit
def _write(cache, k, v, batch):
  return cache.write(0, k, v, batch)


def _fill(cache, k, v, chunks):
  """Write k, v [B, S, K, H] in the given chunk lengths -> cache."""
  start = 0
  for t in chunks:
    batch = _batch([0, 1], [start, start], t, [t, t])
    cache = _write(cache, k[:, start:start + t], v[:, start:start + t], batch)
    start += t
  return cache


def test_symmetric_codes_round_trip():
  x = jax.random.normal(jax.random.PRNGKey(0), (8, 32))
  for bits, bound in ((8, 0.5 / 127), (4, 0.5 / 7)):
    codes, scale = quantize(x, bits, -1)
    err = jnp.abs(codes * scale[:, None] - x) / jnp.max(jnp.abs(x), -1, keepdims=True)
    assert float(err.max()) <= bound + 1e-6
  codes = jnp.asarray(np.random.default_rng(0).integers(-7, 8, (5, 6)), jnp.int8)
  assert pack_int4(codes).shape == (5, 3)
  np.testing.assert_array_equal(unpack_int4(pack_int4(codes)), codes)


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("width", [16, 4096])  # XLA's wide max reductions drop NaN
def test_a_nonfinite_slice_dequantizes_to_nan_and_the_rest_round_trips(bits, width):
  # Issue 33: a NaN slice got scale 1 and codes 0 (finite), hiding it from the engine.
  x = np.random.default_rng(0).normal(size=(4, width)).astype(np.float32)
  x[1, 3], x[2, 0] = np.nan, np.inf
  codes, scale = quantize(jnp.asarray(x), bits, axis=-1)
  back = np.asarray(codes, np.float32) * np.asarray(scale)[:, None]
  assert np.isnan(back[1:3]).all()
  top = 2 ** (bits - 1) - 1
  for row in (0, 3):  # oracle: absmax / qmax steps, rounding error at most half a step
    step = np.abs(x[row]).max() / top
    assert np.abs(back[row] - x[row]).max() <= step / 2 + 1e-6


def test_int8_attention_relative_error_is_small():
  q, k, v = _random_kv(0, 18)
  ref = PagedKVCache.create(L, K, 1 + 2 * PAGES_PER_SEQ, G, H, jnp.float32)
  q8 = PagedKVCache.create(L, K, 1 + 2 * PAGES_PER_SEQ, G, H, jnp.int8)
  batch = _batch([0, 1], [0, 0], 18, [18, 18])
  kwargs = dict(sm_scale=H ** -0.5, backend=get_backend("reference"))
  _, want = ref.attend(0, q, k, v, batch, **kwargs)
  cache, got = q8.attend(0, q, k, v, batch, **kwargs)
  assert cache.k_pages.dtype == jnp.int8 and cache.k_scales.shape == (L, K, 13, G)
  rel = float(jnp.linalg.norm(got - want) / jnp.linalg.norm(want))
  assert rel < 2e-2, rel  # ~1.3%: the x8 outlier channel coarsens each token's scale


def _min_max_fake_quant(x: np.ndarray, axis: int, levels: int = 16) -> np.ndarray:
  """KIVI's int4 in float64: each slice's [min, max] in levels - 1 steps, round to nearest."""
  low, high = x.min(axis=axis, keepdims=True), x.max(axis=axis, keepdims=True)
  step = np.where(high > low, (high - low) / (levels - 1), 1.0)
  return np.round((x - low) / step) * step + low


@pytest.mark.parametrize("bits", [4, 8])
def test_affine_quantization_uses_every_code_and_errs_half_a_step(bits):
  rng = np.random.default_rng(3)
  x = rng.uniform(2.0, 5.0, size=(6, 4096)).astype(np.float32)  # skewed: all positive
  x[2] = 1.25  # a constant slice dequantizes exactly
  x[4, 7], x[5, 0] = np.nan, -np.inf
  codes, scale, offset = quantize_affine(jnp.asarray(x), bits, axis=-1)
  back = np.asarray(codes, np.float32) * np.asarray(scale)[:, None] + np.asarray(offset)[:, None]
  assert np.isnan(back[4:]).all()  # non-finite slices stay visible
  np.testing.assert_array_equal(back[2], x[2])
  half = 2 ** (bits - 1)
  for row in (0, 1, 3):
    np.testing.assert_array_equal(np.unique(np.asarray(codes[row])), np.arange(-half, half))
    step = (x[row].max() - x[row].min()) / (2 * half - 1)
    assert np.abs(back[row] - x[row]).max() <= step / 2 + 1e-5
    np.testing.assert_allclose(back[row], _min_max_fake_quant(
        x[row].astype(np.float64), 0, 2 * half), atol=1e-5)
  if bits == 4:  # the codes -8..7 survive int4 packing
    np.testing.assert_array_equal(unpack_int4(pack_int4(codes)), codes)


def test_int4_pages_match_a_fake_quant_oracle_for_any_chunking():
  _, k, v = _random_kv(1, 18)  # 4 full pages of 4, then 2 tokens in the residual
  oracles = []
  for chunks in ((18,), (1,) * 18, (5, 7, 1, 5), (3, 13, 2)):
    cache = _fill(KIVIPagedKVCache.create(L, K, 13, G, H, num_slots=2,
                                          residual_dtype=jnp.float32), k, v, chunks)
    keys, values = cache.read(0, _batch([0, 1], [18, 18], 1, [0, 0]))
    oracles.append((np.asarray(keys[:, :18]), np.asarray(values[:, :18])))
  for keys, values in oracles[1:]:  # a page's codes never depend on the chunking
    np.testing.assert_array_equal(keys, oracles[0][0])
    np.testing.assert_array_equal(values, oracles[0][1])
  pages_k = np.asarray(k[:, :16], np.float64).reshape(2, 4, G, K, H)
  want_k = _min_max_fake_quant(pages_k, axis=2).reshape(2, 16, K, H)  # per channel, page
  want_v = _min_max_fake_quant(np.asarray(v[:, :16], np.float64), axis=3)  # per token
  np.testing.assert_allclose(oracles[0][0][:, :16], want_k, atol=1e-5)
  np.testing.assert_allclose(oracles[0][1][:, :16], want_v, atol=1e-5)
  # The residual (positions 16, 17) is exact.
  np.testing.assert_array_equal(oracles[0][0][:, 16:], k[:, 16:])
  np.testing.assert_array_equal(oracles[0][1][:, 16:], v[:, 16:])


def test_int4_per_channel_keys_beat_per_token_on_outlier_channels():
  _, k, _ = _random_kv(2, 16)
  cache = _fill(KIVIPagedKVCache.create(L, K, 13, G, H, num_slots=2,
                                        residual_dtype=jnp.float32), k, k, (16,))
  keys, values = cache.read(0, _batch([0, 1], [16, 16], 1, [0, 0]))
  err_channel = float(jnp.linalg.norm(keys[:, :16] - k))  # KIVI keys
  err_token = float(jnp.linalg.norm(values[:, :16] - k))  # the same data, per token
  assert err_channel < 0.5 * err_token, (err_channel, err_token)
  # The quantizer's bound, element by element: round to nearest on a grid of
  # (max - min) / 15 per page (G tokens) and channel errs at most half a step.
  pages = np.asarray(k).reshape(2, 4, G, K, H)
  half_step = (pages.max(axis=2, keepdims=True) - pages.min(axis=2, keepdims=True)) / 30
  err = np.abs(np.asarray(keys[:, :16]).reshape(pages.shape) - pages)
  assert (err <= half_step + 1e-6).all(), float((err / half_step).max())


def _last_logits(model, kv_dtype, tokens):
  cfg = model.config
  cache = create_paged_cache(cfg, kv_dtype, 1, 1 + 8, 8, jnp.float32)
  batch = make_step_batch([tokens], [0], [len(tokens)], 1 + np.arange(8)[None])
  _, logits, _ = prefill(model.params, cache, batch, config=cfg)
  return np.asarray(logits[0])


# Each cached element errs at most half a step of its slice's absmax: 2^-8 relative for
# bf16 (8 significant bits), 1 / (2 * 127) for int8 and 1 / (2 * 7) for int4.  The last
# logits' relative error stays within that worst-case relative KV error (measured: 25%,
# 78% and 78% of it); a quantizer that truncates, or rounds on a coarser grid, exceeds it.
@pytest.mark.parametrize("kv_dtype, bound", [("bf16", 2.0 ** -8), ("int8", 1 / 254),
                                             ("int4", 1 / 14)])
def test_logit_error_bounds_on_a_random_model(tiny_model, kv_dtype, bound):
  tokens = list(range(3, 60))
  want = _last_logits(tiny_model, None, tokens)
  got = _last_logits(tiny_model, kv_dtype, tokens)
  rel = np.linalg.norm(got - want) / np.linalg.norm(want)
  assert rel < bound, (kv_dtype, rel)


def test_int8_greedy_agrees_with_the_float_cache(tiny_model):
  # A random model's top-2 logits are often near ties, so allow rare flips.
  want = np.array(kvjax.generate(tiny_model, PROMPTS, 32, page_size=8).tokens)
  got = np.array(kvjax.generate(tiny_model, PROMPTS, 32, page_size=8, kv_dtype="int8").tokens)
  assert (got == want).mean() >= 0.9
  assert (got[:, :16] == want[:, :16]).all()


@pytest.mark.parametrize("with_mtp", [True, False], ids=["mtp", "plain"])
@pytest.mark.parametrize("kv_dtype", ["bf16", "int8", "int4"])
def test_cache_bytes_per_token_match_the_ledger(kv_dtype, with_mtp):
  cfg = kvjax.get_preset("tiny-code")  # MTP layers hold KV only when drafting
  page_size, num_pages = 16, 9
  cache = create_paged_cache(cfg, kv_dtype, 2, num_pages, page_size, jnp.float32,
                             with_mtp=with_mtp)
  stored = sum(x.nbytes for name, x in vars(cache).items()
               if x is not None and not name.endswith("residual"))
  per_token = stored / (num_pages * page_size)
  ideal = ledger.kv_bytes_per_token(cfg, kv_dtype, include_mtp=with_mtp)
  scales = ledger.kv_scale_bytes_per_token(cfg, kv_dtype, include_mtp=with_mtp)
  assert per_token == ideal + scales  # KIVI's per-page key scales included (PAGE_SIZE 16)


def test_int8_pages_reach_the_pallas_contract_with_their_scales(tiny_model):
  kwargs = dict(page_size=8, kv_dtype="int8")
  want = kvjax.generate(tiny_model, PROMPTS[:1], 8, **kwargs).tokens
  assert kvjax.generate(tiny_model, PROMPTS[:1], 8, backend="pallas_reference",
                        **kwargs).tokens == want


@pytest.mark.parametrize("kwargs, match", [
    (dict(kv_dtype="int3"), "unsupported kv_dtype"),
    (dict(kv_dtype="int8", cache="contiguous"), "cache='paged'"),
    (dict(kv_dtype="int4", backend="pallas_reference"), "not supported by attention backend"),
])
def test_errors_unsupported_kv_dtype(tiny_model, kwargs, match):
  with pytest.raises(ValueError, match=match):
    kvjax.generate(tiny_model, PROMPTS[:1], 2, **kwargs)


def test_one_dtype_vocabulary_for_weights_and_pages(tiny_model):
  # --dtype and --kv-dtype take the same words: long and short spellings are one dtype.
  assert kvjax.load_checkpoint("tiny", dtype="bf16").dtype == jnp.bfloat16
  short = kvjax.generate(tiny_model, PROMPTS[:1], 4, kv_dtype="bf16").tokens
  assert kvjax.generate(tiny_model, PROMPTS[:1], 4, kv_dtype="bfloat16").tokens == short
  eng = kvjax.Engine(tiny_model, kv_dtype="bfloat16", max_num_seqs=1, max_model_len=64)
  assert eng.config.kv_dtype == "bf16" and eng.state.cache.k_pages.dtype == jnp.bfloat16
  assert ledger.kv_bytes_per_token(tiny_model.config, "bfloat16") == \
      ledger.kv_bytes_per_token(tiny_model.config, "bf16")
